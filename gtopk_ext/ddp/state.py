"""The state of the DDP hook: plain data, grouped by role; the algorithm is :mod:`gtopk_ext.ddp.hook`."""

from __future__ import annotations

import logging
import warnings
from typing import Optional, Union

import torch
import torch.distributed as dist

from gtopk_ext._worker import Worker
from gtopk_ext.collectives import SPARSE_COLLECTIVES, Collective, OkTopkState, collective_named, group_rank_and_size
from gtopk_ext.compressors import Compressor, check_density
from gtopk_ext.ddp import checkpoint, dgc, optimizer_check
from gtopk_ext.ddp.amp import LossScaling
from gtopk_ext.ddp._moved import MOVED, count, folded_compressor, folded_momentum
from gtopk_ext.ddp.dgc import MomentumCorrection
from gtopk_ext.ddp.residuals import ResidualStore
from gtopk_ext.ddp.schedule import DensitySchedule, checked_schedule, density_at
from gtopk_ext.ddp.stats import BucketStats, RunTotals, step_stats, summary
from gtopk_ext.hierarchical import HIERARCHICAL_INNER, Hierarchical
from gtopk_ext.paths import DenseQueue, PathPlan, PathPolicy, path_policy
from gtopk_ext.resume import StateDicts
from gtopk_ext.wire import wire_named

logger = logging.getLogger("gtopk_ext.hooks")

FLAT_COLLECTIVES = (*SPARSE_COLLECTIVES, "dense")
# "hierarchical": the earlier spelling of hierarchical=gx.Hierarchical(...)
COLLECTIVES = (*FLAT_COLLECTIVES, "hierarchical")


class SparseGradState:
    r"""State of :func:`gtopk_ext.sparse_grad_hook`, one per DDP model (and per rank). Plain data: the
    configuration, the residual store, the parts' own states (momentum correction, loss scaling) and the
    statistics; the algorithm is :func:`gtopk_ext.sparse_grad_hook`.

    Args:
        process_group: the group to reduce over (``None``: the default group). Dropped when pickled.
        density: fraction of each bucket sent, in (0, 1]; or a schedule: a list of ``(start_iter, density)``
            (each applies from its iteration on), e.g. :func:`gtopk_ext.exponential_warmup` or the gTop-k paper's
            ``[(0, 0.016), (1000, 0.004), (2000, 0.001)]``, or a callable ``iter -> density`` (a pure function:
            every rank must get the same density for the same iteration).
        compressor: ``"gaussiank"`` (default), ``"topk"``, ``"randomk"``, or a compressor made by
            :func:`gtopk_ext.make_compressor` with its options (``mode``, ``seed``, ``backend``, ``per_tensor``);
            its backend runs every op of the hook: selection, merges, scatters.
        collective: ``"gtopk"`` (default, O(k log P)), ``"allgather"`` (O(kP)), ``"oktopk"`` (Ok-Topk, O(k) for any
            P; its per-bucket state is kept here and in checkpoints) or ``"dense"`` (plain allreduce).
        start_iter: iterations of dense allreduce before compressing. With error feedback it must be >= 2:
            DDP rebuilds its buckets after the first iteration.
        path: how each bucket's path is chosen once it may compress (:class:`gtopk_ext.PathPolicy`):
            ``"auto"`` (default) takes, per bucket and step, the cheapest of the sparse collective at the step's
            density, a dense allreduce in bfloat16 or in scaled 8-bit floats (their rounding kept in the
            residual) and the dense allreduce, as predicted from this group's measured steps, the same on every
            rank; ``"sparse"``, ``"dense16"``, ``"dense8"`` or ``"dense"`` force one. Buckets under
            ``PathPolicy.min_compress_numel`` (1024) elements go dense.
        wire: the sparse collectives' wire format (:mod:`gtopk_ext.wire`): ``"plain"`` (default) or ``"compact"``
            (4 bytes a pair: float16 values, their rounding error kept in the residual; 16-bit indices).
        momentum: :class:`gtopk_ext.MomentumCorrection` (DGC's momentum correction and local clipping; a number m
            is ``MomentumCorrection(m)``), or None.
        hierarchical: :class:`gtopk_ext.Hierarchical`: dense inside a node, ``collective`` between nodes; or None.
            Not with momentum correction or per-tensor selection.
        error_feedback: keep what is not applied in a per-bucket residual (default); False drops it.

    Fields besides the arguments:

    - Runtime options: ``stats_logging_frequency`` (log :meth:`stats` through ``logging``, logger
      ``gtopk_ext.hooks``, INFO, every this many iterations; 0 never; default 1000) and ``synchronous`` (finish
      each bucket inside the hook call instead of on the communication thread, for debugging: the results are
      bitwise the same), ``optimizer_check`` (with momentum correction, an optimizer that has momentum or weight
      decay on the parameters the hook reduces is reported before its step, once the hook has seen them:
      ``"raise"`` (default) a ValueError that says what to do, ``"warn"``, ``"off"``).
    - Residuals: ``residual_store`` (:class:`ResidualStore`; ``residuals`` is its per-bucket dict),
      ``residual_bounds`` (per bucket, (residual, bound on its max |value|) from the compressed step that left
      it: grad + residual cannot overflow while max |grad| + bound stays below the dtype's largest value, so it
      is not checked).
    - Parts: ``velocity_store`` (momentum correction's velocities, laid out as the residuals), ``loss_scaling``
      (:class:`gtopk_ext.ddp.amp.LossScaling`, see :meth:`attach_scaler`), ``oktopk_states`` (per bucket,
      Ok-Topk's regions and threshold).
    - Statistics and agreement: ``iter`` (iterations done; advanced on ``bucket.is_last()``), ``bucket_stats``
      (per bucket, the latest :class:`BucketStats`), ``run_totals`` (:class:`gtopk_ext.ddp.stats.RunTotals`),
      ``agreed_plans`` (per bucket, the :class:`gtopk_ext.paths.PathPlan` of its plan and path, and this rank's
      measured costs of its paths: while the plan stays, no header is exchanged), ``dense_queue``
      (:class:`gtopk_ext.paths.DenseQueue`: when the dense allreduces, queued one after another, last finished).

    What is guaranteed, with error feedback on: every element of ``grad + residual`` on every rank is either in
    the average this step returns or in the new residual (nothing is lost), in float32, bfloat16 and float16
    (gTop-k carries float16 sums in float32, the average is divided in float32).

    - A bucket whose ``grad + residual`` is not finite on some rank raises a flag inside the sparse payload; when
      any rank raised it, every rank takes the dense path: that rank sends its gradient and keeps its residual
      untouched (so a ``GradScaler`` sees the inf); the others send all of ``grad + residual`` (which is then
      applied, not lost) and keep nothing.
    - A parameter whose gradient in a bucket is exactly zero on this rank keeps its residual out of that step's
      selection. With ``find_unused_parameters=True`` DDP zeros an unused parameter's gradient and, when no rank
      used it, never copies the reduced values into ``.grad``: what the hook sent for it would be lost. So a
      parameter that a rank did not use this step gets none of that rank's residual applied, as DDP applies no
      gradient to it, and its residual waits for a step in which the rank uses it.
    - Loss scaling: see :meth:`attach_scaler`.
    - Buckets that go dense (small, warm-up) after a change of layout (a resume with other bucket sizes) add
      the residual parts of their parameters to the gradient they send: they are applied, not left behind.

    The arguments of earlier versions (``density_schedule``, ``compressor_kwargs``, ``random_seed``,
    ``per_tensor``, ``nesterov``, ``weight_decay``, ``masking_start_iter``, ``clip_norm``, ``local_size``,
    ``inner_collective``, ``collective="hierarchical"``, ``stats_logging_frequency``, ``synchronous``) still work
    and warn (DeprecationWarning) with where each now lives.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, density: DensitySchedule = 0.01,
                 compressor: Union[str, Compressor] = "gaussiank", collective: str = "gtopk", start_iter: int = 2,
                 path: Union[str, PathPolicy] = "auto", wire: str = "plain",
                 momentum: Union[MomentumCorrection, float, None] = None, hierarchical: Optional[Hierarchical] = None,
                 error_feedback: bool = True, **moved):
        unknown = set(moved) - set(MOVED)
        if unknown:
            raise TypeError(f"SparseGradState got unexpected keyword argument(s) {sorted(unknown)}")
        for name in moved:
            warnings.warn(f"SparseGradState({name}=...) is deprecated: use {MOVED[name]}", DeprecationWarning,
                          stacklevel=2)
        if "density_schedule" in moved:
            schedule = checked_schedule(moved["density_schedule"])
        elif isinstance(density, (int, float)) and not isinstance(density, bool):
            schedule = None
        else:
            schedule, density = checked_schedule(density), 0.01
            density = schedule[0][1] if isinstance(schedule, list) and schedule else density
        check_density(density)
        wire_named(wire)
        if isinstance(path, int) and not isinstance(path, bool):  # the earlier positional min_compress_numel
            warnings.warn(f"SparseGradState's sixth argument is path=; use {MOVED['min_compress_numel']}",
                          DeprecationWarning, stacklevel=2)
            moved["min_compress_numel"], path = path, "auto"
        policy = path_policy(path)
        if "min_compress_numel" in moved:
            policy = PathPolicy(policy.mode, moved["min_compress_numel"], policy.recalibrate_every)
        if collective == "hierarchical":
            warnings.warn("SparseGradState(collective='hierarchical') is deprecated: use "
                          "hierarchical=gx.Hierarchical(local_size) with the collective between nodes",
                          DeprecationWarning, stacklevel=2)
            collective = moved.get("inner_collective", "gtopk")
            if collective not in HIERARCHICAL_INNER:
                raise ValueError(f"inner_collective must be one of {HIERARCHICAL_INNER}, got {collective!r}")
            hierarchical = Hierarchical(moved.get("local_size"))
        if collective not in FLAT_COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        compressor = folded_compressor(compressor, float(density), moved)
        momentum = folded_momentum(momentum, moved)
        if hierarchical is not None:
            if not isinstance(hierarchical, Hierarchical):
                raise TypeError(f"hierarchical must be a gx.Hierarchical or None, got {type(hierarchical).__name__}")
            if collective not in HIERARCHICAL_INNER:
                raise ValueError(f"hierarchical reduces with a sparse collective between nodes, one of "
                                 f"{HIERARCHICAL_INNER}; got collective={collective!r}")
            if (momentum is not None and momentum.momentum) or compressor.per_tensor:
                raise ValueError("hierarchical selects from a node's sum: it supports neither momentum correction "
                                 "(momentum > 0) nor per-tensor selection")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        if error_feedback and collective != "dense" and start_iter < 2:
            raise ValueError(f"start_iter must be >= 2 with error feedback (DDP rebuilds its buckets after the first "
                             f"iteration, which would misplace the residuals), got {start_iter}")
        # Configuration.
        self.process_group = process_group
        self.density = float(density)
        self.density_schedule = schedule
        self.compressor = compressor.kind
        self.compressor_template = compressor
        self.collective = collective
        self.start_iter = start_iter
        self.path_policy = policy
        self.wire = wire
        self.momentum_correction = momentum
        self.hierarchical = hierarchical
        self.error_feedback = bool(error_feedback)
        self.stats_logging_frequency = count("stats_logging_frequency", moved.get("stats_logging_frequency", 1000))
        self.synchronous = bool(moved.get("synchronous", False))
        self.optimizer_check = "raise"
        # Residuals and the parts' states.
        self.residual_store = ResidualStore()
        self.residual_bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.velocity_store = ResidualStore()
        self.loss_scaling = LossScaling()
        self.oktopk_states: dict[int, OkTopkState] = {}
        # Statistics and agreement.
        self.iter = 0
        self.bucket_stats: dict[int, BucketStats] = {}
        self.run_totals = RunTotals()
        self.dense_queue = DenseQueue()
        self.agreed_plans: dict[int, PathPlan] = {}
        # Runtime: the compressor of the current density, the collective (on its backend), the worker (created at
        # the first bucket), whether an iteration has begun.
        self.compressor_now: Compressor = compressor
        self.collective_now: Collective = collective_named(collective, compressor.backend)
        self.thread: Optional[Worker] = None
        self.iteration_open = False
        if self.momentum:
            optimizer_check.watch(self)

    # ----- the options of earlier versions, read from where they now live -----

    @property
    def momentum(self) -> float:
        return self.momentum_correction.momentum if self.momentum_correction is not None else 0.0

    @property
    def nesterov(self) -> bool:
        return self.momentum_correction is not None and self.momentum_correction.nesterov

    @property
    def weight_decay(self) -> float:
        return self.momentum_correction.weight_decay if self.momentum_correction is not None else 0.0

    @property
    def masking_start_iter(self) -> int:
        return self.momentum_correction.masking_start_iter if self.momentum_correction is not None else 0

    @property
    def clip_norm(self) -> Optional[float]:
        return self.momentum_correction.clip_norm if self.momentum_correction is not None else None

    @property
    def min_compress_numel(self) -> int:
        return self.path_policy.min_compress_numel

    @property
    def per_tensor(self) -> bool:
        return self.compressor_template.per_tensor

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        return self.residual_store.residuals

    @residuals.setter
    def residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        self.residual_store.residuals = residuals

    def knows_parameters(self) -> bool:
        """Whether the hook has seen the model's parameters yet (the optimizer check waits for them)."""
        return self.residual_store.knows_parameters()

    def knows(self, parameter: torch.Tensor) -> bool:
        """Whether the hook reduces ``parameter``'s gradient."""
        return self.residual_store.knows(parameter)

    @property
    def residual_scale(self) -> float:
        return self.loss_scaling.scale

    @classmethod
    def recipe(cls, density: float = 0.01, warmup_steps: int = 44, process_group: Optional[dist.ProcessGroup] = None,
               momentum: float = 0.9, **options) -> "SparseGradState":
        """The settings that train as fast per step as dense SGD with momentum, at a fraction of its bytes
        (measured in docs/performance.md's race, where a 44-step warm-up reached 95% in DDP's steps on every seed,
        and sooner in seconds than a 20-step one, which took 10-15 steps more): two dense steps, then Deep Gradient
        Compression's exponential warm-up of the density from 0.25 to ``density`` over ``warmup_steps`` steps
        (``path="auto"`` sends a dense step in bfloat16 wherever a sparse one would cost more: about what
        fp16_compress_hook costs), and momentum correction with Nesterov
        momentum ``momentum`` in the hook, its masking from the warm-up's end. ``options``: other arguments
        (``collective``, ``compressor``, ``wire``, ...).

        The hook then applies the momentum: train with an optimizer WITHOUT momentum or weight decay, e.g.
        ``torch.optim.SGD(model.parameters(), lr)`` (one with momentum is reported before its first step)::

            state = gx.SparseGradState.recipe(density=0.01, warmup_steps=44)
            ddp_model.register_comm_hook(state, gx.sparse_grad_hook)
        """
        schedule, correction = dgc.recipe(density, warmup_steps, momentum)
        return cls(process_group, density=schedule, momentum=correction, **options)

    def attach_scaler(self, scaler) -> None:
        """Let the hook follow a ``torch.amp.GradScaler`` (call before training; the scaler stays yours).

        The gradients DDP hands the hook are multiplied by the loss scale, and the scale changes between steps.
        The residuals are kept multiplied by the scale of the latest step (``residual_scale``): when a new step
        brings another scale, they are rescaled first (exact: the scaler's factors are powers of two), so old
        residual is never applied with another step's factor. When the scaler skips a step (an inf or NaN
        gradient; recognised by its scale backing off at the next step, so call ``scaler.update()`` once per step
        without ``new_scale``), everything the hook took out of the residuals in that step goes back into them:
        nothing is lost. The finite gradients of compressed buckets of a skipped step stay in the residuals too
        (as if the step had sent nothing); those of dense buckets are dropped with the step, as plain DDP does.
        With momentum correction the velocity follows the same rule: a compressed bucket's keeps the skipped
        step's update (whose increment stays in the residual) without the step's masking, a dense bucket's goes
        back to before the step.
        """
        if not callable(getattr(scaler, "get_scale", None)) or not callable(getattr(scaler, "is_enabled", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.loss_scaling.scaler = scaler

    def density_at(self, iteration: int) -> float:
        """The density of ``iteration`` (the schedule's, else ``density``)."""
        return density_at(self.density, self.density_schedule, iteration)

    def use_density(self, density: float) -> None:
        """The compressor of ``density`` becomes the current one."""
        self.compressor_now = self.compressor_now.with_density(density)

    def worker(self) -> Worker:
        """The worker that runs this state's buckets, started at the first bucket (again after a close)."""
        if self.thread is None or self.thread.closed:
            self.thread = Worker(group_rank_and_size(self.process_group)[0], "sparse_grad_hook")
        return self.thread

    # ----- pickling, checkpoints, statistics (each waits for the buckets in flight) -----

    def wait(self) -> None:
        """Wait until every bucket handed to the hook has finished."""
        if self.thread is not None:
            self.thread.drain()

    def __getstate__(self):
        """Everything but the process group (not picklable), the scaler, the communication thread and the
        parameter identities of this process."""
        self.wait()
        if self.process_group is not None:
            logger.warning("SparseGradState: the process group is not pickled; the unpickled state uses the default "
                           "group unless its process_group is set again")
        loss_scaling = LossScaling()
        loss_scaling.scale = self.loss_scaling.scale
        loss_scaling.taken = self.loss_scaling.taken
        loss_scaling.velocities_before = self.loss_scaling.velocities_before
        return dict(self.__dict__, process_group=None, loss_scaling=loss_scaling, thread=None, iteration_open=False)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.momentum:
            optimizer_check.watch(self)

    def state_dict(self) -> dict:
        """This rank's resumable state: ``{"iter", "world_size", "rank", "residuals": {bucket_index: Tensor},
        "residual_scale", "layouts", "unclaimed", "velocities", "velocities_before", "oktopk", "taken", "totals"}``
        (copies; "velocities": momentum correction's, as a residual store's state; "taken" and "velocities_before":
        what the latest step applied and the velocities before it, in case the scaler skipped it; "totals":
        :meth:`stats`'s "run"; no "world_size" and "rank" without torch.distributed). Save one per rank, next to
        the model's and the optimizer's (and the scaler's)."""
        return checkpoint.saved_state(self)

    def load_state_dict(self, state_dict: StateDicts, on_world_size_change: str = "error") -> None:
        """Restore :meth:`state_dict`'s output. Load it before the DDP model's first backward of this process:
        parameters are recognised by the order in which DDP's first buckets list them.

        The residuals are per rank. At another world size than the saved one, ``on_world_size_change`` says what
        becomes of them, on every rank alike (the iteration and the run totals always load): ``"error"``
        (default) raises a ValueError naming both sizes (so does another rank's state_dict); ``"fold"`` takes
        every saved rank's state_dict as a list in rank order: this rank adds up the residuals of the saved ranks
        ``q`` with ``q % world_size == rank`` and sends them whole in the first step, dense on every rank
        (``start_iter`` becomes at least the resumed iteration + 1): nothing is lost; ``"zero"``: they start at
        zero (dropped). With either, the velocities, Ok-Topk's thresholds and the scaler's record start afresh.
        A state_dict that does not record its world size (older versions) loads as this rank's."""
        checkpoint.restore(self, state_dict, on_world_size_change)

    def stats(self) -> dict:
        """``{"iter", "buckets": {index: {...}}, "total": {...}, "run": {...}}``: the latest step's statistics per
        bucket and summed: ``k`` and ``selected`` (elements), ``bytes_sent`` and ``bytes_received`` (this rank),
        host seconds ``select_seconds`` (grad + residual, statistics, compaction, residual update) and
        ``exchange_seconds`` (the collective, writing the average); "run": the run's totals ``steps``,
        ``compressed_steps`` (some bucket sparse), ``bytes_sent``, ``bytes_received`` (this rank; a resume goes on)."""
        self.wait()
        return self._stats_now()

    def _stats_now(self) -> dict:
        return step_stats(self.iter, self.bucket_stats, self.run_totals)

    def summary(self) -> str:
        """:meth:`stats` as a few lines to print: the configuration, the run's totals, the latest step."""
        return summary(self)
