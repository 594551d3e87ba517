"""The Python side of each op's contract: layout constants, argument checks and the shapes of the outputs.

The schemas are the C++ ones (``TORCH_LIBRARY`` in csrc/ops.cpp), read from the dispatcher; the checks here say
what csrc/common.h's ``TORCH_CHECK``s say, word for word and in the same order, and raise RuntimeError as they
do. They serve the fake kernels of ``torch.ops.gtopk_ext`` (gtopk_ext/ops.py) and the Triton ops
(gtopk_ext/triton_kernels/ops.py), which share the fakes too. The layout constants equal those of
csrc/common.h (``gtopk_ext._C`` exports them; a test compares) and are imported by the Triton kernels and the
reference.

Adding an op: its schema line and ``check_*_args`` in C++, one ``OpContract`` row here, its kernels per backend,
its reference function, its tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# ---- layout (csrc/common.h) ------------------------------------------------------------------------------------

# gaussian_threshold's float32 output.
STAT_MEAN, STAT_STD, STAT_MAX_ABS, STAT_GAUSSIAN_THRESHOLD, STAT_THRESHOLD = range(5)
NUM_STATS = 5
# The histogram: |acc| binned by the top 13 bits of its float32 pattern (8 exponent bits, 5 mantissa bits: bins
# 2^(1/32) wide on a log scale); +inf has its own bin, NaN (keys above it) is not counted.
HIST_SHIFT = 18
HIST_BINS = 1 << (31 - HIST_SHIFT)
HIST_INF_KEY = 0x7F800000 >> HIST_SHIFT
# gaussian_select's second level: the threshold's bin split into sub-bins of 2^FINE_SHIFT float32 patterns.
FINE_SHIFT = 5
FINE_BINS = 1 << (HIST_SHIFT - FINE_SHIFT)
# scatter_add and residual_update on GPUs: duplicates summed in slot order within tiles of this many sorted slots,
# then the tiles' partial sums in order (the reference defines the same order).
SCATTER_TILE = 256
# The compact wire (wire_encode, wire_decode): an index is its low 16 bits plus a table of pages of 2^16 elements;
# a value is float16 after a multiplication by 2^shift, shift = min(WIRE_SHIFT_MAX, WIRE_SHIFT_BASE - the biased
# exponent of the message's largest finite |value|); every NaN is sent as WIRE_HALF_NAN.
WIRE_PAGE_SHIFT = 16
WIRE_SHIFT_MAX = 126
WIRE_SHIFT_BASE = 141
WIRE_HALF_NAN = 0x7E00

LAYOUT = {name: globals()[name] for name in (
    "STAT_MEAN", "STAT_STD", "STAT_MAX_ABS", "STAT_GAUSSIAN_THRESHOLD", "STAT_THRESHOLD", "NUM_STATS", "HIST_SHIFT",
    "HIST_BINS", "HIST_INF_KEY", "FINE_SHIFT", "FINE_BINS", "SCATTER_TILE", "WIRE_PAGE_SHIFT", "WIRE_SHIFT_MAX",
    "WIRE_SHIFT_BASE", "WIRE_HALF_NAN")}


def wire_num_pages(numel: int) -> int:
    """The compact wire's pages of 2^WIRE_PAGE_SHIFT elements for a tensor of ``numel`` elements."""
    return (numel + (1 << WIRE_PAGE_SHIFT) - 1) >> WIRE_PAGE_SHIFT

# The one dtype rule: every op takes fp32, fp16 and bf16 (statistics and sums in fp32 or wider), int32 indices.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1


# ---- checks (csrc/common.h check_*) ----------------------------------------------------------------------------

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
    _check(t.dtype in FLOAT_DTYPES, op,
           f"{name} must be float32, float16 or bfloat16, got {_scalar_type_name(t.dtype)}")
    _check(t.numel() <= INT32_MAX, op,
           f"{name} has {t.numel()} elements, but gtopk_ext uses int32 indices and supports at most 2^31 - 1 "
           "elements per tensor; split it into smaller buckets")


def _check_same_device(t: torch.Tensor, ref: torch.Tensor, op: str, name: str, ref_name: str) -> None:
    _check(t.device == ref.device, op, f"{name} must be on {ref_name}'s device ({ref.device}), got {t.device}")


def _check_mutable_contiguous(t: torch.Tensor, op: str, name: str) -> None:
    # A copy would leave the caller's tensor unchanged.
    _check(t.is_contiguous(), op, f"{name} is updated in place and must be contiguous")


def _check_capacity(capacity: int, op: str, name: str = "capacity") -> None:
    _check(capacity >= 1, op, f"{name} must be >= 1, got {capacity}")
    _check(capacity <= INT32_MAX, op, f"{name} must be < 2^31, got {capacity}")


def check_gaussian_threshold_args(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int,
                                  op: str = "gaussian_threshold") -> None:
    _check_float_tensor(grad, op, "grad")
    _check(z == z and abs(z) != float("inf"), op, f"z must be finite, got {z}")
    _check(z >= 0.0, op, f"z must be >= 0 (the Gaussian threshold is |mean| + z * std), got {z:g}")
    _check(k >= 0, op, f"k must be >= 0 (0: Gaussian threshold only), got {k}")
    if residual is not None:
        _check(residual.dtype == grad.dtype, op, f"residual must have grad's dtype "
               f"({_scalar_type_name(grad.dtype)}), got {_scalar_type_name(residual.dtype)}")
        _check(residual.shape == grad.shape, op,
               f"residual must have grad's shape {list(grad.shape)}, got {list(residual.shape)}")
        _check_same_device(residual, grad, op, "residual", "grad")
        _check_mutable_contiguous(residual, op, "residual")


def check_compact_args(acc: torch.Tensor, threshold: torch.Tensor, capacity: int) -> None:
    op = "compact"
    _check_float_tensor(acc, op, "acc")
    _check(threshold.dtype == torch.float32 and threshold.numel() == 1, op,
           f"threshold must be a float32 tensor of one element, got {_scalar_type_name(threshold.dtype)} with "
           f"{threshold.numel()} elements")
    _check_same_device(threshold, acc, op, "threshold", "acc")
    _check_capacity(capacity, op)


def check_gaussian_select_args(grad: torch.Tensor, residual: Optional[torch.Tensor], z: float, k: int,
                               capacity: int) -> None:
    op = "gaussian_select"
    check_gaussian_threshold_args(grad, residual, z, k, op)
    _check(k >= 1, op, f"k must be >= 1 (it selects at the histogram threshold), got {k}")
    _check_capacity(capacity, op)


def check_merge_args(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor,
                     values_b: torch.Tensor, k: int) -> None:
    op = "merge_topk"
    for (indices_name, indices), (values_name, values) in (
            (("indices_a", indices_a), ("values_a", values_a)), (("indices_b", indices_b), ("values_b", values_b))):
        _check(indices.dtype == torch.int32 and indices.dim() == 1, op,
               f"{indices_name} must be a 1-D int32 tensor, got {_scalar_type_name(indices.dtype)} of "
               f"{indices.dim()} dimensions")
        _check_float_tensor(values, op, values_name)
        _check(values.shape == indices.shape, op,
               f"{values_name} must have {indices_name}'s shape {list(indices.shape)}, got {list(values.shape)}")
        _check_same_device(indices, values_a, op, indices_name, "values_a")
        _check_same_device(values, values_a, op, values_name, "values_a")
    _check(values_b.dtype == values_a.dtype, op, f"values_b must have values_a's dtype "
           f"({_scalar_type_name(values_a.dtype)}), got {_scalar_type_name(values_b.dtype)}")
    _check_capacity(k, op, "k")


def _check_scatter_args(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, op: str,
                        dense_name: str) -> None:
    _check_float_tensor(dense, op, dense_name)
    _check_mutable_contiguous(dense, op, dense_name)
    _check(indices.dtype == torch.int32, op, f"indices must be int32, got {_scalar_type_name(indices.dtype)}")
    _check(indices.dim() == 1, op, f"indices must be 1-D, got {indices.dim()}-D")
    _check(values.dtype == dense.dtype, op, f"values must have {dense_name}'s dtype "
           f"({_scalar_type_name(dense.dtype)}), got {_scalar_type_name(values.dtype)}")
    _check(values.shape == indices.shape, op,
           f"values must have indices' shape {list(indices.shape)}, got {list(values.shape)}")
    _check_same_device(indices, dense, op, "indices", dense_name)
    _check_same_device(values, dense, op, "values", dense_name)


def check_scatter_add_args(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    _check_scatter_args(dense, indices, values, "scatter_add", "dense")


def check_residual_update_args(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    _check_scatter_args(residual, indices, values, "residual_update", "residual")


def _check_wire_count(count: torch.Tensor, ref: torch.Tensor, op: str, ref_name: str) -> None:
    _check(count.dtype == torch.int32 and count.numel() == 1, op,
           f"count must be an int32 tensor of one element, got {_scalar_type_name(count.dtype)} with "
           f"{count.numel()} elements")
    _check_same_device(count, ref, op, "count", ref_name)


def _check_wire_numel(numel: int, op: str) -> None:
    _check(1 <= numel <= INT32_MAX, op, f"numel must be in [1, 2^31 - 1], got {numel}")


def check_wire_encode_args(indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor, numel: int) -> None:
    op = "wire_encode"
    _check(indices.dtype == torch.int32 and indices.dim() == 1, op,
           f"indices must be a 1-D int32 tensor, got {_scalar_type_name(indices.dtype)} of {indices.dim()} "
           "dimensions")
    _check_float_tensor(values, op, "values")
    _check(values.shape == indices.shape, op,
           f"values must have indices' shape {list(indices.shape)}, got {list(values.shape)}")
    _check_same_device(indices, values, op, "indices", "values")
    _check_wire_count(count, values, op, "values")
    _check_wire_numel(numel, op)


def check_wire_decode_args(halves: torch.Tensor, low: torch.Tensor, pages: torch.Tensor, shift: torch.Tensor,
                           count: torch.Tensor, numel: int) -> None:
    op = "wire_decode"
    _check(halves.dtype == torch.float16 and halves.dim() == 1, op,
           f"halves must be a 1-D float16 tensor, got {_scalar_type_name(halves.dtype)} of {halves.dim()} "
           "dimensions")
    _check(low.dtype == torch.int16 and low.shape == halves.shape, op,
           f"low must be an int16 tensor of halves' shape {list(halves.shape)}, got {_scalar_type_name(low.dtype)} "
           f"of shape {list(low.shape)}")
    _check_wire_numel(numel, op)
    pages_needed = wire_num_pages(numel) + 1
    _check(pages.dtype == torch.int32 and pages.dim() == 1 and pages.numel() == pages_needed, op,
           f"pages must be a 1-D int32 tensor of {pages_needed} elements (numel = {numel}), got "
           f"{_scalar_type_name(pages.dtype)} of shape {list(pages.shape)}")
    _check(shift.dtype == torch.int32 and shift.numel() == 1, op,
           f"shift must be an int32 tensor of one element, got {_scalar_type_name(shift.dtype)} with "
           f"{shift.numel()} elements")
    _check_wire_count(count, halves, op, "halves")
    _check_same_device(low, halves, op, "low", "halves")
    _check_same_device(pages, halves, op, "pages", "halves")
    _check_same_device(shift, halves, op, "shift", "halves")


# ---- outputs (what each kernel allocates) ---------------------------------------------------------------------

def _selection_outputs(acc: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (acc.new_empty(capacity), acc.new_empty(capacity, dtype=torch.int32),
            acc.new_empty(1, dtype=torch.int32))


def _stats_output(grad: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(NUM_STATS, dtype=torch.float32)


def _wire_encode_outputs(indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor, numel: int):
    k = values.numel()
    return (values.new_empty(k, dtype=torch.float16), values.new_empty(k, dtype=torch.int16),
            values.new_empty(wire_num_pages(numel) + 1, dtype=torch.int32), values.new_empty(1, dtype=torch.int32))


def _wire_decode_outputs(halves: torch.Tensor, *_):
    k = halves.numel()
    return (halves.new_empty(k, dtype=torch.int32), halves.new_empty(k, dtype=torch.float32),
            halves.new_empty(1, dtype=torch.int32))


def _invalid_count_output(dense: torch.Tensor, *_) -> torch.Tensor:
    return dense.new_empty(1, dtype=torch.int32)


# ---- the table ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpContract:
    """One op: its name in both namespaces, its argument checks and its outputs' shapes (the fake kernel)."""

    name: str
    check: Callable[..., None]
    outputs: Callable[..., object]
    # The tensor whose device decides where the op runs, by position.
    device_arg: int = 0

    def fake(self, *args):
        """The fake kernel: the checks, then outputs of the right dtype and shape on the inputs' device."""
        self.check(*args)
        return self.outputs(*args)

    @property
    def schema(self) -> torch.FunctionSchema:
        """The C++ schema (csrc/ops.cpp), as registered with the dispatcher."""
        return getattr(torch.ops.gtopk_ext, self.name).default._schema

    def schema_string(self) -> str:
        """The C++ schema without the op's name, as ``torch.library.custom_op(schema=...)`` takes it."""
        return str(self.schema).removeprefix(f"gtopk_ext::{self.name}")

    def mutated_args(self) -> set[str]:
        return {a.name for a in self.schema.arguments if a.alias_info is not None and a.alias_info.is_write}


OPS = {op.name: op for op in (
    OpContract("gaussian_threshold", check_gaussian_threshold_args,
               lambda grad, residual, z, k: _stats_output(grad)),
    OpContract("compact", check_compact_args, lambda acc, threshold, capacity: _selection_outputs(acc, capacity)),
    OpContract("gaussian_select", check_gaussian_select_args,
               lambda grad, residual, z, k, capacity: (*_selection_outputs(grad, capacity), _stats_output(grad))),
    OpContract("merge_topk", check_merge_args,
               lambda indices_a, values_a, indices_b, values_b, k: (
                   indices_a.new_empty(k), values_a.new_empty(k), indices_a.new_empty(1)),
               device_arg=1),
    OpContract("scatter_add", check_scatter_add_args, _invalid_count_output),
    OpContract("residual_update", check_residual_update_args, _invalid_count_output),
    OpContract("wire_encode", check_wire_encode_args, _wire_encode_outputs, device_arg=1),
    OpContract("wire_decode", check_wire_decode_args, _wire_decode_outputs),
)}
