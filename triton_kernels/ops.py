"""The Triton kernels as torch ops ``torch.ops.gtopk_ext_triton.*``, traceable by ``torch.compile``.

Each op takes its schema, its argument checks and its outputs' shapes from the C++ op of the same name
(``torch.ops.gtopk_ext.*``, csrc/ops.cpp: the schema and the Meta kernel), so both namespaces have one contract;
the namespace is its own because the CUDA dispatch key belongs to the CUDA kernels. They run on CUDA tensors, or on
CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was imported. None of them synchronises with the
host.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
from torch.library import triton_op, wrap_triton

from gtopk_ext import _C  # noqa: F401  (registers the C++ schemas that these ops take)
from gtopk_ext import _contract
from gtopk_ext._contract import (FINE_BINS, FINE_SHIFT, HIST_BINS, HIST_INF_KEY, HIST_SHIFT, NUM_STATS,
                                 STAT_THRESHOLD)

from . import kernels, wire_kernels

def _checked(name: str, *args) -> None:
    """The checks of op ``name`` (the C++ op's Meta kernel), then the Triton device rule on its first tensor (the
    checks put every tensor on one device): Triton cannot read CPU memory on a GPU; the interpreter runs on any."""
    _contract.check_args(name, *args)
    index, tensor = next((i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    if not (tensor.device.type == "cuda" or triton.knobs.runtime.interpret):
        raise RuntimeError(f"{name}: {_contract.schema(name).arguments[index].name} must be a CUDA tensor for the "
                           "Triton kernels (CPU tensors need TRITON_INTERPRET=1 set before triton is imported), got "
                           f"{tensor.device}")


# --- the ops -------------------------------------------------------------------------------------------------

# The ops registered below, by name: gpu_build builds the kernels that each of them launches.
REGISTERED: list[str] = []


def _register(name: str):
    """Registers the decorated function as torch.ops.gtopk_ext_triton.<name> with the C++ op's schema.

    On a GPU: a triton_op, whose body (check, allocations, wrap_triton launches) is also its fake kernel and is
    traced by torch.compile, so Inductor sees the kernels. Under the interpreter wrap_triton hands back the raw
    kernel, which tracing would run on fake tensors (or drop from the graph): there the op is an opaque
    custom_op whose fake kernel is the C++ op's (its Meta kernel, which checks the arguments and allocates the
    outputs)."""
    qualified_name = f"gtopk_ext_triton::{name}"
    options = dict(mutates_args=_contract.mutated_args(name), schema=_contract.schema_string(name))

    def fake(*args, **kwargs):
        return getattr(torch.ops.gtopk_ext, name)(*args, **kwargs)

    def register(fn: Callable):
        REGISTERED.append(name)
        if not triton.knobs.runtime.interpret:
            return triton_op(qualified_name, **options)(fn)
        op = torch.library.custom_op(qualified_name, **options)(fn)
        op.register_fake(fake)
        return op

    return register


def _num_blocks(numel: int) -> int:
    return max(1, triton.cdiv(numel, kernels.BLOCK))  # at least one program, so empty inputs get their outputs


@_register("gaussian_threshold")
def gaussian_threshold(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int) -> torch.Tensor:
    """float32[5] (mean, std, max|acc|, Gaussian threshold, threshold) of acc = grad (+ residual, updated in
    place). Two launches: a pass over the data (per-block partials, histogram atomics) and one program that
    merges them, so the threshold never leaves the device."""
    _checked("gaussian_threshold", grad, residual, z, k)
    return _launch_gaussian_threshold(grad, residual, z, k)


@_register("compact")
def compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """(values[capacity], int32 indices[capacity], int32 count[1]) of the elements with |acc| >= threshold[0],
    indices ascending, count before truncation, padding (index 0, value 0); on overflow the sure candidates
    (csrc/histogram.h sure_threshold) first. Counts per block, scans the counts on the device, then each block
    with candidates to keep writes them at their slots."""
    _checked("compact", acc, threshold, capacity)
    return _launch_compact(acc, threshold, capacity)


@_register("gaussian_select")
def gaussian_select(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int, capacity: int,
                    update_residual: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, indices, count, stats): gaussian_threshold, its threshold refined inside its bin, then compact of
    acc at it, on the device (more reads of acc are cheap on a GPU); with update_residual the kept elements leave
    the residual in the compaction's last kernel."""
    _checked("gaussian_select", grad, residual, z, k, capacity, update_residual)
    stats = _launch_gaussian_threshold(grad, residual, z, k)
    acc = (residual if residual is not None else grad).contiguous()
    fine = torch.zeros(FINE_BINS + 1, dtype=torch.int32, device=acc.device)  # sub-bins, then above
    fine_layout = dict(HIST_SHIFT=HIST_SHIFT, HIST_INF_KEY=HIST_INF_KEY,
                       FINE_SHIFT=FINE_SHIFT, FINE_BINS=FINE_BINS)
    wrap_triton(kernels.fine_count_kernel)[(_num_blocks(acc.numel()),)](
        acc, stats, fine, acc.numel(), BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS, **fine_layout)
    wrap_triton(kernels.fine_finish_kernel)[(1,)](stats, fine, k, num_warps=kernels.FINISH_NUM_WARPS, **fine_layout)
    update_acc = update_residual and residual is not None
    return (*_launch_compact(acc, stats[STAT_THRESHOLD:STAT_THRESHOLD + 1], capacity, update_acc), stats)


def _launch_gaussian_threshold(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float,
                               k: int) -> torch.Tensor:
    grad = grad.contiguous()
    n = grad.numel()
    num_blocks = _num_blocks(n)
    device = grad.device
    shift = torch.empty(1, dtype=torch.float64, device=device)
    partial_sum = torch.empty(num_blocks, dtype=torch.float64, device=device)
    partial_sum_sq = torch.empty(num_blocks, dtype=torch.float64, device=device)
    partial_max = torch.empty(num_blocks, dtype=torch.float32, device=device)
    use_histogram = k > 0
    histogram = torch.zeros(kernels.HIST_COPIES * HIST_BINS if use_histogram else 1, dtype=torch.int32,
                            device=device)
    hist_layout = dict(HIST_COPIES=kernels.HIST_COPIES, HIST_BINS=HIST_BINS, HIST_SHIFT=HIST_SHIFT)
    wrap_triton(kernels.moments_histogram_kernel)[(num_blocks,)](
        grad, residual if residual is not None else grad, shift, partial_sum, partial_sum_sq, partial_max, histogram, n,
        HAS_RESIDUAL=residual is not None, USE_HISTOGRAM=use_histogram, LOCAL_BINS=kernels.LOCAL_BINS,
        BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS, **hist_layout)
    stats = torch.empty(NUM_STATS, dtype=torch.float32, device=device)
    wrap_triton(kernels.finish_stats_kernel)[(1,)](
        shift, partial_sum, partial_sum_sq, partial_max, num_blocks, histogram, stats, n, z, k,
        USE_HISTOGRAM=use_histogram, HIST_INF_KEY=HIST_INF_KEY, PARTIAL_BLOCK=kernels.PARTIAL_BLOCK,
        num_warps=kernels.FINISH_NUM_WARPS, **hist_layout)
    return stats


def _launch_compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int,
                    update_acc: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = acc.contiguous()
    n = acc.numel()
    num_blocks = _num_blocks(n)
    device = acc.device
    layout = dict(HIST_SHIFT=HIST_SHIFT, HIST_INF_KEY=HIST_INF_KEY, BLOCK=kernels.BLOCK,
                  num_warps=kernels.NUM_WARPS)
    block_counts = torch.empty(2, num_blocks, dtype=torch.int32, device=device)  # sure, boundary
    wrap_triton(kernels.count_candidates_kernel)[(num_blocks,)](acc, threshold, block_counts, n, **layout)
    block_ends = torch.cumsum(block_counts, 1, dtype=torch.int32)  # at most n < 2^31
    values = torch.zeros(capacity, dtype=acc.dtype, device=device)
    indices = torch.zeros(capacity, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    wrap_triton(kernels.write_selected_kernel)[(num_blocks,)](
        acc, threshold, block_counts, block_ends, values, indices, count, n, capacity, UPDATE_ACC=update_acc,
        **layout)
    return values, indices, count


def _signed_scatter(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, sign: float,
                    op: str) -> torch.Tensor:
    """dense[indices[j]] += sign * values[j], skipping indices outside [0, numel); returns int32[1] skipped."""
    _checked(op, dense, indices, values)
    indices = indices.contiguous()
    values = values.contiguous()
    invalid = torch.zeros(1, dtype=torch.int32, device=dense.device)
    m = indices.numel()
    if m == 0:
        return invalid
    # A stable sort groups the duplicates in slot order; the two levels sum them without float atomics, so every
    # run, rank and launch configuration gets the same bits (replicas stay bitwise equal).
    sorted_indices, order = torch.sort(indices, stable=True)
    piece_sums = torch.empty(m, dtype=torch.float32, device=dense.device)
    grid = (triton.cdiv(m, kernels.BLOCK),)
    wrap_triton(kernels.piece_sums_kernel)[grid](
        dense, sorted_indices, order, values, piece_sums, dense.numel(), m, SIGN=sign, TILE=_contract.SCATTER_TILE,
        BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS)
    wrap_triton(kernels.apply_run_sums_kernel)[grid](
        dense, sorted_indices, piece_sums, invalid, dense.numel(), m, TILE=_contract.SCATTER_TILE, BLOCK=kernels.BLOCK,
        num_warps=kernels.NUM_WARPS)
    return invalid


@_register("scatter_add")
def scatter_add(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """dense[indices[j]] += values[j], duplicates summed; returns int32[1], how many indices were out of range
    (skipped, never written)."""
    return _signed_scatter(dense, indices, values, 1.0, "scatter_add")


@_register("residual_update")
def residual_update(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """residual[indices[j]] -= values[j]: what was sent leaves the residual (exactly zero when values came from
    compact on this residual). Index rules and result as scatter_add."""
    return _signed_scatter(residual, indices, values, -1.0, "residual_update")


@_register("wire_encode")
def wire_encode(indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor,
                numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compact wire's (halves, low, pages, shift) of the used slots: per-block maxima of the finite
    |values|, their maximum (torch, on the device), then the slots' patterns and a binary search per page."""
    _checked("wire_encode", indices, values, count, numel)
    indices, values = indices.contiguous(), values.contiguous()
    k, device = values.numel(), values.device
    num_pages = _contract.wire_num_pages(numel)
    num_blocks = _num_blocks(k)
    partial_max = torch.empty(num_blocks, dtype=torch.float32, device=device)
    wrap_triton(wire_kernels.wire_max_kernel)[(num_blocks,)](values, count, partial_max, k, BLOCK=kernels.BLOCK,
                                                         num_warps=kernels.NUM_WARPS)
    max_abs = partial_max.amax().reshape(1)
    halves = torch.empty(k, dtype=torch.float16, device=device)
    low = torch.empty(k, dtype=torch.int16, device=device)
    shift = torch.empty(1, dtype=torch.int32, device=device)
    wrap_triton(wire_kernels.wire_encode_kernel)[(num_blocks,)](
        indices, values, count, max_abs, halves, low, shift, k, SHIFT_MAX=_contract.WIRE_SHIFT_MAX,
        SHIFT_BASE=_contract.WIRE_SHIFT_BASE, HALF_NAN=_contract.WIRE_HALF_NAN, BLOCK=kernels.BLOCK,
        num_warps=kernels.NUM_WARPS)
    pages = torch.empty(num_pages + 1, dtype=torch.int32, device=device)
    wrap_triton(wire_kernels.wire_pages_kernel)[(_num_blocks(num_pages + 1),)](
        indices, count, pages, num_pages, k, PAGE_SHIFT=_contract.WIRE_PAGE_SHIFT, BLOCK=kernels.BLOCK,
        num_warps=kernels.NUM_WARPS)
    return halves, low, pages, shift


@_register("wire_decode")
def wire_decode(halves: torch.Tensor, low: torch.Tensor, pages: torch.Tensor, shift: torch.Tensor,
                count: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices, float32 values, invalid) of a compact message: the page table's entries checked, then each slot
    decoded with a binary search for its page."""
    _checked("wire_decode", halves, low, pages, shift, count, numel)
    halves, low, pages = halves.contiguous(), low.contiguous(), pages.contiguous()
    k, device = halves.numel(), halves.device
    num_pages = _contract.wire_num_pages(numel)
    invalid = torch.zeros(1, dtype=torch.int32, device=device)
    wrap_triton(wire_kernels.wire_check_pages_kernel)[(_num_blocks(num_pages + 1),)](
        pages, count, invalid, num_pages, k, BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS)
    indices = torch.empty(k, dtype=torch.int32, device=device)
    values = torch.empty(k, dtype=torch.float32, device=device)
    wrap_triton(wire_kernels.wire_decode_kernel)[(_num_blocks(k),)](
        halves, low, pages, shift, count, indices, values, invalid, num_pages, numel, k,
        PAGE_SHIFT=_contract.WIRE_PAGE_SHIFT, SHIFT_MAX=_contract.WIRE_SHIFT_MAX,
        FLOAT_NAN=_contract.WIRE_FLOAT_NAN, BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS)
    return indices, values, invalid
