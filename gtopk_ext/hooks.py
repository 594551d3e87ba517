"""The DDP communication hook: sparsified gradients with error feedback, in the style of PyTorch's PowerSGD hook.

    state = gx.SparseGradState(process_group=None, density=0.01)   # gtopk collective, Gaussian-k compressor
    ddp_model.register_comm_hook(state, gx.sparse_grad_hook)

Each bucket of each rank is compressed to k = ceil(density * numel) (index, value) pairs after adding the
bucket's residual (what earlier steps did not apply), the pairs are reduced with the chosen collective, and
the bucket becomes the average over ranks. Whatever was not applied stays in the residual: no gradient is lost.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import logging
import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from gtopk_ext import ops
from gtopk_ext.collectives import (DTYPE_CODES, Traffic, gather_headers, group_rank_and_size, gtopk_allreduce,
                                   require_same, ring_allreduce_bytes, sparse_allgather)
from gtopk_ext.compressors import COMPRESSOR_KINDS, Compressor, check_density, k_for_density, make_compressor

logger = logging.getLogger(__name__)

COLLECTIVES = ("gtopk", "allgather", "dense")
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
    selected: int | torch.Tensor = 0  # elements the compressor selected before truncation to k
    select_seconds: float = 0.0
    comm_seconds: float = 0.0
    traffic: Traffic = field(default_factory=Traffic, repr=False)


class SparseGradState:
    r"""State of :func:`sparse_grad_hook`, one per DDP model (and per rank).

    Args:
        process_group: the group to reduce over (``None``: the default group). Dropped when pickled.
        density: fraction of each bucket sent, in (0, 1].
        compressor: ``"gaussiank"`` (default), ``"topk"`` or ``"randomk"`` (see :func:`make_compressor`).
        collective: ``"gtopk"`` (default, O(k log P)), ``"allgather"`` (O(kP)) or ``"dense"`` (plain allreduce).
        start_iter: iterations of dense allreduce before compressing. With error feedback it must be >= 2:
            DDP rebuilds its buckets after the first iteration.
        min_compress_numel: buckets with fewer elements go dense.
        density_schedule: the density per iteration: a list of ``(start_iter, density)`` (each applies from its
            iteration on; ``density`` before the first), e.g. the gTop-k paper's warm-up
            ``[(0, 0.016), (1000, 0.004), (2000, 0.001)]``, or a callable ``iter -> density``.
        random_seed: seeds the randomk draws (identical on every rank).
        stats_logging_frequency: log :meth:`stats` through ``logging`` (logger ``gtopk_ext.hooks``, INFO) every
            this many iterations; 0 never.
        error_feedback: keep what is not applied in a per-bucket residual (default); False drops it.
        compressor_kwargs: extra arguments of the compressor (``mode="paper"``, ``backend="triton"``, ...). The
            compressor's backend (resolved once per device) runs every op of the hook: selection, merges, scatters.

    Fields besides the arguments: ``iter`` (iterations done; advanced on ``bucket.is_last()``),
    ``residuals`` (per ``bucket.index()``, the flat residual in that bucket's layout) and ``residual_scale``
    (the residuals hold the gradient times this factor: the loss scale, see :meth:`attach_scaler`; 1.0 without).

    What is guaranteed, with error feedback on: every element of ``grad + residual`` on every rank is either in
    the average this step returns or in the new residual (nothing is lost), in float32, bfloat16 and float16
    (gTop-k carries float16 sums in float32, the average is divided in float32).

    - A bucket whose ``grad + residual`` is not finite on some rank goes dense on every rank (the decision is
      shared before anything is sent), with every residual untouched, so a ``GradScaler`` sees the inf.
    - A parameter whose gradient in a bucket is exactly zero on this rank keeps its residual out of that step's
      selection. With ``find_unused_parameters=True`` DDP zeros an unused parameter's gradient and, when no rank
      used it, never copies the reduced values into ``.grad``: what the hook sent for it would be lost. So a
      parameter that a rank did not use this step gets none of that rank's residual applied, as DDP applies no
      gradient to it, and its residual waits for a step in which the rank uses it.
    - Loss scaling: see :meth:`attach_scaler`.
    - Buckets that go dense (small, warm-up) after a change of layout (a resume with other bucket sizes) add
      the residual parts of their parameters to the gradient they send: they are applied, not left behind.
    """

    __slots__ = ["process_group", "density", "compressor", "collective", "start_iter", "min_compress_numel",
                 "density_schedule", "random_seed", "stats_logging_frequency", "error_feedback",
                 "compressor_kwargs", "iter", "residuals", "residual_scale", "_layouts", "_unclaimed", "_ordinals",
                 "_next_ordinal", "_compressor", "_bucket_stats", "_residual_bounds", "_scaler", "_taken",
                 "_iteration_open"]

    def __init__(self, process_group: dist.ProcessGroup | None = None, density: float = 0.01,
                 compressor: str = "gaussiank", collective: str = "gtopk", start_iter: int = 2,
                 min_compress_numel: int = 1024, density_schedule: DensitySchedule = None, random_seed: int = 0,
                 stats_logging_frequency: int = 1000, error_feedback: bool = True,
                 compressor_kwargs: dict | None = None):
        check_density(density)
        if compressor not in COMPRESSOR_KINDS:
            raise ValueError(f"compressor must be one of {COMPRESSOR_KINDS}, got {compressor!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        for name, value in (("start_iter", start_iter), ("min_compress_numel", min_compress_numel),
                            ("random_seed", random_seed), ("stats_logging_frequency", stats_logging_frequency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if error_feedback and collective != "dense" and start_iter < 2:
            raise ValueError(f"start_iter must be >= 2 with error feedback (DDP rebuilds its buckets after the first "
                             f"iteration, which would misplace the residuals), got {start_iter}")
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
        self._compressor: Compressor = make_compressor(compressor, self.density, **self.compressor_kwargs)
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, Layout] = {}  # the latest layout of every bucket seen
        self._unclaimed: dict[int, torch.Tensor] = {}  # residual parts per parameter ordinal, between layouts
        self._ordinals = WeakIdKeyDictionary()  # parameter -> ordinal, in the order this process first saw them
        self._next_ordinal = 0
        self._bucket_stats: dict[int, BucketStats] = {}
        # Per bucket, (residual, a bound on its max |value| as a device scalar), set by the compressed step that
        # left that residual: grad + residual cannot overflow while max |grad| + bound stays below the dtype's
        # largest value, so it need not be checked.
        self._residual_bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.residual_scale = 1.0
        self._scaler = None
        # With a scaler: per bucket, what this iteration took out of the residual and applied (indices or None
        # for the whole bucket, values), to be put back if the scaler skips the step.
        self._taken: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._iteration_open = False

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
        """
        if not callable(getattr(scaler, "get_scale", None)) or not callable(getattr(scaler, "is_enabled", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self._scaler = scaler

    # ----- pickling, checkpoints, statistics -----

    def __getstate__(self):
        """Everything but the process group (not picklable) and the parameter identities of this process."""
        if self.process_group is not None:
            logger.warning("SparseGradState: the process group is not pickled; the unpickled state uses the default "
                           "group unless its process_group is set again")
        state = {slot: getattr(self, slot) for slot in self.__slots__
                 if slot not in ("process_group", "_ordinals", "_next_ordinal", "_scaler")}
        return state

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.process_group = None
        self._scaler = None
        self._ordinals = WeakIdKeyDictionary()
        self._next_ordinal = 0

    def state_dict(self) -> dict:
        """This rank's resumable state: ``{"iter", "residuals": {bucket_index: Tensor}, "residual_scale",
        "layouts", "unclaimed", "taken"}`` (copies; "taken": what the latest step applied, in case the scaler
        skipped it). Save one per rank, next to the model's and the optimizer's (and the
        scaler's)."""
        return {
            "iter": self.iter,
            "residual_scale": self.residual_scale,
            "residuals": {index: r.detach().clone() for index, r in self.residuals.items()},
            "layouts": {index: None if layout is None else [list(p) for p in layout]
                        for index, layout in self._layouts.items()},
            "unclaimed": {ordinal: r.detach().clone() for ordinal, r in self._unclaimed.items()},
            "taken": {index: (None if indices is None else indices.clone(), values.detach().clone())
                      for index, (indices, values) in self._taken.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output. Load it before the DDP model's first backward of this process:
        parameters are recognised by the order in which DDP's first buckets list them."""
        missing = {"iter", "residuals"} - set(state_dict)
        if missing:
            raise KeyError(f"state_dict is missing {sorted(missing)} (expected SparseGradState.state_dict()'s keys)")
        iteration = state_dict["iter"]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"state_dict['iter'] must be an int >= 0, got {iteration!r}")
        self.iter = iteration
        self.residuals = {int(i): r.detach().clone() for i, r in state_dict["residuals"].items()}
        self._layouts = {int(i): None if layout is None else tuple((int(o), int(n)) for o, n in layout)
                         for i, layout in state_dict.get("layouts", {}).items()}
        self._unclaimed = {int(o): r.detach().clone() for o, r in state_dict.get("unclaimed", {}).items()}
        self.residual_scale = float(state_dict.get("residual_scale", 1.0))
        self._taken = {int(i): (indices, values.detach().clone())
                       for i, (indices, values) in state_dict.get("taken", {}).items()}
        self._bucket_stats, self._residual_bounds = {}, {}

    def stats(self) -> dict:
        """The latest step's statistics: ``{"iter", "buckets": {index: {...}}, "total": {...}}``, each with
        ``k`` and ``selected`` (elements, summed over buckets), ``bytes_sent`` and ``bytes_received`` (this
        rank), ``select_seconds`` and ``comm_seconds`` (host wall-clock)."""
        buckets = {}
        for index, s in sorted(self._bucket_stats.items()):
            selected = int(s.selected) if isinstance(s.selected, torch.Tensor) else s.selected
            buckets[index] = {"path": s.path, "numel": s.numel, "k": s.k, "selected": selected,
                              "bytes_sent": s.traffic.sent, "bytes_received": s.traffic.received,
                              "select_seconds": s.select_seconds, "comm_seconds": s.comm_seconds}
        summed = ("numel", "k", "selected", "bytes_sent", "bytes_received", "select_seconds", "comm_seconds")
        total = {key: sum(b[key] for b in buckets.values()) for key in summed}
        return {"iter": self.iter, "buckets": buckets, "total": total}

    # ----- one bucket -----

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

    def reduce(self, buffer: torch.Tensor, bucket_index: int, *, is_last: bool = True,
               parameters: Sequence[torch.Tensor] | None = None) -> torch.futures.Future:
        """Average ``buffer`` (a flat bucket) over the group as :func:`sparse_grad_hook` does; the future's value is
        ``buffer``, overwritten. ``parameters``: the bucket's parameters in order (lets residuals follow them when
        DDP changes its buckets); ``is_last`` ends the iteration. Every rank must make the same calls."""
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype not in DTYPE_CODES:
            raise ValueError(f"buffer must be a flat float32, float16 or bfloat16 tensor, got "
                             f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                             f"{tuple(getattr(buffer, 'shape', ()))}")
        if not self._iteration_open:
            self._start_iteration()
        layout = self._layout_of(parameters, buffer.numel())
        parts = self._checkpoint_parts(bucket_index, layout)
        if parts is None:
            self._record_layout(bucket_index, layout)
            future = self._reduce(buffer, bucket_index, layout)
        else:
            future = self._reduce_in_parts(buffer, layout, parts)
        if is_last:
            self._end_iteration()
        return future

    def _reduce(self, tensor: torch.Tensor, index: int, layout: Layout) -> torch.futures.Future:
        group, _, size = group_rank_and_size(self.process_group)
        numel = tensor.numel()
        compress = (self.collective != "dense" and self.iter >= self.start_iter
                    and numel >= max(self.min_compress_numel, 1))
        density = self.density_at(self.iter) if compress else 1.0
        k = k_for_density(density, numel) if compress else numel
        residual = self._residual(index, tensor, layout) if compress and self.error_feedback else None
        # max |grad| of each parameter: one pass that tells both whether acc = grad + residual can be non-finite
        # and which parameters this rank did not use.
        maxima = _parameter_maxima(tensor, layout).tolist() if compress else []
        # Decided before the compressor touches the residual, and by all ranks alike: one rank's inf sends all dense.
        nonfinite = compress and not self._accumulation_is_finite(tensor, residual, maxima, index)
        stats = BucketStats("sparse" if compress else "dense", numel, k)
        self._bucket_stats[index] = stats
        start = perf_counter()
        headers = gather_headers({"valid": 1, "iter": self.iter, "bucket_index": index, "numel": numel,
                                  "dtype": DTYPE_CODES[tensor.dtype], "k": k, "nonfinite": int(nonfinite)},
                                 group, tensor.device, stats.traffic)
        require_same(headers, ("iter", "bucket_index", "numel", "dtype", "k"), "sparse_grad_hook")
        if compress and any(h["nonfinite"] for h in headers):
            stats.path, compress = "nonfinite", False
        if not compress:
            stats.selected = numel
            if stats.path == "dense":
                self._flush_into(tensor, index, layout)
            return self._dense_allreduce(tensor, group, size, stats, start)

        held = self._hold_unused(residual, maxima, layout) if residual is not None else []
        if self._compressor.density != density:
            self._compressor = make_compressor(self.compressor, density, **self.compressor_kwargs)
        selecting = perf_counter()
        msg = self._compressor.compress(tensor, residual,
                                        step=self.random_seed + self.iter * _STEPS_PER_ITER + index)
        stats.select_seconds = perf_counter() - selecting
        stats.selected = msg.count
        for part, saved in held:  # compressed as zeros: nothing of them was taken
            part.copy_(saved)
        if residual is not None and msg.stats is not None and not held:
            self._residual_bounds[index] = (residual, msg.stats[ops.STAT_MAX_ABS])
        else:
            self._residual_bounds.pop(index, None)
        if self.collective == "allgather":
            summed = sparse_allgather(msg, group, dtype=torch.float32, check=False, traffic=stats.traffic)
            taken = msg.values
        else:
            glob, applied = gtopk_allreduce(msg, group, check=False, traffic=stats.traffic)
            if residual is not None:  # contributions dropped by a merge go back: nothing is lost
                ops.scatter_add_(residual, msg.indices, msg.values * ~applied, backend=msg.backend)
            summed = glob.to_dense(torch.float32)
            taken = msg.values * applied
        if residual is not None and self._scaler is not None:
            self._taken[index] = (msg.indices, taken)
        tensor.copy_(summed.div_(size))
        stats.comm_seconds = perf_counter() - start - stats.select_seconds
        future = torch.futures.Future()
        future.set_result(tensor)
        return future

    @staticmethod
    def _dense_allreduce(tensor, group, size, stats, start) -> torch.futures.Future:
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size)
        stats.traffic.add(nbytes, nbytes)
        tensor.div_(size)

        def finished(future):
            stats.comm_seconds = perf_counter() - start
            return future.value()[0]

        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(finished)

    # ----- what a step may not apply: non-finite sums, unused parameters, steps the loss scaler skips -----

    def _accumulation_is_finite(self, tensor: torch.Tensor, residual: torch.Tensor | None, maxima: list[float],
                                index: int) -> bool:
        """Whether acc = grad + residual is finite; a full check only when the bounds allow an overflow."""
        if not all(math.isfinite(m) for m in maxima):
            return False
        if residual is None:
            return True
        residual_with_bound, bound = self._residual_bounds.get(index, (None, None))
        if residual_with_bound is residual and max(maxima) + float(bound) < torch.finfo(tensor.dtype).max:
            return True
        return bool(torch.isfinite(tensor + residual).all())

    @staticmethod
    def _hold_unused(residual: torch.Tensor, maxima: list[float], layout: Layout
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero the residual of each parameter whose gradient is all zero (unused by this rank) for the selection;
        returns (residual part, saved copy) pairs to restore after it."""
        if layout is None:
            return []
        held, offset = [], 0
        for (_, numel), largest in zip(layout, maxima):
            if largest == 0 and numel:
                part = residual[offset:offset + numel]
                held.append((part, part.clone()))
                part.zero_()
            offset += numel
        return held

    def _flush_into(self, tensor: torch.Tensor, index: int, layout: Layout) -> None:
        """A dense bucket sends the residual it still has (parts left by an earlier layout) with its gradient."""
        if index not in self.residuals and not any(o in self._unclaimed for o, _ in layout or ()):
            return
        residual = self._residual(index, tensor, layout)
        tensor.add_(residual)
        del self.residuals[index]
        if self._scaler is not None:
            self._taken[index] = (None, residual)

    def _start_iteration(self) -> None:
        """With a scaler: put back what a skipped step took, and bring the residuals to this step's scale."""
        self._iteration_open = True
        if self._scaler is None:
            return
        scale = float(self._scaler.get_scale()) if self._scaler.is_enabled() else 1.0
        if scale < self.residual_scale:  # the scaler backed off: it skipped the previous step
            for index, (indices, values) in self._taken.items():
                residual = self.residuals.get(index)
                if indices is None:
                    self.residuals[index] = values if residual is None else residual.add_(values)
                else:
                    ops.scatter_add_(residual, indices, values,
                                     backend=self._compressor.backend.for_device(residual.device))
        self._taken = {}
        if scale != self.residual_scale:
            factor = scale / self.residual_scale
            for residual in [*self.residuals.values(), *self._unclaimed.values()]:
                residual.mul_(factor)
            self._residual_bounds = {}
            self.residual_scale = scale

    def _end_iteration(self) -> None:
        self._iteration_open = False
        self.iter += 1
        if self.stats_logging_frequency and self.iter % self.stats_logging_frequency == 0:
            total = self.stats()["total"]
            logger.info("sparse_grad_hook iter %d: selected %d for k %d of %d elements; sent %d B, received %d B; "
                        "selecting %.3f ms, communicating %.3f ms", self.iter, total["selected"], total["k"],
                        total["numel"], total["bytes_sent"], total["bytes_received"],
                        1e3 * total["select_seconds"], 1e3 * total["comm_seconds"])

    # ----- residuals that follow the parameters when DDP's buckets change -----

    def _layout_of(self, parameters: Sequence[torch.Tensor] | None, numel: int) -> Layout:
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

    def _checkpoint_parts(self, index: int, layout: Layout) -> list[tuple[int, Layout]] | None:
        """The known buckets that this new bucket is exactly made of.

        A fresh DDP model reduces its first iteration in one bucket; after a resume, reducing it in the
        checkpoint's buckets instead keeps the run bitwise identical to one that never stopped (also when no
        residual exists yet: the selection per bucket differs from the selection over their union)."""
        if layout is None or self._layouts.get(index) == layout:
            return None
        numels = dict(layout)
        parts = [(i, known) for i, known in sorted(self._layouts.items())
                 if known and all(numels.get(o) == n for o, n in known)]
        covered = [o for _, known in parts for o, _ in known]
        if sorted(covered) != sorted(numels):
            return None
        return parts

    def _reduce_in_parts(self, buffer: torch.Tensor, layout: Layout,
                         parts: list[tuple[int, Layout]]) -> torch.futures.Future:
        offsets, offset = {}, 0
        for ordinal, numel in layout:
            offsets[ordinal] = offset
            offset += numel
        slices = [[slice(offsets[o], offsets[o] + n) for o, n in part_layout] for _, part_layout in parts]
        futures = [self._reduce(torch.cat([buffer[s] for s in part_slices]), index, part_layout)
                   for (index, part_layout), part_slices in zip(parts, slices)]

        def scatter_back(_):
            for future, part_slices in zip(futures, slices):
                reduced, offset = future.value(), 0
                for s in part_slices:
                    width = s.stop - s.start
                    buffer[s] = reduced[offset:offset + width]
                    offset += width
            return buffer

        return torch.futures.collect_all(futures).then(scatter_back)

    def _record_layout(self, index: int, layout: Layout) -> None:
        """A bucket changed: its residual and every one that shares a parameter with it go to per-parameter parts,
        from which each bucket assembles its residual again on its next compressed step."""
        if index in self._layouts and self._layouts[index] == layout:
            return
        previous = self._layouts.get(index)
        self._layouts[index] = layout
        if layout is None:
            return
        changed = {o for o, _ in layout}
        for i in list(self.residuals):
            old_layout = previous if i == index else self._layouts.get(i)
            if old_layout is not None and (i == index or changed & {o for o, _ in old_layout}):
                residual, offset = self.residuals.pop(i), 0
                for ordinal, numel in old_layout:
                    self._unclaimed[ordinal] = residual[offset:offset + numel]
                    offset += numel

    def _residual(self, index: int, tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
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
            part = self._unclaimed.pop(ordinal, None)
            if part is not None:
                residual[offset:offset + numel] = part.to(residual.device)
            offset += numel
        self.residuals[index] = residual
        return residual


def _parameter_maxima(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """max |tensor| over each parameter's slice (the whole tensor without a layout); NaN where one is NaN.
    (One pass, as fast as torch.isfinite; segment_reduce is several times slower on the CPU.)"""
    slices = tensor.split([numel for _, numel in layout]) if layout is not None else [tensor]
    return torch.stack(torch._foreach_norm(slices, float("inf")))


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


def sparse_grad_hook(state: SparseGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over ranks, sparsified (see :class:`SparseGradState`).

    Register with ``ddp_model.register_comm_hook(state, sparse_grad_hook)``; it returns a future of the bucket's
    buffer, holding the average of what every rank applied this step.
    """
    return state.reduce(bucket.buffer(), bucket.index(), is_last=bucket.is_last(), parameters=bucket.parameters())
