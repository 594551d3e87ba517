"""Typed wrappers over the ``torch.ops.gtopk_ext`` kernels, their fake kernels, and the backend choice.

Every wrapper takes ``backend=None``: ``"auto"`` (the C++ CPU kernels for CPU tensors, the CUDA kernels for CUDA
tensors), ``"cpu"``, ``"cuda"`` or ``"triton"`` (the Triton kernels: CUDA tensors, or CPU tensors when
``TRITON_INTERPRET=1``). ``None`` reads the environment variable ``GTOPK_EXT_BACKEND`` (default ``"auto"``).
"""

from __future__ import annotations

import os
from statistics import NormalDist

import torch

# Layout of gaussian_threshold's output (csrc/common.h holds the same).
STAT_MEAN, STAT_STD, STAT_MAX_ABS, STAT_GAUSSIAN_THRESHOLD, STAT_THRESHOLD = range(5)
NUM_STATS = 5

BACKENDS = ("auto", "cpu", "cuda", "triton")


def z_for_density(density: float) -> float:
    """The Gaussian quantile z with P(|X| >= z) = density for X ~ N(0, 1): the threshold is |mean| + z * std."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return NormalDist().inv_cdf(1.0 - density / 2.0) if density < 1.0 else 0.0


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that runs an op on ``device``: ``backend``, else $GTOPK_EXT_BACKEND, else ``"auto"``."""
    choice = backend if backend is not None else os.environ.get("GTOPK_EXT_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    elif choice != device.type:
        raise ValueError(f"backend {choice!r} cannot run on tensors on {device}")
    return choice


def _kernels(device: torch.device, backend: str | None):
    if resolve_backend(device, backend) == "triton":
        from gtopk_ext import triton_kernels  # imports triton, so only on request

        return triton_kernels.ops
    return torch.ops.gtopk_ext


def _raise_on_invalid(invalid: torch.Tensor, op: str, numel: int) -> None:
    skipped = int(invalid.item())
    if skipped:
        raise ValueError(f"{op}: {skipped} indices outside [0, {numel}) were skipped (corrupted message?)")


def gaussian_threshold(grad: torch.Tensor, residual: torch.Tensor | None = None, *, z: float, k: int = 0,
                       backend: str | None = None) -> torch.Tensor:
    """One pass over ``acc = grad + residual`` (``residual`` becomes ``acc`` in place; ``None``: ``acc = grad``).

    Returns float32[NUM_STATS] on grad's device: mean and std (non-finite when acc has a non-finite element),
    max |acc| (NaN ignored), the Gaussian threshold ``|mean| + z * std`` and, at ``STAT_THRESHOLD``, the threshold
    to select with: when ``k > 0`` the one that a log-scale histogram of |acc| says keeps about ``k`` elements,
    else the Gaussian one. No host sync.
    """
    return _kernels(grad.device, backend).gaussian_threshold(grad, residual, float(z), int(k))


@torch.library.register_fake("gtopk_ext::gaussian_threshold")
def _(grad, residual, z, k):
    return grad.new_empty(NUM_STATS, dtype=torch.float32)


def compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int, *,
            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, count)``: the elements with ``|acc| >= threshold[0]`` in ascending index order.

    ``values`` (acc's dtype) and ``indices`` (int32) have ``capacity`` slots; ``count`` (int32[1]) is how many
    elements passed before truncation to ``capacity``; slots past it hold (index 0, value 0). When more than
    ``capacity`` pass, the ones at or above the upper edge of the threshold's histogram bin (2.2% above it) are
    kept first and the rest of the slots go to the others in index order, so no large element is dropped.
    """
    return _kernels(acc.device, backend).compact(acc, threshold, int(capacity))


@torch.library.register_fake("gtopk_ext::compact")
def _(acc, threshold, capacity):
    return (acc.new_empty(capacity), acc.new_empty(capacity, dtype=torch.int32),
            acc.new_empty(1, dtype=torch.int32))


def gaussian_select(grad: torch.Tensor, residual: torch.Tensor | None = None, *, z: float, k: int, capacity: int,
                    backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gaussian_threshold` with ``k >= 1``, its threshold refined inside its histogram bin (moved to the
    lower edge of the 32-float sub-bin holding the k-th largest |acc|), then :func:`compact` of acc at it, in one
    call: returns ``(values, indices, count, stats)``, ``stats[STAT_THRESHOLD]`` being the refined threshold.

    The C++ CPU kernel records, in its statistics pass, the elements above its running histogram floor (a
    superset of the selection) and refines and selects from those while they fit (about density < 0.01), else
    reads acc again. CUDA and Triton run the threshold, a counting pass with one finishing block, and compact.
    """
    return _kernels(grad.device, backend).gaussian_select(grad, residual, float(z), int(k), int(capacity))


@torch.library.register_fake("gtopk_ext::gaussian_select")
def _(grad, residual, z, k, capacity):
    return (grad.new_empty(capacity), grad.new_empty(capacity, dtype=torch.int32),
            grad.new_empty(1, dtype=torch.int32), grad.new_empty(NUM_STATS, dtype=torch.float32))


def merge_topk(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor, values_b: torch.Tensor,
               k: int, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gTop-k's merge: the union of two sparse sets, values of equal indices summed (float32, in slot order: a's
    slots, then b's), then the k largest |sums| (NaN first; ties to the lower index), by ascending index and
    padded with (0, 0) to k slots. Padding slots (index 0, value 0) join index 0's sum, where they add nothing.

    Returns ``(indices int32[k], values[k] in values_a's dtype, union_size int32[1])``. Deterministic: partners
    that pass the same two sets in the same order get bitwise the same result. On the CPU a C++ kernel (a linear
    merge of the ascending sets and a selection of the k-th best); on other devices torch's unique and sort.
    """
    if resolve_backend(indices_a.device, backend) == "cpu":
        return torch.ops.gtopk_ext.merge_topk(indices_a, values_a, indices_b, values_b, int(k))
    return merge_topk_with_torch(indices_a, values_a, indices_b, values_b, int(k))


def merge_topk_with_torch(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor,
                          values_b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`merge_topk` with torch's unique and sort, on any device (what runs on GPUs)."""
    union, inverse = torch.unique(torch.cat([indices_a, indices_b]), sorted=True, return_inverse=True)
    sums = torch.zeros(union.numel(), dtype=torch.float32, device=union.device)
    sums.index_add_(0, inverse, torch.cat([values_a, values_b]).float())
    union_size = union.numel()
    if union_size > k:
        # A stable sort keeps equal magnitudes in index order, so the lower index wins a tie.
        keep = torch.sort(sums.abs(), descending=True, stable=True).indices[:k].sort().values
        union, sums = union[keep], sums[keep]
    indices = torch.zeros(k, dtype=torch.int32, device=union.device)
    values = torch.zeros(k, dtype=values_a.dtype, device=union.device)
    indices[:union.numel()] = union
    values[:union.numel()] = sums.to(values_a.dtype)
    return indices, values, torch.tensor([union_size], dtype=torch.int32, device=union.device)


@torch.library.register_fake("gtopk_ext::merge_topk")
def _(indices_a, values_a, indices_b, values_b, k):
    return (indices_a.new_empty(k), values_a.new_empty(k), indices_a.new_empty(1))


def scatter_add_(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, backend: str | None = None,
                 check: bool = True) -> torch.Tensor:
    """``dense[indices[j]] += values[j]`` in place, duplicate indices summed; returns ``dense``.

    Indices outside ``[0, dense.numel())`` are never written; with ``check`` they raise ValueError (one host
    sync), else their number is lost. Use ``torch.ops.gtopk_ext.scatter_add`` to get it as a tensor.
    """
    invalid = _kernels(dense.device, backend).scatter_add(dense, indices, values)
    if check:
        _raise_on_invalid(invalid, "scatter_add", dense.numel())
    return dense


@torch.library.register_fake("gtopk_ext::scatter_add")
def _(dense, indices, values):
    return dense.new_empty(1, dtype=torch.int32)


def residual_update_(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                     backend: str | None = None, check: bool = True) -> torch.Tensor:
    """``residual[indices[j]] -= values[j]`` in place: what was sent leaves the residual; returns ``residual``.

    With values taken from ``compact`` of this residual, the sent entries become exactly zero. Index rules as in
    :func:`scatter_add_`.
    """
    invalid = _kernels(residual.device, backend).residual_update(residual, indices, values)
    if check:
        _raise_on_invalid(invalid, "residual_update", residual.numel())
    return residual


@torch.library.register_fake("gtopk_ext::residual_update")
def _(residual, indices, values):
    return residual.new_empty(1, dtype=torch.int32)
