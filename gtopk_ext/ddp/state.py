"""The state of the DDP hook: plain data; the algorithm is :mod:`gtopk_ext.ddp.hook`."""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch.distributed as dist

from gtopk_ext._validate import check_int
from gtopk_ext._worker import Worker
from gtopk_ext.amp import LossScaling
from gtopk_ext.compressors import Compressor
from gtopk_ext.config import DensitySchedule, SparseConfig, recipe
from gtopk_ext.costs import SUMMARY_ROWS, format_bytes, latest_line, sent_and_received
from gtopk_ext.ddp.store import BucketStore
from gtopk_ext.hierarchical import Hierarchical
from gtopk_ext.momentum import AdamLink, DecoupledMomentum, MomentumCorrection, watch
from gtopk_ext.paths import PathPolicy
from gtopk_ext.reduction import Slot, StepStats
from gtopk_ext.resume import StateDicts, plan_resume, world_fields

logger = logging.getLogger("gtopk_ext.ddp")


class RunTotals:
    """This rank's counts over the run (saved): ``steps``, ``compressed_steps`` (a bucket sparse), ``bytes_sent``,
    ``bytes_received``, ``paths`` (bucket steps per path)."""

    FIELDS = ("steps", "compressed_steps", "bytes_sent", "bytes_received")

    def __init__(self, saved: dict | None = None):
        for name in self.FIELDS:
            setattr(self, name, int((saved or {}).get(name, 0)))
        self.paths: dict[str, int] = dict((saved or {}).get("paths", {}))
        # The step stats already counted: a bucket that a step did not reduce again (DDP rebuilt the buckets into
        # fewer) keeps its old one, which must not count twice. Holding them keeps their ids from being reused.
        self.counted: dict[int, StepStats] = {}

    def as_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in self.FIELDS}, "paths": dict(self.paths)}


class SparseGradState:
    r"""State of :func:`gtopk_ext.sparse_grad_hook`, one per DDP model and rank: plain data, as PyTorch's
    ``PowerSGDState`` is for its hook.

    Args:
        process_group: the group to reduce over (``None``: the default group). Dropped when pickled.
        density, compressor, collective, wire, path, momentum, hierarchical, error_feedback, optimizer_check: the
            configuration, each documented in :class:`gtopk_ext.SparseConfig` (``path``: default ``"auto"``, the
            cheapest path predicted from this group's measured steps; :class:`gtopk_ext.PathPolicy`).
        start_iter: iterations of dense allreduce before compressing (any: the residuals follow the parameters
            when DDP rebuilds its buckets after the first iteration).
        scaler: a ``torch.amp.GradScaler`` to follow (call ``scaler.update()`` once per step, without
            ``new_scale``): the residuals and velocities follow its loss scale, and a step it skips gives back
            what it took from them (its dense buckets are dropped, as in plain DDP).

    Fields: ``process_group``; ``config``; ``iter`` (iterations done); ``store`` (per bucket the residual,
    ``store.residuals``, and the velocity); ``buckets`` (per bucket index, its reduction ``Slot``); ``totals``;
    ``loss_scaling``; ``adam`` (with :class:`gtopk_ext.DecoupledMomentum`: the norms of the hook's latest outputs,
    for :class:`gtopk_ext.SparseAdamW`, :class:`AdamLink`);
    ``worker`` (the thread that reduces the buckets in DDP's order); ``stats_logging_frequency``
    (log :meth:`stats` at INFO every this many iterations; 0: never); ``synchronous`` (finish each bucket inside
    the hook call, for debugging).

    With error feedback on, every element of ``grad + residual`` on every rank is either in the average a step
    returns or in the new residual, in float32, bfloat16 and float16, also when a rank's sum is not finite, a
    parameter is unused on a rank or the buckets changed (docs/usage.md, "What the hook guarantees").
    """

    __slots__ = ("process_group", "config", "iter", "store", "buckets", "totals", "loss_scaling", "adam", "worker",
                 "stats_logging_frequency", "synchronous", "__weakref__")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, density: DensitySchedule = 0.01,
                 compressor: Union[str, Compressor] = "gaussiank", collective: str = "gtopk", start_iter: int = 2,
                 path: Union[str, PathPolicy] = "auto", wire: str = "plain",
                 momentum: Union[MomentumCorrection, float, None] = None, hierarchical: Optional[Hierarchical] = None,
                 error_feedback: bool = True, *, optimizer_check: str = "raise", scaler=None,
                 stats_logging_frequency: int = 1000):
        config = SparseConfig(density, compressor, collective, wire, start_iter, path, momentum, hierarchical,
                              error_feedback, optimizer_check)
        self.process_group = process_group
        self.config = config
        self.iter = 0
        self.store = BucketStore()
        self.buckets: dict[int, Slot] = {}
        self.totals = RunTotals()
        self.loss_scaling = LossScaling(scaler)
        if isinstance(config.momentum, DecoupledMomentum) and scaler is not None:
            raise ValueError("scaler: the AdamW recipe (momentum=DecoupledMomentum) does not follow a GradScaler yet; "
                             "train in bfloat16 autocast (no scaler), or use the SGD recipe")
        self.adam = AdamLink()
        self.worker: Optional[Worker] = None
        self.stats_logging_frequency = check_int("stats_logging_frequency", stats_logging_frequency)
        self.synchronous = False
        if config.momentum is not None:
            watch(self, _reduced_parameters)

    @classmethod
    def recipe(cls, density: float = 0.01, warmup_steps: Optional[int] = None,
               process_group: Optional[dist.ProcessGroup] = None, momentum: float = 0.9, *, optimizer: str = "sgd",
               clip_norm: Optional[float] = 1.0, **options) -> "SparseGradState":
        """The recommended settings for ``optimizer``; ``options``: the other arguments.

        ``"sgd"`` (docs/performance.md): two dense steps, then DGC's exponential warm-up of the density from 0.25 to
        ``density`` over ``warmup_steps`` (default 44) steps, and Nesterov momentum correction ``momentum``, masking
        from the warm-up's end. Train with an optimizer WITHOUT momentum or weight decay,
        ``torch.optim.SGD(model.parameters(), lr)``::

            state = gx.SparseGradState.recipe(density=0.01, warmup_steps=44)
            ddp_model.register_comm_hook(state, gx.sparse_grad_hook)

        ``"adamw"`` (docs/usage.md, "With AdamW"): from the first step, AdamW's momentum decoupled in the hook
        (:class:`gtopk_ext.DecoupledMomentum`: the top ``density`` of each 4,096 DCT coefficients of the momentum,
        allgather on the compact wire; no ``warmup_steps``), clipping at ``clip_norm`` in the hook. Train with
        :class:`gtopk_ext.SparseAdamW` (AdamW's arguments, plus the state), without ``clip_grad_norm_``::

            state = gx.SparseGradState.recipe(density=0.01, optimizer="adamw")
            ddp_model.register_comm_hook(state, gx.sparse_grad_hook)
            optimizer = gx.SparseAdamW(ddp_model.parameters(), lr=3e-4, weight_decay=0.1, state=state)
        """
        return cls(process_group, **{**recipe(density, warmup_steps, momentum, optimizer, clip_norm), **options})

    def __getstate__(self):
        if self.worker is not None:
            self.worker.drain()
        if self.process_group is not None:
            logger.warning("SparseGradState: the process group is not pickled; the unpickled state uses the default "
                           "group unless its process_group is set again")
        saved = {name: getattr(self, name) for name in self.__slots__ if name != "__weakref__"}
        scaling = LossScaling()
        scaling.scale, scaling.taken = self.loss_scaling.scale, self.loss_scaling.taken
        scaling.velocities_before = self.loss_scaling.velocities_before
        return {**saved, "process_group": None, "worker": None, "loss_scaling": scaling, "adam": AdamLink()}

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)
        if self.config.momentum is not None:
            watch(self, _reduced_parameters)

    def state_dict(self) -> dict:
        """This rank's resumable state (copies), to save per rank beside the model's and the optimizer's: the
        residuals (``"residuals"``, ``"unclaimed"``, ``"layouts"``), the velocities, the scaler's record, Ok-Topk's
        state, each bucket's path ``"plans"`` and ``"calibration"``, the costs each bucket's latest path was decided
        from (``gx.PathPolicy("auto", calibration=...)`` takes the same paths)."""
        if self.worker is not None:
            self.worker.drain()
        scaling = self.loss_scaling
        return {"iter": self.iter, **world_fields(self.process_group), "totals": self.totals.as_dict(),
                "residual_scale": scaling.scale, **self.store.state_dict(),
                "velocities_before": {index: v.clone() for index, v in scaling.velocities_before.items()},
                "taken": {index: (None if indices is None else indices.clone(), values.detach().clone())
                          for index, (indices, values) in scaling.taken.items()},
                "oktopk": {index: slot.oktopk.state_dict() for index, slot in self.buckets.items()
                           if slot.oktopk is not None},
                "plans": {index: slot.plan.state_dict() for index, slot in self.buckets.items()},
                "calibration": {index: dict(slot.plan.agreed) for index, slot in self.buckets.items()
                                if slot.plan.agreed is not None}}

    def load_state_dict(self, state_dict: StateDicts, on_world_size_change: str = "error") -> None:
        """Restore :meth:`state_dict`'s output, before the DDP model's first backward of this process (parameters
        are recognised by the order in which DDP's first buckets list them). At another world size,
        ``on_world_size_change`` says what becomes of the residuals (docs/usage.md, "Another world size"):
        ``"error"`` (default: a ValueError naming both sizes), ``"fold"`` (``state_dict``: every saved rank's, in
        rank order; this rank sends those of saved ranks ``q % world_size == rank`` whole in a first dense step) or
        ``"zero"``; the iteration and the run totals load, the rest starts afresh."""
        plan = plan_resume(state_dict, on_world_size_change, self.process_group, "SparseGradState.load_state_dict")
        saved = plan.replicated
        missing = {"iter", "residuals"} - set(saved)
        if missing:
            raise KeyError(f"state_dict is missing {sorted(missing)} (expected SparseGradState.state_dict()'s keys)")
        iteration = check_int("state_dict['iter']", saved["iter"])
        if self.worker is not None:
            self.worker.drain()
        self.iter, self.totals, self.buckets = iteration, RunTotals(saved.get("totals")), {}
        scaling = self.loss_scaling
        scaling.scale, scaling.taken, scaling.velocities_before = float(saved.get("residual_scale", 1.0)), {}, {}
        self.store = BucketStore()
        if plan.policy is not None:
            # The buckets' layouts are the same on every rank; each needs them to reduce its first iteration as the
            # others do (in the saved buckets), also a rank that takes no saved rank's residuals.
            self.store.add_residuals({"layouts": saved.get("layouts", {})})
            for own in plan.own:
                self.store.add_residuals(own)
            if plan.policy == "fold":
                self.config = self.config.replace(start_iter=max(self.config.start_iter, iteration + 1))
            return
        self.store.load_state_dict(saved)
        scaling.taken = {int(i): (indices, values.detach().clone())
                         for i, (indices, values) in saved.get("taken", {}).items()}
        scaling.velocities_before = {int(i): v.clone() for i, v in saved.get("velocities_before", {}).items()}
        plans, oktopk = saved.get("plans", {}), saved.get("oktopk", {})
        for index in {*plans, *oktopk}:
            slot = self.buckets[int(index)] = Slot(self.config.reducer)
            if index in plans:
                slot.plan.load_state_dict(plans[index])
            if slot.oktopk is not None and index in oktopk:
                slot.oktopk.load_state_dict(oktopk[index])

    def stats(self) -> dict:
        """``{"iter", "buckets": {index: {...}}, "total": {...}, "run": {...}}``: the latest step per bucket and
        summed (``path``, ``k``, ``selected``, this rank's ``bytes_sent`` and ``bytes_received``, host seconds
        ``select_seconds`` and ``exchange_seconds``), and the run's :class:`RunTotals` with ``measured_decisions``
        (the paths ``auto`` chose from this run's timings: a rerun may choose otherwise)."""
        if self.worker is not None:
            self.worker.drain()
        buckets = {index: slot.stats.as_dict() for index, slot in sorted(self.buckets.items())
                   if slot.stats is not None}
        total = {key: sum(b[key] for b in buckets.values()) for key in StepStats.SUMMED}
        measured = sum(slot.plan.measured for slot in self.buckets.values())
        return {"iter": self.iter, "buckets": buckets, "total": total,
                "run": {**self.totals.as_dict(), "measured_decisions": measured}}

    def summary(self) -> str:
        """:meth:`stats` as a few lines to print: the configuration, the run's totals beside DDP's, how the paths
        were chosen, the latest step."""
        stats = self.stats()
        run, total, config = stats["run"], stats["total"], self.config
        size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        dense = sum(2 * (size - 1) * s.stats.numel * 4 // size for s in self.buckets.values() if s.stats is not None)
        lines = [f"SparseGradState: {config.describe(self.iter)}",
                 f"run: {run['steps']} steps ({run['compressed_steps']} compressed); "
                 + sent_and_received(run["bytes_sent"], run["bytes_received"], run["steps"], "step"),
                 f"  (DDP's float32 allreduce of these buckets: {format_bytes(dense)} a step)",
                 _paths_line(config.path, run["paths"], run["measured_decisions"])]
        if not stats["buckets"]:
            return "\n".join(lines + ["latest step: none yet"])
        lines.append(latest_line("step", stats["iter"], total["bytes_sent"], total["k"], total["numel"],
                                 f"selecting {1e3 * total['select_seconds']:.2f} ms, exchanging "
                                 f"{1e3 * total['exchange_seconds']:.2f} ms"))
        lines.append(f"  {'bucket':>6} {'path':<9} {'elements':>11} {'k':>9} {'sent':>10} {'select ms':>9} "
                     f"{'exchange ms':>11}")
        rows = list(stats["buckets"].items())
        for index, b in rows[:SUMMARY_ROWS]:
            lines.append(f"  {index:>6} {b['path']:<9} {b['numel']:>11,} {b['k']:>9,} "
                         f"{format_bytes(b['bytes_sent']):>10} {1e3 * b['select_seconds']:>9.2f} "
                         f"{1e3 * b['exchange_seconds']:>11.2f}")
        if len(rows) > SUMMARY_ROWS:
            lines.append(f"  ... {len(rows) - SUMMARY_ROWS} more buckets (state.stats()['buckets'])")
        return "\n".join(lines)


def _reduced_parameters(state: SparseGradState) -> Optional[set[int]]:
    return state.store.parameter_ids()


def _paths_line(policy: PathPolicy, paths: dict[str, int], measured: int) -> str:
    taken = ", ".join(f"{path} {count}" for path, count in sorted(paths.items(), key=lambda item: -item[1]))
    line = f"paths taken (bucket steps): {taken or 'none yet'}; "
    if policy.mode != "auto":
        return line + f"forced {policy.mode!r} once a bucket may compress (repeatable)"
    if measured:
        return line + (f"'auto' chose {measured} time(s) from this run's measured\n  timings, so a rerun may take "
                       f"other paths; to repeat these choices, pass path=gx.PathPolicy('auto',\n  "
                       f"calibration=state.state_dict()['calibration'])")
    return line + "'auto' from the policy's calibration (repeatable)"
