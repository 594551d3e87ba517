"""Typed wrappers over the gtopk_ext ops, one per op.

Every wrapper takes ``backend=None``: a name or a :class:`gtopk_ext.backends.Backend`; ``None`` reads
``$GTOPK_EXT_BACKEND`` (default ``"auto"``). Each op's schema and argument checks are in csrc/ops.cpp (bad
arguments raise RuntimeError, also under ``torch.compile``).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from types import SimpleNamespace

import torch

from gtopk_ext import backends
# gaussian_threshold's output layout, read through this module by its callers.
from gtopk_ext._contract import (NUM_STATS, STAT_GAUSSIAN_THRESHOLD, STAT_MAX_ABS, STAT_MEAN,  # noqa: F401
                                 STAT_STD, STAT_THRESHOLD)
from gtopk_ext.backends import Backend, BackendLike


def z_for_density(density: float) -> float:
    """The Gaussian quantile z with P(|X| >= z) = density for X ~ N(0, 1): the threshold is |mean| + z * std."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return NormalDist().inv_cdf(1.0 - density / 2.0) if density < 1.0 else 0.0


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (one host sync)."""
    if not tensor.numel():
        return True
    smallest, largest = torch.aminmax(tensor)
    return math.isfinite(smallest) and math.isfinite(largest)


def _kernels(tensor: torch.Tensor, backend: BackendLike, op: str) -> SimpleNamespace:
    """The kernels of ``backend`` for ``op`` on the tensor's device; a Backend already checked there is not
    checked again."""
    if not (isinstance(backend, Backend) and op in backend.ops and tensor.device in backend.ready):
        backend = backends.choose(tensor.device, backend, op=op)
    return backend.kernels


def _raise_on_invalid(invalid: torch.Tensor, op: str, numel: int) -> None:
    skipped = int(invalid.item())
    if skipped:
        raise ValueError(f"{op}: {skipped} indices outside [0, {numel}) were skipped (corrupted message?)")


def gaussian_threshold(grad: torch.Tensor, residual: torch.Tensor | None = None, *, z: float, k: int = 0,
                       backend: BackendLike = None) -> torch.Tensor:
    """One pass over ``acc = grad + residual`` (``residual`` becomes ``acc`` in place; ``None``: ``acc = grad``).

    Returns float32[NUM_STATS] on grad's device: mean, std, max |acc| (NaN ignored), the Gaussian threshold
    ``|mean| + z * std`` and, at ``STAT_THRESHOLD``, the threshold to select with: when ``k > 0`` the one that a
    histogram of |acc| says keeps about ``k`` elements, else the Gaussian one. No host sync.
    """
    return _kernels(grad, backend, "gaussian_threshold").gaussian_threshold(grad, residual, float(z), int(k))


def compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int, *,
            backend: BackendLike = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, count)``: the elements with ``|acc| >= threshold[0]`` in ascending index order.

    ``values`` (acc's dtype) and ``indices`` (int32) have ``capacity`` slots, padded with (0, 0); ``count``
    (int32[1]) is how many passed. When more than ``capacity`` pass, those above the threshold's histogram bin
    are kept first, then the others in index order, so no large element is dropped.
    """
    return _kernels(acc, backend, "compact").compact(acc, threshold, int(capacity))


def gaussian_select(grad: torch.Tensor, residual: torch.Tensor | None = None, *, z: float, k: int, capacity: int,
                    update_residual: bool = False, backend: BackendLike = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gaussian_threshold` with ``k >= 1``, its threshold refined inside its histogram bin, then
    :func:`compact` at it: ``(values, indices, count, stats)``, ``stats[STAT_THRESHOLD]`` the refined threshold.
    ``update_residual``: what was selected leaves the residual exactly as :func:`residual_update_` would make it.
    """
    return _kernels(grad, backend, "gaussian_select").gaussian_select(grad, residual, float(z), int(k), int(capacity),
                                                                     bool(update_residual))


def merge_topk(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor, values_b: torch.Tensor,
               k: int, *, backend: BackendLike = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gTop-k's merge: the union of two sparse sets, values of equal indices summed (float32, a's slots then
    b's), then the k largest |sums| (NaN first; ties to the lower index), by ascending index, padded with (0, 0).
    Returns ``(indices int32[k], values[k] in values_a's dtype, union_size int32[1])``, bitwise deterministic.
    """
    return _kernels(values_a, backend, "merge_topk").merge_topk(indices_a, values_a, indices_b, values_b, int(k))


def scatter_add_(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, backend: BackendLike = None,
                 check: bool = True) -> torch.Tensor:
    """``dense[indices[j]] += values[j]`` in place, duplicate indices summed; returns ``dense``. Indices outside
    ``[0, dense.numel())`` are never written; with ``check`` they raise ValueError (one host sync)."""
    invalid = _kernels(dense, backend, "scatter_add").scatter_add(dense, indices, values)
    if check:
        _raise_on_invalid(invalid, "scatter_add", dense.numel())
    return dense


def residual_update_(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                     backend: BackendLike = None, check: bool = True) -> torch.Tensor:
    """``residual[indices[j]] -= values[j]`` in place (what was sent leaves the residual); returns ``residual``.
    Index rules as in :func:`scatter_add_`."""
    invalid = _kernels(residual, backend, "residual_update").residual_update(residual, indices, values)
    if check:
        _raise_on_invalid(invalid, "residual_update", residual.numel())
    return residual


def wire_encode(indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor, numel: int, *,
                backend: BackendLike = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compact wire: the first ``clamp(count, 0, k)`` slots of a message (indices ascending in
    ``[0, numel)``) as ``(halves, low, pages, shift)``: float16 ``value * 2^shift`` (one shift per message: never
    an overflow), the int16 low 16 bits of each index, and ``pages`` (int32, per 65536 elements plus one: how many
    slots have a smaller index than the page's first). Slots past the count are (0, 0). No host sync on GPUs."""
    return _kernels(values, backend, "wire_encode").wire_encode(indices, values, count, int(numel))


def wire_decode(halves: torch.Tensor, low: torch.Tensor, pages: torch.Tensor, shift: torch.Tensor,
                count: torch.Tensor, numel: int, *, backend: BackendLike = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`wire_encode`: ``(indices int32[k], values float32[k], invalid int32[1])``.
    ``invalid`` counts the signs of a corrupted message (a bad shift or page table, indices that do not ascend or
    reach ``numel``); the slots concerned come out as (0, 0)."""
    return _kernels(halves, backend, "wire_decode").wire_decode(halves, low, pages, shift, count, int(numel))
