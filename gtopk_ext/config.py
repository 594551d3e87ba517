"""The configuration that every front end shares (the DDP hook, the FSDP2 hook, SparseLocalSGD): what a step sends
and how it is reduced, checked once when it is made; and the density schedule, a density per iteration that is the
same on every rank."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, fields as dataclass_fields
from typing import Callable, Optional, Sequence, Union

from gtopk_ext._validate import check_int
from gtopk_ext.collectives import COLLECTIVES, SPARSE_COLLECTIVES, Collective, collective_named
from gtopk_ext.compressors import COMPRESSOR_KINDS, Compressor, check_density, make_compressor
from gtopk_ext.hierarchical import Hierarchical
from gtopk_ext.momentum import OPTIMIZER_CHECKS, DecoupledMomentum, MomentumCorrection
from gtopk_ext.paths import PathPolicy, path_policy
from gtopk_ext.wire import Wire, wire_named

# A density, a list of (start_iter, density) pairs (each from its iteration on), or a function iter -> density.
DensitySchedule = Union[float, Sequence[tuple[int, float]], Callable[[int], float]]
FLAT_COLLECTIVES = (*SPARSE_COLLECTIVES, "dense")


def exponential_warmup(final_density: float, warmup_iters: int, start_density: float = 0.25, stages: int = 4,
                       start_iter: int = 0) -> list[tuple[int, float]]:
    """DGC's exponential sparsity warm-up as a density schedule: from ``start_density`` to ``final_density`` in
    ``stages`` geometric steps over ``warmup_iters`` iterations from ``start_iter`` on (none: the final density)."""
    check_density(final_density, "final_density")
    check_density(start_density, "start_density")
    check_int("warmup_iters", warmup_iters)
    check_int("stages", stages, 1)
    check_int("start_iter", start_iter)
    if warmup_iters == 0 or start_density <= final_density:
        return [(0, final_density)]
    ratio = final_density / start_density
    return [(start_iter + round(j * warmup_iters / stages), start_density * ratio ** (j / stages))
            for j in range(stages + 1)]


OPTIMIZERS = ("sgd", "adamw")


def recipe(density: float, warmup_steps: Optional[int], momentum: float, optimizer: str = "sgd",
           clip_norm: Optional[float] = 1.0) -> dict:
    """The recipe's settings, for every front end. ``optimizer="sgd"``: DGC's exponential warm-up from 0.25 to
    ``density`` over ``warmup_steps`` (None: 44) steps and Nesterov momentum correction ``momentum``, its masking
    from the warm-up's end. ``"adamw"``: AdamW's momentum decoupled in the hook (:class:`DecoupledMomentum`,
    ``clip_norm``), sparse from the first step (no ``warmup_steps``): the top ``density`` of each 4,096
    DCT coefficients (``chunktopk``), exchanged by allgather on the compact wire (every rank's selection applied, as
    DeMo does); the optimizer is :class:`gtopk_ext.SparseAdamW`."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "adamw":
        if warmup_steps is not None:
            raise ValueError(f"warmup_steps: the AdamW recipe has no warm-up (its momentum is sent sparsely from the "
                             f"first step), got {warmup_steps!r}")
        return {"density": density, "compressor": "chunktopk", "collective": "allgather", "wire": "compact",
                "path": "sparse", "start_iter": 0, "momentum": DecoupledMomentum(clip_norm=clip_norm)}
    if warmup_steps is None:
        warmup_steps = 44
    check_density(density, "density")  # here: the warm-up's checks would name its own arguments
    check_int("warmup_steps", warmup_steps)
    return {"density": exponential_warmup(density, warmup_steps, start_density=max(density, 0.25)),
            "momentum": MomentumCorrection(momentum, nesterov=momentum > 0, masking_start_iter=warmup_steps)}


@dataclass(frozen=True)
class SparseConfig:
    """What a front end sends each step and how it is reduced, checked when made.

    Args:
        density: the fraction of each tensor sent, in (0, 1]; or a schedule: ``(start_iter, density)`` pairs (e.g.
            :func:`exponential_warmup`) or a pure callable ``iter -> density`` (the same on every rank).
        compressor: ``"gaussiank"`` (default), ``"topk"``, ``"randomk"``, or a :func:`gtopk_ext.make_compressor`
            (its backend runs every op of the reduction).
        collective: ``"gtopk"`` (default, O(k log P)), ``"allgather"`` (O(kP)), ``"oktopk"`` (O(k) for any P) or
            ``"dense"`` (a plain allreduce).
        wire: the sparse collectives' wire format (:mod:`gtopk_ext.wire`): ``"plain"``, ``"compact"``, ``"2bit"``
            or ``"4bit"``.
        start_iter: iterations reduced densely before compressing.
        path: each step's path once a tensor may compress (:class:`gtopk_ext.PathPolicy`): ``"auto"`` or a forced one.
        momentum: :class:`gtopk_ext.MomentumCorrection` (a number m is ``MomentumCorrection(m)``),
            :class:`gtopk_ext.DecoupledMomentum` (with :class:`gtopk_ext.SparseAdamW`), or None.
        hierarchical: :class:`gtopk_ext.Hierarchical` (dense inside a node, ``collective`` between nodes), or None.
        error_feedback: keep what is not applied in a residual (default); False drops it.
        optimizer_check: with momentum correction, what an optimizer with momentum or weight decay on the same
            parameters gets before its first step: ``"raise"`` (a ValueError), ``"warn"`` or ``"off"``.

    Once made, ``density`` is the first density, ``schedule`` the checked schedule (or None), ``compressor``,
    ``wire``, ``path`` and ``momentum`` objects (``momentum`` None when it does nothing), ``reducer`` the collective.
    """

    density: DensitySchedule = 0.01
    compressor: Union[str, Compressor] = "gaussiank"
    collective: str = "gtopk"
    wire: Union[str, Wire] = "plain"
    start_iter: int = 0
    path: Union[str, PathPolicy] = "auto"
    momentum: Union[MomentumCorrection, float, None] = None
    hierarchical: Optional[Hierarchical] = None
    error_feedback: bool = True
    optimizer_check: str = "raise"
    schedule: Union[None, Callable[[int], float], list[tuple[int, float]]] = field(init=False)
    reducer: Collective = field(init=False, repr=False, compare=False)
    _compressors: dict = field(init=False, repr=False, compare=False)  # by density: one object each
    _fields: dict = field(init=False, repr=False, compare=False)  # fields(), made once: every bucket's header has it

    def __post_init__(self):
        density, schedule = self.density, None
        if callable(density):
            density, schedule = 0.01, density
        elif not isinstance(density, (int, float)):
            try:
                schedule = [(start, scheduled) for start, scheduled in density]
            except (TypeError, ValueError):
                raise ValueError(f"density must be a number in (0, 1], a callable iter -> density or a list of "
                                 f"(start_iter, density) pairs, got {density!r}") from None
            if not schedule:
                raise ValueError("density: the schedule is empty")
            for start, scheduled in schedule:
                check_int("density schedule: start_iter", start)
                check_density(scheduled, f"density schedule: the density for iteration {start}")
            # Stable: of pairs with the same start_iter the last one given holds (a warm-up shorter than its stages).
            schedule.sort(key=lambda entry: entry[0])
            density = schedule[0][1]
        check_density(density)
        if self.collective not in FLAT_COLLECTIVES:
            raise ValueError(f"collective must be one of {FLAT_COLLECTIVES}, got {self.collective!r}")
        compressor = (self.compressor.with_density(float(density)) if isinstance(self.compressor, Compressor)
                      else make_compressor(self.compressor, float(density)))
        momentum = self.momentum
        if momentum is not None and not isinstance(momentum, (MomentumCorrection, DecoupledMomentum)):
            momentum = MomentumCorrection(momentum)
        if isinstance(momentum, DecoupledMomentum) and not self.error_feedback:
            raise ValueError(f"momentum={type(momentum).__name__} needs error_feedback=True: the residual holds "
                             f"Adam's momentum not yet sent")
        policy = path_policy(self.path)
        if isinstance(momentum, DecoupledMomentum) and policy.mode != "sparse":
            raise ValueError(f"path: DecoupledMomentum sends a top-k of the momentum every step, and a dense path "
                             f"would send all of it (another update, chosen by timing under 'auto'): use "
                             f"path='sparse', got {policy.mode!r}")
        if momentum is not None and not (momentum.momentum or momentum.weight_decay or momentum.clip_norm):
            momentum = None
        check_int("start_iter", self.start_iter)
        if self.hierarchical is not None:
            if not isinstance(self.hierarchical, Hierarchical):
                raise TypeError(f"hierarchical must be a gx.Hierarchical or None, got "
                                f"{type(self.hierarchical).__name__}")
            if self.collective not in SPARSE_COLLECTIVES:
                raise ValueError(f"hierarchical reduces with a sparse collective between nodes, one of "
                                 f"{SPARSE_COLLECTIVES}; got collective={self.collective!r}")
            if (momentum is not None and momentum.momentum) or compressor.per_tensor:
                raise ValueError("hierarchical selects from a node's sum: it supports neither momentum correction "
                                 "(momentum > 0) nor per-tensor selection")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        if self.optimizer_check not in OPTIMIZER_CHECKS:
            raise ValueError(f"optimizer_check must be one of {OPTIMIZER_CHECKS}, got {self.optimizer_check!r}")
        for name, value in (("density", float(density)), ("schedule", schedule), ("compressor", compressor),
                            ("wire", wire_named(self.wire)), ("path", policy),
                            ("momentum", momentum), ("_compressors", {float(density): compressor}),
                            ("reducer", collective_named(self.collective, compressor.backend))):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_fields", {
            "density_ppb": round(self.density * 1e9), "collective": list(COLLECTIVES).index(self.reducer.name),
            "wire": self.wire.code, "start_iter": self.start_iter, "path": self.path.code,
            "compressor": COMPRESSOR_KINDS.index(self.compressor.kind), "schedule": int(self.schedule is not None),
            "momentum": zlib.crc32(repr(self.momentum).encode())})

    def replace(self, **changes) -> "SparseConfig":
        """This configuration with ``changes`` (made and checked anew)."""
        kept = {f.name: getattr(self, f.name) for f in dataclass_fields(self) if f.init and f.name != "density"}
        return SparseConfig(**{"density": self.schedule or self.density, **kept, **changes})

    def density_at(self, iteration: int) -> float:
        """The density of ``iteration``: the schedule's, else ``density``."""
        schedule, density = self.schedule, self.density
        if callable(schedule):
            scheduled = schedule(iteration)
            check_density(scheduled, f"density({iteration})")
            return float(scheduled)
        for start, scheduled in schedule or ():
            if iteration >= start:
                density = scheduled
        return density

    def compressor_at(self, density: float) -> Compressor:
        """The compressor at ``density`` (one object per density, so each resolves its backend once)."""
        compressor = self._compressors.get(density)
        if compressor is None:
            compressor = self._compressors[density] = self.compressor.with_density(density)
        return compressor

    def describe(self, iteration: int) -> str:
        """The configuration in a line, for the summaries: compressor, collective, density at ``iteration``, wire,
        error feedback, momentum."""
        momentum, parts = self.momentum, []
        if isinstance(momentum, DecoupledMomentum):
            clipped = f", clip norm {momentum.clip_norm:g}" if momentum.clip_norm is not None else ""
            parts = [f"AdamW's momentum decoupled in the hook (beta {momentum.beta:g}, DCT chunks of "
                     f"{momentum.chunk}{clipped})"]
        elif momentum is not None:
            parts = [f"momentum correction {momentum.momentum:g}", "nesterov" if momentum.nesterov else "",
                     f"weight decay {momentum.weight_decay:g}" if momentum.weight_decay else "",
                     f"clip norm {momentum.clip_norm:g}" if momentum.clip_norm is not None else ""]
        return (f"{self.compressor.kind} + {self.collective}, density {self.density_at(iteration):g}, "
                f"{self.wire.name} wire, error feedback {'on' if self.error_feedback else 'off'}"
                + "".join(f", {part}" for part in parts if part))

    def fields(self) -> dict[str, int]:
        """The configuration as header fields, for the ranks to check they share it (not to be changed)."""
        return self._fields
