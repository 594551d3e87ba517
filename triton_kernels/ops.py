"""The Triton kernels as torch ops ``torch.ops.gtopk_ext_triton.*``, traceable by ``torch.compile``.

Each op has the schema, semantics, outputs and argument-check messages of the C++ op of the same name
(``torch.ops.gtopk_ext.*``: csrc/ops.cpp, csrc/common.h), and is called positionally like it by
``gtopk_ext.ops`` when the backend is ``"triton"``. They run on CUDA tensors, or on CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was imported. None of them synchronises with the host.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import triton
from torch.library import triton_op, wrap_triton

from gtopk_ext.ops import NUM_STATS, STAT_THRESHOLD

from . import kernels

INT32_MAX = 2**31 - 1


# --- argument checks: the messages of csrc/common.h (RuntimeError, as TORCH_CHECK raises) ---------------------

@functools.lru_cache(maxsize=None)
def _scalar_type_name(dtype: torch.dtype) -> str:
    """The C++ name of a dtype as TORCH_CHECK prints it: Float, Half, BFloat16, Long, ..."""
    try:
        return torch.empty(0, dtype=dtype, device="meta").type().rsplit(".", 1)[1].removesuffix("Tensor")
    except RuntimeError:  # quantized dtypes have no meta tensors
        return str(dtype).removeprefix("torch.")


def _check(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise RuntimeError(f"{op}: {message}")


def _check_float_tensor(t: torch.Tensor, op: str, name: str) -> None:
    _check(t.dtype in (torch.float32, torch.float16, torch.bfloat16), op,
           f"{name} must be float32, float16 or bfloat16, got {_scalar_type_name(t.dtype)}")
    _check(t.numel() <= INT32_MAX, op,
           f"{name} has {t.numel()} elements, but gtopk_ext uses int32 indices and supports at most 2^31 - 1 "
           "elements per tensor; split it into smaller buckets")


def _check_triton_device(t: torch.Tensor, op: str, name: str) -> None:
    # Triton cannot read CPU memory on a GPU; the interpreter runs on any tensor.
    _check(t.device.type == "cuda" or triton.knobs.runtime.interpret, op,
           f"{name} must be a CUDA tensor for the Triton kernels (CPU tensors need TRITON_INTERPRET=1 set before "
           f"triton is imported), got {t.device}")


def _check_same_device(t: torch.Tensor, ref: torch.Tensor, op: str, name: str, ref_name: str) -> None:
    _check(t.device == ref.device, op, f"{name} must be on {ref_name}'s device ({ref.device}), got {t.device}")


def _check_mutable_contiguous(t: torch.Tensor, op: str, name: str) -> None:
    # A copy would leave the caller's tensor unchanged.
    _check(t.is_contiguous(), op, f"{name} is updated in place and must be contiguous")


def check_gaussian_threshold_args(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int,
                                  op: str = "gaussian_threshold") -> None:
    """Raises RuntimeError naming the first bad argument of gaussian_threshold (or of ``op``, which calls it)."""
    _check_float_tensor(grad, op, "grad")
    _check_triton_device(grad, op, "grad")
    _check(z == z and abs(z) != float("inf"), op, f"z must be finite, got {z}")
    _check(k >= 0, op, f"k must be >= 0 (0: Gaussian threshold only), got {k}")
    if residual is not None:
        _check(residual.dtype == grad.dtype, op, f"residual must have grad's dtype "
               f"({_scalar_type_name(grad.dtype)}), got {_scalar_type_name(residual.dtype)}")
        _check(residual.shape == grad.shape, op,
               f"residual must have grad's shape {list(grad.shape)}, got {list(residual.shape)}")
        _check_same_device(residual, grad, op, "residual", "grad")
        _check_mutable_contiguous(residual, op, "residual")


def check_compact_args(acc: torch.Tensor, threshold: torch.Tensor, capacity: int) -> None:
    """Raises RuntimeError naming the first bad argument of compact."""
    op = "compact"
    _check_float_tensor(acc, op, "acc")
    _check_triton_device(acc, op, "acc")
    _check(threshold.dtype == torch.float32 and threshold.numel() == 1, op,
           f"threshold must be a float32 tensor of one element, got {_scalar_type_name(threshold.dtype)} with "
           f"{threshold.numel()} elements")
    _check_same_device(threshold, acc, op, "threshold", "acc")
    _check_capacity(capacity, op)


def _check_capacity(capacity: int, op: str) -> None:
    _check(capacity >= 1, op, f"capacity must be >= 1, got {capacity}")
    _check(capacity <= INT32_MAX, op, f"capacity must be < 2^31, got {capacity}")


def check_gaussian_select_args(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int,
                               capacity: int) -> None:
    """Raises RuntimeError naming the first bad argument of gaussian_select."""
    op = "gaussian_select"
    check_gaussian_threshold_args(grad, residual, z, k, op)
    _check(k >= 1, op, f"k must be >= 1 (it selects at the histogram threshold), got {k}")
    _check_capacity(capacity, op)


def check_scatter_args(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, op: str,
                       dense_name: str) -> None:
    """Raises RuntimeError naming the first bad argument of scatter_add / residual_update."""
    _check_float_tensor(dense, op, dense_name)
    _check_triton_device(dense, op, dense_name)
    _check_mutable_contiguous(dense, op, dense_name)
    _check(indices.dtype == torch.int32, op, f"indices must be int32, got {_scalar_type_name(indices.dtype)}")
    _check(indices.dim() == 1, op, f"indices must be 1-D, got {indices.dim()}-D")
    _check(values.dtype == dense.dtype, op, f"values must have {dense_name}'s dtype "
           f"({_scalar_type_name(dense.dtype)}), got {_scalar_type_name(values.dtype)}")
    _check(values.shape == indices.shape, op,
           f"values must have indices' shape {list(indices.shape)}, got {list(values.shape)}")
    _check_same_device(indices, dense, op, "indices", dense_name)
    _check_same_device(values, dense, op, "values", dense_name)


# --- the ops -------------------------------------------------------------------------------------------------

def _register(name: str, mutates_args: set[str], fake: Callable):
    """Registers the decorated function as torch.ops.gtopk_ext_triton.<name>.

    On a GPU: a triton_op, whose body (check, allocations, wrap_triton launches) is also its fake kernel and is
    traced by torch.compile, so Inductor sees the kernels. Under the interpreter wrap_triton hands back the raw
    kernel, which tracing would run on fake tensors (or drop from the graph): there the op is an opaque
    custom_op with the explicit fake kernel ``fake``, which checks the arguments and allocates the outputs."""
    qualified_name = f"gtopk_ext_triton::{name}"

    def register(fn: Callable):
        if not triton.knobs.runtime.interpret:
            return triton_op(qualified_name, mutates_args=mutates_args)(fn)
        op = torch.library.custom_op(qualified_name, mutates_args=mutates_args)(fn)
        op.register_fake(fake)
        return op

    return register


def _gaussian_threshold_fake(grad, residual, z, k):
    check_gaussian_threshold_args(grad, residual, z, k)
    return grad.new_empty(NUM_STATS, dtype=torch.float32)


def _selection_outputs(acc: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (acc.new_empty(capacity), acc.new_empty(capacity, dtype=torch.int32),
            acc.new_empty(1, dtype=torch.int32))


def _compact_fake(acc, threshold, capacity):
    check_compact_args(acc, threshold, capacity)
    return _selection_outputs(acc, capacity)


def _gaussian_select_fake(grad, residual, z, k, capacity):
    check_gaussian_select_args(grad, residual, z, k, capacity)
    return (*_selection_outputs(grad, capacity), grad.new_empty(NUM_STATS, dtype=torch.float32))


def _scatter_fake(op: str, dense_name: str) -> Callable:
    def fake(dense, indices, values):
        check_scatter_args(dense, indices, values, op, dense_name)
        return dense.new_empty(1, dtype=torch.int32)

    return fake


def _num_blocks(numel: int) -> int:
    return max(1, triton.cdiv(numel, kernels.BLOCK))  # at least one program, so empty inputs get their outputs


@_register("gaussian_threshold", {"residual"}, _gaussian_threshold_fake)
def gaussian_threshold(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int) -> torch.Tensor:
    """float32[5] (mean, std, max|acc|, Gaussian threshold, threshold) of acc = grad (+ residual, updated in
    place). Two launches: a pass over the data (per-block partials, histogram atomics) and one program that
    merges them, so the threshold never leaves the device."""
    check_gaussian_threshold_args(grad, residual, z, k)
    return _launch_gaussian_threshold(grad, residual, z, k)


@_register("compact", set(), _compact_fake)
def compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """(values[capacity], int32 indices[capacity], int32 count[1]) of the elements with |acc| >= threshold[0],
    indices ascending, count before truncation, padding (index 0, value 0); on overflow the sure candidates
    (csrc/common.h sure_threshold) first. Counts per block, scans the counts on the device, then each block
    with candidates to keep writes them at their slots."""
    check_compact_args(acc, threshold, capacity)
    return _launch_compact(acc, threshold, capacity)


@_register("gaussian_select", {"residual"}, _gaussian_select_fake)
def gaussian_select(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int,
                    capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, indices, count, stats): gaussian_threshold, its threshold refined inside its bin, then compact of
    acc at it, on the device (more reads of acc are cheap on a GPU)."""
    check_gaussian_select_args(grad, residual, z, k, capacity)
    stats = _launch_gaussian_threshold(grad, residual, z, k)
    acc = (residual if residual is not None else grad).contiguous()
    fine = torch.zeros(kernels.FINE_BINS + 1, dtype=torch.int32, device=acc.device)  # sub-bins, then above
    fine_layout = dict(HIST_SHIFT=kernels.HIST_SHIFT, HIST_INF_KEY=kernels.HIST_INF_KEY,
                       FINE_SHIFT=kernels.FINE_SHIFT, FINE_BINS=kernels.FINE_BINS)
    wrap_triton(kernels.fine_count_kernel)[(_num_blocks(acc.numel()),)](
        acc, stats, fine, acc.numel(), BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS, **fine_layout)
    wrap_triton(kernels.fine_finish_kernel)[(1,)](stats, fine, k, num_warps=kernels.FINISH_NUM_WARPS, **fine_layout)
    return (*_launch_compact(acc, stats[STAT_THRESHOLD:STAT_THRESHOLD + 1], capacity), stats)


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
    histogram = torch.zeros(kernels.HIST_COPIES * kernels.HIST_BINS if use_histogram else 1, dtype=torch.int32,
                            device=device)
    hist_layout = dict(HIST_COPIES=kernels.HIST_COPIES, HIST_BINS=kernels.HIST_BINS, HIST_SHIFT=kernels.HIST_SHIFT)
    wrap_triton(kernels.moments_histogram_kernel)[(num_blocks,)](
        grad, residual if residual is not None else grad, shift, partial_sum, partial_sum_sq, partial_max, histogram, n,
        HAS_RESIDUAL=residual is not None, USE_HISTOGRAM=use_histogram, BLOCK=kernels.BLOCK,
        num_warps=kernels.NUM_WARPS, **hist_layout)
    stats = torch.empty(NUM_STATS, dtype=torch.float32, device=device)
    wrap_triton(kernels.finish_stats_kernel)[(1,)](
        shift, partial_sum, partial_sum_sq, partial_max, num_blocks, histogram, stats, n, z, k,
        USE_HISTOGRAM=use_histogram, HIST_INF_KEY=kernels.HIST_INF_KEY, PARTIAL_BLOCK=kernels.PARTIAL_BLOCK,
        num_warps=kernels.FINISH_NUM_WARPS, **hist_layout)
    return stats


def _launch_compact(acc: torch.Tensor, threshold: torch.Tensor,
                    capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = acc.contiguous()
    n = acc.numel()
    num_blocks = _num_blocks(n)
    device = acc.device
    layout = dict(HIST_SHIFT=kernels.HIST_SHIFT, HIST_INF_KEY=kernels.HIST_INF_KEY, BLOCK=kernels.BLOCK,
                  num_warps=kernels.NUM_WARPS)
    block_counts = torch.empty(2, num_blocks, dtype=torch.int32, device=device)  # sure, boundary
    wrap_triton(kernels.count_candidates_kernel)[(num_blocks,)](acc, threshold, block_counts, n, **layout)
    block_ends = torch.cumsum(block_counts, 1, dtype=torch.int32)  # at most n < 2^31
    values = torch.zeros(capacity, dtype=acc.dtype, device=device)
    indices = torch.zeros(capacity, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    wrap_triton(kernels.write_selected_kernel)[(num_blocks,)](
        acc, threshold, block_counts, block_ends, values, indices, count, n, capacity, **layout)
    return values, indices, count


def _signed_scatter(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, sign: float, op: str,
                    dense_name: str) -> torch.Tensor:
    """dense[indices[j]] += sign * values[j], skipping indices outside [0, numel); returns int32[1] skipped."""
    check_scatter_args(dense, indices, values, op, dense_name)
    indices = indices.contiguous()
    values = values.contiguous()
    invalid = torch.zeros(1, dtype=torch.int32, device=dense.device)
    m = indices.numel()
    if m == 0:
        return invalid
    grid = (triton.cdiv(m, kernels.BLOCK),)
    launch = dict(BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS)
    if dense.dtype == torch.float32:
        wrap_triton(kernels.scatter_atomic_kernel)[grid](
            dense, indices, values, invalid, dense.numel(), m, SIGN=sign, **launch)
        return invalid
    # fp16/bf16: no 16-bit atomics (bf16 ones need sm_90 and the interpreter has none). Sorting groups the
    # duplicates; each index's values are summed in fp32 and added to dense with one rounding.
    sorted_indices, order = torch.sort(indices)
    run_starts = torch.cat([torch.ones(1, dtype=torch.bool, device=dense.device),
                            sorted_indices[1:] != sorted_indices[:-1]])
    segments = torch.cumsum(run_starts, 0, dtype=torch.int32) - 1
    sums = torch.full((m,), -0.0, dtype=torch.float32, device=dense.device)  # -0.0 + x is x, signed zeros too
    wrap_triton(kernels.segment_sum_kernel)[grid](order, segments, values, sums, m, **launch)
    wrap_triton(kernels.apply_segment_sums_kernel)[grid](
        dense, sorted_indices, segments, sums, invalid, dense.numel(), m, SIGN=sign, **launch)
    return invalid


@_register("scatter_add", {"dense"}, _scatter_fake("scatter_add", "dense"))
def scatter_add(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """dense[indices[j]] += values[j], duplicates summed; returns int32[1], how many indices were out of range
    (skipped, never written)."""
    return _signed_scatter(dense, indices, values, 1.0, "scatter_add", "dense")


@_register("residual_update", {"residual"}, _scatter_fake("residual_update", "residual"))
def residual_update(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """residual[indices[j]] -= values[j]: what was sent leaves the residual (exactly zero when values came from
    compact on this residual). Index rules and result as scatter_add."""
    return _signed_scatter(residual, indices, values, -1.0, "residual_update", "residual")
