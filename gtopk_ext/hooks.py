"""The DDP communication hook: sparsified gradients with error feedback, in the shape of PyTorch's PowerSGD hook.

    state = gx.SparseGradState(process_group=None, density=0.01)   # gtopk collective, Gaussian-k compressor
    ddp_model.register_comm_hook(state, gx.sparse_grad_hook)

Each bucket of each rank is compressed to k = ceil(density * numel) (index, value) pairs after adding the
bucket's residual (what earlier steps did not apply), the pairs are reduced with the chosen collective, and
the bucket becomes the average over ranks. Whatever was not applied stays in the residual: no gradient is lost.
The work runs on a communication thread per state while the backward pass goes on (see :func:`sparse_grad_hook`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import logging
import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from gtopk_ext import ops
from gtopk_ext._worker import Worker, complete, fail, future_on
from gtopk_ext.collectives import (DTYPE_CODES, Agreement, Collective, DenseAllreduce, Disagreement, OkTopkState,
                                   collective_named, group_rank_and_size)
from gtopk_ext.compressors import COMPRESSOR_KINDS, Compressor, check_density, k_for_density, make_compressor, \
    tensor_shares
from gtopk_ext.costs import Traffic
from gtopk_ext.hierarchical import HIERARCHICAL_INNER, hierarchical_allreduce, resolve_local_size
from gtopk_ext.message import SparseMessage
from gtopk_ext.reduction import FLAG_NONFINITE, agree_plan, is_finite, put_back, reduce
from gtopk_ext.wire import Rounding, check_wire, wire_named

logger = logging.getLogger(__name__)

COLLECTIVES = ("gtopk", "allgather", "oktopk", "hierarchical", "dense")
DensitySchedule = Union[Sequence[tuple[int, float]], Callable[[int], float], None]
# (parameter ordinal, numel) of each parameter of a bucket, in the bucket's order; None for a bare tensor.
Layout = Union[tuple[tuple[int, int], ...], None]
# Seeds of the randomk draws: step = random_seed + iter * _STEPS_PER_ITER + bucket index, unique per bucket.
_STEPS_PER_ITER = 1 << 20

@dataclass
class BucketStats:
    """What the hook did with one bucket in its latest step."""

    path: str  # "sparse"; "dense" (warm-up, small bucket or dense collective); "nonfinite" (went dense)
    numel: int
    k: int  # slots sent per rank (numel on the dense paths)
    selected: Union[int, torch.Tensor] = 0  # elements the compressor selected before truncation to k
    select_seconds: float = 0.0  # grad + residual, statistics, compaction, residual update
    exchange_seconds: float = 0.0  # the collective (a dense bucket: from issuing its allreduce to its end)
    apply_seconds: float = 0.0  # the average written into the bucket, dropped contributions back to the residual
    traffic: Traffic = field(default_factory=Traffic, repr=False)


class ResidualStore:
    """Per-bucket error-feedback residuals that follow the parameters when DDP changes its buckets.

    Fields: ``residuals`` (per bucket index, the flat residual in that bucket's layout), ``layouts`` (the latest
    layout of every bucket seen), ``unclaimed`` (residual parts per parameter ordinal, left by a bucket whose
    layout changed, until a bucket that holds the parameter takes them), and the parameters' ordinals (in the
    order this process first saw them: the same on every rank and in a resumed process).
    """

    def __init__(self):
        self.residuals: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, Layout] = {}
        self.unclaimed: dict[int, torch.Tensor] = {}
        self._ordinals = WeakIdKeyDictionary()
        self._next_ordinal = 0

    def layout_of(self, parameters: Optional[Sequence[torch.Tensor]], numel: int) -> Layout:
        if parameters is None:
            return None
        layout = []
        for p in parameters:
            ordinal = self._ordinals.get(p)
            if ordinal is None:
                ordinal = self._ordinals[p] = self._next_ordinal
                self._next_ordinal += 1
            layout.append((ordinal, p.numel()))
        if sum(n for _, n in layout) != numel:
            raise ValueError(f"parameters hold {sum(n for _, n in layout)} elements, the bucket {numel}")
        return tuple(layout)

    def checkpoint_parts(self, index: int, layout: Layout) -> Optional[list[tuple[int, Layout]]]:
        """The known buckets that this new bucket is exactly made of.

        A fresh DDP model reduces its first iteration in one bucket; after a resume, reducing it in the
        checkpoint's buckets instead keeps the run bitwise identical to one that never stopped (also when no
        residual exists yet: the selection per bucket differs from the selection over their union)."""
        if layout is None or self.layouts.get(index) == layout:
            return None
        numels = dict(layout)
        parts = [(i, known) for i, known in sorted(self.layouts.items())
                 if known and all(numels.get(o) == n for o, n in known)]
        covered = [o for _, known in parts for o, _ in known]
        if sorted(covered) != sorted(numels):
            return None
        return parts

    def record(self, index: int, layout: Layout) -> None:
        """A bucket changed: its residual and every one that shares a parameter with it go to per-parameter parts,
        from which each bucket assembles its residual again on its next compressed step."""
        previous = self.layouts.get(index)
        if index in self.layouts and previous == layout:
            return
        self.layouts[index] = layout
        if layout is None:
            return
        changed = {o for o, _ in layout}
        for i in list(self.residuals):
            old_layout = previous if i == index else self.layouts.get(i)
            if old_layout is not None and (i == index or changed & {o for o, _ in old_layout}):
                residual, offset = self.residuals.pop(i), 0
                for ordinal, numel in old_layout:
                    self.unclaimed[ordinal] = residual[offset:offset + numel]
                    offset += numel

    def holds_any(self, index: int, layout: Layout) -> bool:
        return index in self.residuals or any(o in self.unclaimed for o, _ in layout or ())

    def residual(self, index: int, tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The bucket's residual (assembled from unclaimed parts, or zeros, when it has none in its layout)."""
        residual = self.residuals.get(index)
        if residual is not None and residual.numel() == tensor.numel() and residual.dtype == tensor.dtype:
            if residual.device != tensor.device:
                residual = self.residuals[index] = residual.to(tensor.device)
            return residual
        if residual is not None and bool(residual.any()):
            logger.warning("sparse_grad_hook: bucket %d changed from %d to %d elements without parameters to follow; "
                           "its residual is dropped", index, residual.numel(), tensor.numel())
        residual = torch.zeros_like(tensor)
        offset = 0
        for ordinal, numel in layout or ():
            part = self.unclaimed.pop(ordinal, None)
            if part is not None:
                residual[offset:offset + numel] = part.to(residual.device)
            offset += numel
        self.residuals[index] = residual
        return residual

    def __getstate__(self):
        """Without the parameter identities of this process."""
        return {"residuals": self.residuals, "layouts": self.layouts, "unclaimed": self.unclaimed}

    def __setstate__(self, state):
        self.__init__()
        self.__dict__.update(state)

    def all_tensors(self) -> list[torch.Tensor]:
        return [*self.residuals.values(), *self.unclaimed.values()]

    def state_dict(self) -> dict:
        return {"residuals": {index: r.detach().clone() for index, r in self.residuals.items()},
                "layouts": {index: None if layout is None else [list(p) for p in layout]
                            for index, layout in self.layouts.items()},
                "unclaimed": {ordinal: r.detach().clone() for ordinal, r in self.unclaimed.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.residuals = {int(i): r.detach().clone() for i, r in state_dict["residuals"].items()}
        self.layouts = {int(i): None if layout is None else tuple((int(o), int(n)) for o, n in layout)
                        for i, layout in state_dict.get("layouts", {}).items()}
        self.unclaimed = {int(o): r.detach().clone() for o, r in state_dict.get("unclaimed", {}).items()}


class SparseGradState:
    r"""State of :func:`sparse_grad_hook`, one per DDP model (and per rank). Plain data: the hyperparameters, the
    residual store, the loss-scaler bookkeeping and the statistics; the algorithm is :func:`sparse_grad_hook`.

    Args:
        process_group: the group to reduce over (``None``: the default group). Dropped when pickled.
        density: fraction of each bucket sent, in (0, 1].
        compressor: ``"gaussiank"`` (default), ``"topk"`` or ``"randomk"`` (see :func:`make_compressor`).
        collective: ``"gtopk"`` (default, O(k log P)), ``"allgather"`` (O(kP)), ``"oktopk"`` (Ok-Topk, O(k) for any
            P; its per-bucket state is kept here and in checkpoints), ``"hierarchical"`` (dense inside a node, the
            ``inner_collective`` between nodes: see ``local_size``) or ``"dense"`` (plain allreduce).
        start_iter: iterations of dense allreduce before compressing. With error feedback it must be >= 2:
            DDP rebuilds its buckets after the first iteration.
        min_compress_numel: buckets with fewer elements go dense.
        density_schedule: the density per iteration: a list of ``(start_iter, density)`` (each applies from its
            iteration on; ``density`` before the first), e.g. the gTop-k paper's warm-up
            ``[(0, 0.016), (1000, 0.004), (2000, 0.001)]``, or a callable ``iter -> density`` (a pure function:
            every rank must get the same density for the same iteration).
        random_seed: seeds the randomk draws (identical on every rank).
        stats_logging_frequency: log :meth:`stats` through ``logging`` (logger ``gtopk_ext.hooks``, INFO) every
            this many iterations; 0 never.
        error_feedback: keep what is not applied in a per-bucket residual (default); False drops it.
        compressor_kwargs: extra arguments of the compressor (``mode="paper"``, ``backend="triton"``, ...). The
            compressor's backend (resolved once per device) runs every op of the hook: selection, merges, scatters.
        wire: the sparse collectives' wire format (:mod:`gtopk_ext.wire`): ``"plain"`` (default) or ``"compact"``
            (4 bytes a pair: float16 values, their rounding error kept in the residual; 16-bit indices).
        synchronous: finish each bucket inside the hook call instead of on the communication thread (for
            debugging and for tests: the results are bitwise the same).
        momentum, nesterov, weight_decay: Deep Gradient Compression's momentum correction (Lin et al. 2018), with
            the optimizer then run WITHOUT momentum and weight decay (``torch.optim.SGD(params, lr)``): per bucket
            and rank, a velocity u and the residual v: ``g += weight_decay * w``, ``u = momentum * u + g``,
            ``v += u`` (Nesterov: ``v += g + momentum * u``), the compressor selects from v, and where a slot is
            applied both v and u are cleared (momentum factor masking). Dense paths (warm-up, small buckets,
            the dense collective) send u (Nesterov: g + momentum * u) and keep it. ``momentum=0`` (default):
            today's plain error feedback, bit for bit. Needs the buckets' parameters (a DDP model) for weight
            decay. Conserved: what entered v (the increments) = what was applied + what v keeps.
        masking_start_iter: with momentum correction, the iteration from which applied slots clear u (momentum
            factor masking); before it only v is cleared there. Masking during a dense-ish warm-up (a density
            warm-up from 0.25) clears the velocity of the elements sent at almost every step, which then train
            without momentum; starting it where the warm-up ends keeps their momentum. 0 (default): always.
        clip_norm: DGC's local gradient clipping: each rank scales each bucket's gradient so that its L2 norm is at
            most ``clip_norm / sqrt(P)`` (before weight decay and momentum), on every path. Per bucket, not over
            the model: a norm over the model would wait for the last bucket and undo the overlap.
        per_tensor: select within each parameter of a bucket separately, each with its share of the bucket's k
            (:func:`tensor_shares`), so that a tensor of small gradients (a LayerNorm, an embedding) is not
            starved by a larger-scaled one; the message stays k slots (``selected`` then counts used slots). It
            shapes the local selection: with ``collective="allgather"`` every share is applied, while gTop-k's
            merges still rank the whole bucket and send small-scaled shares back to the residual.
        local_size, inner_collective: with ``collective="hierarchical"``, a node is ``local_size`` consecutive
            ranks of the group (None: torchrun's ``LOCAL_WORLD_SIZE``). Each bucket is reduce-scattered densely
            inside the node, each local rank selects from its shard of the node's sum (with k split over the
            shards) and runs ``inner_collective`` (``"gtopk"``, ``"allgather"`` or ``"oktopk"``) with the same
            local rank of the other nodes, and the shards' averages are allgathered inside the node
            (:func:`gtopk_ext.collectives.hierarchical_allreduce`). A rank's residual is zero outside its shard.
            The wire applies between nodes. Not with ``momentum`` or ``per_tensor``. The node groups are created
            at the first compressed step by the process group's ranks alone: with a group smaller than the world,
            create the groups that every rank must create before that step.

    Fields besides the arguments:

    - Residual store: ``residual_store`` (:class:`ResidualStore`; ``residuals`` is its per-bucket dict),
      ``velocity_store`` (the velocities of momentum correction, in the same layouts),
      ``residual_scale`` (the residuals hold the gradient times this factor: the loss scale, see
      :meth:`attach_scaler`; 1.0 without), ``residual_bounds`` (per bucket, (residual, bound on its max |value|)
      from the compressed step that left it: grad + residual cannot overflow while max |grad| + bound stays
      below the dtype's largest value, so it is not checked), ``taken`` (with a scaler, per bucket: what this
      iteration took out of the residual, (indices or None for all, values), put back if the scaler skips it)
      and ``velocities_before`` (with a scaler and momentum: what each velocity goes back to if the scaler skips
      this iteration: a dense bucket's from before the update, a compressed bucket's from before the masking).
    - Statistics and agreement: ``iter`` (iterations done; advanced on ``bucket.is_last()``), ``bucket_stats``
      (per bucket, the latest :class:`BucketStats`), ``agreed_plans`` (per bucket, the (numel, dtype, path, k)
      that every rank checked it shares: while the plan stays, no header is exchanged), ``oktopk_states`` (per
      bucket, Ok-Topk's regions and threshold).

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
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, density: float = 0.01,
                 compressor: str = "gaussiank", collective: str = "gtopk", start_iter: int = 2,
                 min_compress_numel: int = 1024, density_schedule: DensitySchedule = None, random_seed: int = 0,
                 stats_logging_frequency: int = 1000, error_feedback: bool = True,
                 compressor_kwargs: Optional[dict] = None, synchronous: bool = False, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, clip_norm: Optional[float] = None,
                 per_tensor: bool = False, local_size: Optional[int] = None, inner_collective: str = "gtopk",
                 wire: str = "plain", masking_start_iter: int = 0):
        check_density(density)
        check_wire(wire)
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"clip_norm must be None or a number > 0, got {clip_norm!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        if compressor not in COMPRESSOR_KINDS:
            raise ValueError(f"compressor must be one of {COMPRESSOR_KINDS}, got {compressor!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        for name, value in (("start_iter", start_iter), ("min_compress_numel", min_compress_numel),
                            ("random_seed", random_seed), ("stats_logging_frequency", stats_logging_frequency),
                            ("masking_start_iter", masking_start_iter)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if collective == "hierarchical":
            if inner_collective not in HIERARCHICAL_INNER:
                raise ValueError(f"inner_collective must be one of {HIERARCHICAL_INNER}, got {inner_collective!r}")
            if momentum or per_tensor:
                raise ValueError("collective='hierarchical' selects from a node's sum: it supports neither momentum "
                                 "correction (momentum > 0) nor per_tensor=True")
            local_size = resolve_local_size(local_size)
        if error_feedback and collective != "dense" and start_iter < 2:
            raise ValueError(f"start_iter must be >= 2 with error feedback (DDP rebuilds its buckets after the first "
                             f"iteration, which would misplace the residuals), got {start_iter}")
        # Hyperparameters.
        self.process_group = process_group
        self.density = float(density)
        self.compressor = compressor
        self.collective = collective
        self.start_iter = start_iter
        self.min_compress_numel = min_compress_numel
        self.density_schedule = _checked_schedule(density_schedule)
        self.random_seed = random_seed
        self.stats_logging_frequency = stats_logging_frequency
        self.error_feedback = bool(error_feedback)
        self.compressor_kwargs = dict(compressor_kwargs or {})
        self.synchronous = bool(synchronous)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.masking_start_iter = masking_start_iter
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.per_tensor = bool(per_tensor)
        self.local_size = local_size
        self.inner_collective = inner_collective
        self.wire = wire
        # Residual store and loss-scaler bookkeeping.
        self.residual_store = ResidualStore()
        self.velocity_store = ResidualStore()  # momentum correction's velocities, laid out as the residuals
        self.residual_scale = 1.0
        self.residual_bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.taken: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.velocities_before: dict[int, torch.Tensor] = {}
        self.scaler = None
        # Statistics and agreement.
        self.iter = 0
        self.bucket_stats: dict[int, BucketStats] = {}
        self.agreed_plans: dict[int, Agreement] = {}
        self.oktopk_states: dict[int, OkTopkState] = {}  # per bucket, with collective="oktopk"
        # Runtime: the compressor of the current density, the communication thread (created at the first
        # bucket), whether an iteration has begun.
        self.compressor_now: Compressor = make_compressor(compressor, self.density, **self.compressor_kwargs)
        self.collective_now: Collective = _collective(self)
        self.thread: Optional[Worker] = None
        self.iteration_open = False

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        return self.residual_store.residuals

    @residuals.setter
    def residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        self.residual_store.residuals = residuals

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
        self.scaler = scaler

    def density_at(self, iteration: int) -> float:
        """The density of ``iteration`` (the schedule's, else ``density``)."""
        schedule = self.density_schedule
        if callable(schedule):
            density = schedule(iteration)
            check_density(density, f"density_schedule({iteration})")
            return float(density)
        density = self.density
        for start, scheduled in schedule or ():
            if iteration >= start:
                density = scheduled
        return density

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
        return dict(self.__dict__, process_group=None, scaler=None, thread=None, iteration_open=False)

    def __setstate__(self, state):
        self.__dict__.update(state)

    def state_dict(self) -> dict:
        """This rank's resumable state: ``{"iter", "residuals": {bucket_index: Tensor}, "residual_scale",
        "layouts", "unclaimed", "velocities", "velocities_before", "oktopk", "taken"}`` (copies; "velocities": momentum
        correction's, as a residual store's state; "taken" and "velocities_before": what the latest step applied
        and the velocities before it, in case the scaler skipped it). Save one per rank, next to the model's and
        the optimizer's (and the scaler's)."""
        self.wait()
        return {"iter": self.iter, "residual_scale": self.residual_scale, **self.residual_store.state_dict(),
                "velocities": self.velocity_store.state_dict(),
                "velocities_before": {index: v.clone() for index, v in self.velocities_before.items()},
                "oktopk": {index: s.state_dict() for index, s in self.oktopk_states.items()},
                "taken": {index: (None if indices is None else indices.clone(), values.detach().clone())
                          for index, (indices, values) in self.taken.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output. Load it before the DDP model's first backward of this process:
        parameters are recognised by the order in which DDP's first buckets list them."""
        missing = {"iter", "residuals"} - set(state_dict)
        if missing:
            raise KeyError(f"state_dict is missing {sorted(missing)} (expected SparseGradState.state_dict()'s keys)")
        iteration = state_dict["iter"]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"state_dict['iter'] must be an int >= 0, got {iteration!r}")
        self.wait()
        self.iter = iteration
        self.residual_store.load_state_dict(state_dict)
        self.velocity_store.load_state_dict(state_dict.get("velocities", {"residuals": {}}))
        self.residual_scale = float(state_dict.get("residual_scale", 1.0))
        self.taken = {int(i): (indices, values.detach().clone())
                      for i, (indices, values) in state_dict.get("taken", {}).items()}
        self.velocities_before = {int(i): v.clone() for i, v in state_dict.get("velocities_before", {}).items()}
        self.oktopk_states = {}
        for i, saved in state_dict.get("oktopk", {}).items():
            self.oktopk_states[int(i)] = OkTopkState()
            self.oktopk_states[int(i)].load_state_dict(saved)
        self.bucket_stats, self.residual_bounds, self.agreed_plans = {}, {}, {}

    def stats(self) -> dict:
        """The latest step's statistics: ``{"iter", "buckets": {index: {...}}, "total": {...}}``, each with
        ``k`` and ``selected`` (elements, summed over buckets), ``bytes_sent`` and ``bytes_received`` (this
        rank), and the host wall-clock seconds of the phases: ``select_seconds``, ``exchange_seconds``,
        ``apply_seconds``."""
        self.wait()
        return self._stats_now()

    def _stats_now(self) -> dict:
        buckets = {}
        for index, s in sorted(self.bucket_stats.items()):
            selected = int(s.selected) if isinstance(s.selected, torch.Tensor) else s.selected
            buckets[index] = {"path": s.path, "numel": s.numel, "k": s.k, "selected": selected,
                              "bytes_sent": s.traffic.sent, "bytes_received": s.traffic.received,
                              "select_seconds": s.select_seconds, "exchange_seconds": s.exchange_seconds,
                              "apply_seconds": s.apply_seconds}
        summed = ("numel", "k", "selected", "bytes_sent", "bytes_received", "select_seconds", "exchange_seconds",
                  "apply_seconds")
        total = {key: sum(b[key] for b in buckets.values()) for key in summed}
        return {"iter": self.iter, "buckets": buckets, "total": total}

    # ----- the entry point of the hook and of bare tensors -----

    def reduce(self, buffer: torch.Tensor, bucket_index: int, *, is_last: bool = True,
               parameters: Optional[Sequence[torch.Tensor]] = None) -> torch.futures.Future:
        """Average ``buffer`` (a flat bucket) over the group as :func:`sparse_grad_hook` does; the future's value is
        ``buffer``, overwritten. ``parameters``: the bucket's parameters in order (lets residuals follow them when
        DDP changes its buckets); ``is_last`` ends the iteration. Every rank must make the same calls, in the same
        order."""
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype not in DTYPE_CODES:
            raise ValueError(f"buffer must be a flat float32, float16 or bfloat16 tensor, got "
                             f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                             f"{tuple(getattr(buffer, 'shape', ()))}")
        parameters = None if parameters is None else list(parameters)

        def job(result: torch.futures.Future) -> None:
            _reduce_bucket(self, buffer, bucket_index, is_last, parameters, result)

        if self.thread is None or self.thread.closed:
            self.thread = Worker(group_rank_and_size(self.process_group)[0])
        if self.thread.failure is not None:
            raise RuntimeError(f"sparse_grad_hook: an earlier exchange failed ({self.thread.failure}); the state "
                               f"cannot go on") from self.thread.failure
        if not self.synchronous:
            result = self.thread.submit(job, buffer.device)
            if is_last:
                self.thread.drain()
            return result
        result = future_on(buffer.device)
        try:
            job(result)
            result.wait()
        except Disagreement:
            raise
        except BaseException as error:
            self.thread.fail(error)
            raise
        return result


def sparse_grad_hook(state: SparseGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over ranks, sparsified (see :class:`SparseGradState`).

    Register with ``ddp_model.register_comm_hook(state, sparse_grad_hook)``; it returns a future of the bucket's
    buffer, holding the average of what every rank applied this step. The bucket is handed to the state's
    communication thread and the backward pass goes on; on that thread, for each bucket in turn:

    1. Plan: the path (dense during the warm-up, for small buckets and the dense collective; else sparse) and k
       follow from replicated configuration (the iteration, the density schedule, the bucket's size). Ranks
       exchange a header only when a bucket's plan is new or changed, and all raise the same error if they differ.
    2. Select: acc = grad + residual is compressed to k slots; what is not selected stays in the residual. A rank
       whose acc is not finite selects nothing and raises a flag instead.
    3. Exchange: the sparse collective (gTop-k, allgather or Ok-Topk); the flags ride inside the payload.
    4. Apply: the bucket becomes the average of the global set (zeroed, then scattered); contributions a gTop-k
       merge dropped go back to the residual. If any rank raised the flag, every rank goes dense instead.
    5. Dense paths: the bucket (plus any residual it still holds) is divided by P and allreduced asynchronously.

    Why a thread rather than a chain of futures as in PyTorch's PowerSGD hook: on Gloo a future's callback runs on
    the thread that completed the previous collective, so a callback that issues the next collective races the
    autograd thread issuing the next bucket's, and ranks can issue them in different orders (PowerSGD's hook with
    several buckets on Gloo fails that way); gTop-k also needs log2(P) dependent rounds. One thread per state that
    takes the buckets in DDP's order issues every collective in the same order on every rank. The last bucket of
    an iteration returns only once every bucket has been issued: DDP issues collectives of its own right after it
    (``find_unused_parameters=True``); the exchanges of the earlier buckets overlap the backward pass.
    """
    return state.reduce(bucket.buffer(), bucket.index(), is_last=bucket.is_last(), parameters=bucket.parameters())


# ----- the algorithm, one bucket at a time (on the communication thread) -----


def _reduce_bucket(state: SparseGradState, buffer: torch.Tensor, index: int, is_last: bool,
                   parameters: Optional[list[torch.Tensor]], result: torch.futures.Future) -> None:
    if not state.iteration_open:
        _start_iteration(state)
    store = state.residual_store
    layout = store.layout_of(parameters, buffer.numel())
    parts = store.checkpoint_parts(index, layout)
    if parts is None:
        store.record(index, layout)
        state.velocity_store.record(index, layout)
        reduced = _reduce_part(state, buffer, index, layout, parameters)
    else:
        reduced = _reduce_in_parts(state, buffer, layout, parameters, parts)
    if is_last:
        _end_iteration(state)
    _chain(reduced, result, buffer, state.thread)


def _reduce_part(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout,
                 parameters: Optional[list[torch.Tensor]]) -> torch.futures.Future:
    """Steps 1-5 of :func:`sparse_grad_hook` for one bucket; a future of ``tensor``, averaged."""
    group, size = state.thread.group, dist.get_world_size(state.thread.group)
    numel = tensor.numel()
    # 1. Plan.
    compress = (state.collective != "dense" and state.iter >= state.start_iter
                and numel >= max(state.min_compress_numel, 1))
    density = state.density_at(state.iter) if compress else 1.0
    k = k_for_density(density, numel) if compress else numel
    stats = state.bucket_stats[index] = BucketStats("sparse" if compress else "dense", numel, k,
                                                    selected=0 if compress else numel)
    agree_plan(tensor, group, state.agreed_plans.setdefault(index, Agreement()), sparse=compress, k=k,
               wire=wire_named(state.wire), what="sparse_grad_hook",
               volatile={"iter": state.iter, "bucket_index": index}, traffic=stats.traffic)
    if state.clip_norm is not None:
        _clip(tensor, state.clip_norm / math.sqrt(size))
    if not compress:
        if state.momentum and is_finite(tensor):  # an inf must not poison the velocity
            _momentum_increment(state, tensor, index, layout, parameters, [1.0] * len(layout or [None]),
                                sent_whole=True)
        if state.error_feedback and state.residual_store.holds_any(index, layout):
            _flush_into(state, tensor, index, layout)
        return _dense_allreduce(tensor, group, size, stats)
    _use_density(state, density)
    if state.collective == "hierarchical":
        return _reduce_hierarchical(state, tensor, index, layout, k, stats)

    # 2.-4. Select, exchange, apply: the reduction.
    start = perf_counter()
    residual = state.residual_store.residual(index, tensor, layout) if state.error_feedback else None
    # max |grad| of each parameter: one pass that tells both whether acc = grad + residual can be non-finite and
    # which parameters this rank did not use.
    maxima = _parameter_maxima(tensor, layout).tolist()
    velocity = None
    if state.momentum and all(math.isfinite(m) for m in maxima):  # tensor becomes the increment of v
        velocity = _momentum_increment(state, tensor, index, layout, parameters, maxima, sent_whole=False)
        unused = [m == 0 for m in maxima]
        maxima = [0.0 if zero else m for zero, m in zip(unused, _parameter_maxima(tensor, layout).tolist())]
    finite = _accumulationis_finite(state, tensor, residual, maxima, index)
    collective = state.collective_now

    def select() -> SparseMessage:
        begin = perf_counter()
        msg = _select(state, tensor, residual, maxima, layout, index, k)
        stats.select_seconds = perf_counter() - begin
        return msg

    outcome = reduce(tensor, residual, select, collective, group, k=k, wire=wire_named(state.wire),
                     backend=state.compressor_now.backend.for_device(tensor.device), finite=finite,
                     traffic=stats.traffic,
                     state=state.oktopk_states.setdefault(index, collective.new_state()) if collective.stateful
                     else None)
    stats.selected = outcome.msg.count
    stats.exchange_seconds = perf_counter() - start - stats.select_seconds  # exchanging and applying

    # 5. Every rank goes dense if any rank's sum was not finite.
    if outcome.nonfinite:
        stats.path, stats.k, stats.selected = "nonfinite", numel, numel
        if finite and residual is not None:  # its whole sum is in tensor: nothing stays behind
            del state.residuals[index]
            state.residual_bounds.pop(index, None)
            _record_taken(state, index, None, residual)
        return _dense_allreduce(tensor, group, size, stats)
    if residual is not None:
        _record_taken(state, index, *outcome.taken())
    if velocity is not None and state.iter >= state.masking_start_iter:
        # momentum factor masking: the velocity is cleared where a slot was applied
        sent = torch.arange(k, device=tensor.device) < outcome.msg.count
        applied = outcome.applied
        velocity.index_fill_(0, outcome.msg.indices[sent if applied is None else sent & applied].long(), 0)
    done = future_on(tensor.device)
    done.set_result(tensor)
    return done


def _select(state: SparseGradState, tensor: torch.Tensor, residual: Optional[torch.Tensor], maxima: list[float],
            layout: Layout, index: int, k: int) -> SparseMessage:
    step = _draw_step(state, index)
    if state.per_tensor and layout is not None and len(layout) > 1:
        msg, bound = _select_per_tensor(state.compressor_now, tensor, residual, maxima, layout, k, step)
    else:
        held = _hold_unused(residual, maxima, layout) if residual is not None else []
        msg = state.compressor_now.compress(tensor, residual, step=step)
        for part, saved in held:  # compressed as zeros: nothing of them was taken
            part.copy_(saved)
        bound = msg.stats[ops.STAT_MAX_ABS] if msg.stats is not None and not held else None
    if residual is not None and bound is not None:
        state.residual_bounds[index] = (residual, bound)
    else:
        state.residual_bounds.pop(index, None)
    return msg


def _use_density(state: SparseGradState, density: float) -> None:
    if state.compressor_now.density != density:
        state.compressor_now = make_compressor(state.compressor, density, **state.compressor_kwargs)
        state.collective_now = _collective(state)


def _collective(state: SparseGradState) -> Collective:
    """The flat collective of the state (between nodes, with the hierarchical one), on the compressor's backend."""
    name = state.inner_collective if state.collective == "hierarchical" else state.collective
    return collective_named("gtopk" if name == "dense" else name, state.compressor_now.backend)


def _draw_step(state: SparseGradState, index: int) -> int:
    """The step that seeds randomk's draw for this bucket and iteration."""
    return state.random_seed + state.iter * _STEPS_PER_ITER + index


def _reduce_hierarchical(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout, k: int,
                         stats: BucketStats) -> torch.futures.Future:
    """Steps 2-4 of :func:`sparse_grad_hook` with ``collective="hierarchical"``: the collective selects, from this
    rank's shard of its node's sum, and raises the non-finite flag inside its payloads."""
    group, size = state.thread.group, dist.get_world_size(state.thread.group)
    start = perf_counter()
    residual = state.residual_store.residual(index, tensor, layout) if state.error_feedback else None
    maxima = _parameter_maxima(tensor, layout).tolist()
    held = _hold_unused(residual, maxima, layout) if residual is not None else []
    collective = state.collective_now
    inner_state = state.oktopk_states.setdefault(index, collective.new_state()) if collective.stateful else None
    rounding = Rounding()
    result = hierarchical_allreduce(tensor, residual, state.compressor_now, k, state.local_size, group,
                                    inner=state.inner_collective, inner_state=inner_state,
                                    step=_draw_step(state, index), traffic=stats.traffic,
                                    nonfinite_flag=FLAG_NONFINITE, wire=state.wire, rounding=rounding)
    for part, saved in held:  # kept out of this step: its parameter was unused here
        part.add_(saved)
    stats.selected, stats.exchange_seconds = result.msg.count, perf_counter() - start
    if result.average is None:  # a flag: every rank goes dense, nothing was changed
        stats.path, stats.k, stats.selected = "nonfinite", tensor.numel(), tensor.numel()
        if residual is not None and _accumulationis_finite(state, tensor, residual, maxima, index):
            _flush_into(state, tensor, index, layout)
        return _dense_allreduce(tensor, group, size, stats)
    tensor.copy_(result.average)
    if residual is not None:
        error_indices, errors = rounding.pairs(residual.dtype, residual.device)
        _record_taken(state, index, torch.cat([result.msg.indices, error_indices]),
                      torch.cat([result.msg.values * result.applied, -errors]))
    done = future_on(tensor.device)
    done.set_result(tensor)
    return done


def _select_per_tensor(compressor: Compressor, tensor: torch.Tensor, residual: Optional[torch.Tensor],
                       maxima: list[float], layout: Layout, k: int, step: int
                       ) -> tuple[SparseMessage, Optional[torch.Tensor]]:
    """Each parameter compressed with its share of k; a parameter unused here (an all-zero gradient) sends
    nothing and keeps its residual. Used slots first, in ascending index order, then the padding. Returns the
    message and a bound on the residual's max |value| (None when a part has none)."""
    numels = [n for _, n in layout]
    grads = tensor.split(numels)
    residuals = residual.split(numels) if residual is not None else [None] * len(numels)
    values, indices, used, bounds, offset = [], [], [], [], 0
    for grad, part_residual, share, largest, numel in zip(grads, residuals, tensor_shares(k, numels), maxima,
                                                          numels):
        if share and largest != 0:
            part = compressor.compress(grad, part_residual, step=step, k=share)
            values.append(part.values)
            indices.append(part.indices + offset)
            used.append(torch.arange(share, device=tensor.device) < part.count)
            bounds.append(part.stats[ops.STAT_MAX_ABS] if part.stats is not None else None)
        elif share:
            values.append(torch.zeros(share, dtype=tensor.dtype, device=tensor.device))
            indices.append(torch.zeros(share, dtype=torch.int32, device=tensor.device))
            used.append(torch.zeros(share, dtype=torch.bool, device=tensor.device))
            bounds.append(None)
        elif part_residual is not None:  # no slot this step: the gradient waits in the residual
            part_residual.add_(grad)
            bounds.append(None)
        offset += numel
    used = torch.cat(used)
    order = torch.argsort((~used).to(torch.int32), stable=True)
    in_use = used[order]
    msg = SparseMessage(torch.cat(values)[order], torch.where(in_use, torch.cat(indices)[order], 0),
                        in_use.sum(dtype=torch.int32).reshape(1), tensor.numel())
    bound = None if any(b is None for b in bounds) else torch.stack(bounds).max()
    return msg, bound


def _record_taken(state: SparseGradState, index: int, indices: Optional[torch.Tensor], values: torch.Tensor) -> None:
    if state.scaler is not None:
        state.taken[index] = (indices, values)


def _dense_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     stats: BucketStats) -> torch.futures.Future:
    return DenseAllreduce().reduce_dense(tensor, group, size, stats.traffic,
                                         on_done=lambda seconds: setattr(stats, "exchange_seconds", seconds))


def _reduce_in_parts(state: SparseGradState, buffer: torch.Tensor, layout: Layout,
                     parameters: list[torch.Tensor], parts: list[tuple[int, Layout]]) -> torch.futures.Future:
    """A bucket made of the checkpoint's buckets is reduced as those buckets, then put together again."""
    offsets, offset = {}, 0
    for ordinal, numel in layout:
        offsets[ordinal] = offset
        offset += numel
    by_ordinal = dict(zip((o for o, _ in layout), parameters))
    slices = [[slice(offsets[o], offsets[o] + n) for o, n in part_layout] for _, part_layout in parts]
    futures = [_reduce_part(state, torch.cat([buffer[s] for s in part_slices]), index, part_layout,
                            [by_ordinal[o] for o, _ in part_layout])
               for (index, part_layout), part_slices in zip(parts, slices)]

    result = future_on(buffer.device)

    def scatter_back(_):
        try:
            for future, part_slices in zip(futures, slices):
                reduced, offset = future.value(), 0
                for s in part_slices:
                    width = s.stop - s.start
                    buffer[s] = reduced[offset:offset + width]
                    offset += width
        except BaseException as error:  # noqa: BLE001 - a part's failure is the bucket's
            fail(result, error)
        else:
            complete(result, buffer)

    # collect_all's future holds futures, not tensors: the buffer is handed on through a future on its device.
    torch.futures.collect_all(futures).add_done_callback(scatter_back)
    return result


def _chain(reduced: torch.futures.Future, result: torch.futures.Future, value: torch.Tensor,
           thread: Worker) -> None:
    """Complete ``result`` with ``value`` when ``reduced`` completes; a failure (of a dense allreduce) goes
    through ``thread``, which prefers the cause another rank published."""

    def forward(future):
        try:
            future.wait()
        except BaseException as error:  # noqa: BLE001 - handed to DDP and to the other ranks
            thread.fail(error)
            fail(result, thread.failure)
        else:
            complete(result, value)

    reduced.add_done_callback(forward)


def _clip(tensor: torch.Tensor, max_norm: float) -> None:
    """Scale ``tensor`` so that its L2 norm is at most ``max_norm`` (on the device: no host sync)."""
    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
    tensor.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(tensor.dtype))


def exponential_warmup(final_density: float, warmup_iters: int, start_density: float = 0.25, stages: int = 4,
                       start_iter: int = 0) -> list[tuple[int, float]]:
    """DGC's exponential sparsity warm-up as a ``density_schedule``: the density falls geometrically from
    ``start_density`` to ``final_density`` in ``stages`` equal steps over the ``warmup_iters`` iterations from
    ``start_iter`` on (DGC: 0.25, 0.0625, 0.0156, 0.004, 0.001 over four epochs; geometric: 0.25, 0.0629, 0.0158,
    0.0040, 0.001). No warm-up (``warmup_iters=0`` or a start at or below the final density): the final density."""
    check_density(final_density, "final_density")
    check_density(start_density, "start_density")
    for name, value, least in (("warmup_iters", warmup_iters, 0), ("stages", stages, 1), ("start_iter", start_iter, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if warmup_iters == 0 or start_density <= final_density:
        return [(0, final_density)]
    ratio = final_density / start_density
    return [(start_iter + round(j * warmup_iters / stages), start_density * ratio ** (j / stages))
            for j in range(stages + 1)]


def _momentum_increment(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout,
                        parameters: Optional[list[torch.Tensor]], maxima: list[float], *,
                        sent_whole: bool) -> torch.Tensor:
    """Momentum correction: ``tensor`` (the gradient) becomes what enters the residual v this step: u after
    ``u = momentum * u + g + weight_decay * w`` (Nesterov: ``g + weight_decay * w + momentum * u``). A parameter
    whose gradient is all zero here (``maxima`` 0: unused by this rank) keeps its velocity and adds nothing, as
    if the step had not happened for it. Returns the bucket's velocity.

    With a loss scaler, ``velocities_before`` gets what the velocity goes back to if the scaler skips the step.
    ``sent_whole`` (a dense path): the increment is sent, not kept, so the skipped step drops it and the velocity
    goes back to before its update. On the sparse path the increment stays in v (nothing lost), so the velocity
    keeps its update and loses only the step's masking: going back to before the update would count
    momentum * u twice.
    """
    if state.weight_decay:
        if parameters is None:
            raise ValueError("weight_decay needs the bucket's parameters (a DDP model, or reduce(parameters=...))")
        for part, p in zip(tensor.split([n for _, n in layout]), parameters):
            part.add_(p.detach().reshape(-1), alpha=state.weight_decay)
    velocity = state.velocity_store.residual(index, tensor, layout)
    if state.scaler is not None and sent_whole:
        state.velocities_before[index] = velocity.clone()
    held = _hold_unused(velocity, maxima, layout, zero=False)
    velocity.mul_(state.momentum).add_(tensor)
    if state.nesterov:
        tensor.add_(velocity, alpha=state.momentum)
    else:
        tensor.copy_(velocity)
    for part, saved in held:
        part.copy_(saved)
    if state.scaler is not None and not sent_whole:
        state.velocities_before[index] = velocity.clone()
    for part, largest in zip(tensor.split([n for _, n in layout]) if layout else [tensor], maxima):
        if largest == 0:
            part.zero_()
    return velocity


# ----- what a step may not apply: non-finite sums, unused parameters, steps the loss scaler skips -----


def _accumulationis_finite(state: SparseGradState, tensor: torch.Tensor, residual: Optional[torch.Tensor],
                            maxima: list[float], index: int) -> bool:
    """Whether acc = grad + residual is finite; a full check only when the bounds allow an overflow."""
    if not all(math.isfinite(m) for m in maxima):
        return False
    if residual is None:
        return True
    residual_with_bound, bound = state.residual_bounds.get(index, (None, None))
    if residual_with_bound is residual and max(maxima) + float(bound) < torch.finfo(tensor.dtype).max:
        return True
    return is_finite(tensor + residual)


def _hold_unused(residual: torch.Tensor, maxima: list[float], layout: Layout,
                 zero: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Save (and ``zero``, for the selection) the part of each parameter whose gradient is all zero (unused by
    this rank); returns (part, saved copy) pairs to restore afterwards."""
    if layout is None:
        return []
    held, offset = [], 0
    for (_, numel), largest in zip(layout, maxima):
        if largest == 0 and numel:
            part = residual[offset:offset + numel]
            held.append((part, part.clone()))
            if zero:
                part.zero_()
        offset += numel
    return held


def _flush_into(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout) -> None:
    """A dense bucket sends the residual it still has (parts left by an earlier layout) with its gradient."""
    residual = state.residual_store.residual(index, tensor, layout)
    tensor.add_(residual)
    del state.residuals[index]
    _record_taken(state, index, None, residual)


def _start_iteration(state: SparseGradState) -> None:
    """With a scaler: put back what a skipped step took, and bring the residuals to this step's scale."""
    state.iteration_open = True
    if state.scaler is None:
        return
    scale = float(state.scaler.get_scale()) if state.scaler.is_enabled() else 1.0
    if scale < state.residual_scale:  # the scaler backed off: it skipped the previous step
        for index, (indices, values) in state.taken.items():
            residual = state.residuals.get(index)
            if indices is None:
                state.residuals[index] = values if residual is None else residual.add_(values)
            else:
                put_back(residual, indices, values, state.compressor_now.backend.for_device(residual.device))
        for index, velocity in state.velocities_before.items():
            state.velocity_store.residuals[index] = velocity
    state.taken, state.velocities_before = {}, {}
    if scale != state.residual_scale:
        factor = scale / state.residual_scale
        for residual in [*state.residual_store.all_tensors(), *state.velocity_store.all_tensors()]:
            residual.mul_(factor)
        state.residual_bounds = {}
        state.residual_scale = scale


def _end_iteration(state: SparseGradState) -> None:
    state.iteration_open = False
    state.iter += 1
    if state.stats_logging_frequency and state.iter % state.stats_logging_frequency == 0:
        total = state._stats_now()["total"]
        logger.info("sparse_grad_hook iter %d: selected %d for k %d of %d elements; sent %d B, received %d B; "
                    "selecting %.3f ms, exchanging %.3f ms, applying %.3f ms", state.iter, total["selected"],
                    total["k"], total["numel"], total["bytes_sent"], total["bytes_received"],
                    1e3 * total["select_seconds"], 1e3 * total["exchange_seconds"], 1e3 * total["apply_seconds"])


def _parameter_maxima(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """max |tensor| over each parameter's slice (the whole tensor without a layout); NaN where one is NaN.
    (aminmax: one vectorised pass, 16x faster on the CPU than an inf-norm, which takes an absolute value first.)"""
    slices = tensor.split([numel for _, numel in layout]) if layout is not None else [tensor]
    extremes = [torch.stack(torch.aminmax(s)) if s.numel() else tensor.new_zeros(2) for s in slices]
    return torch.stack(extremes).abs().amax(dim=1)


def _checked_schedule(schedule: DensitySchedule) -> DensitySchedule:
    if schedule is None or callable(schedule):
        return schedule
    try:
        entries = [(start, density) for start, density in schedule]
    except (TypeError, ValueError):
        raise ValueError(f"density_schedule must be None, a callable iter -> density or a list of "
                         f"(start_iter, density) pairs, got {schedule!r}") from None
    for start, density in entries:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"density_schedule: start_iter must be an int >= 0, got {start!r}")
        check_density(density, f"density_schedule density for iteration {start}")
    return sorted(entries)
