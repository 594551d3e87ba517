"""The Python side of the op contract that csrc/ops.cpp states: the layout constants of csrc/layout.h, the ops'
schemas, and :func:`check_args` (their Meta kernels' checks), which the Triton ops and the torch merge run first."""

from __future__ import annotations

import functools

import torch

# ---- layout (csrc/layout.h) ------------------------------------------------------------------------------------

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
# exponent of the message's largest finite |value|); every NaN is sent as WIRE_HALF_NAN, and every NaN half (a
# corrupted message may hold any) decodes to the float32 pattern WIRE_FLOAT_NAN.
WIRE_PAGE_SHIFT = 16
WIRE_SHIFT_MAX = 126
WIRE_SHIFT_BASE = 141
WIRE_HALF_NAN = 0x7E00
WIRE_FLOAT_NAN = 0x7FC00000

LAYOUT = {name: value for name, value in globals().items() if name.isupper() and isinstance(value, int)}


def wire_num_pages(numel: int) -> int:
    """The compact wire's pages of 2^WIRE_PAGE_SHIFT elements for a tensor of ``numel`` elements."""
    return (numel + (1 << WIRE_PAGE_SHIFT) - 1) >> WIRE_PAGE_SHIFT


# The one dtype rule: every op takes fp32, fp16 and bf16 (statistics and sums in fp32 or wider), int32 indices.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---- the ops (csrc/ops.cpp), read from the dispatcher --------------------------------------------------------

def op_names() -> list[str]:
    """The names of the ops in namespace gtopk_ext."""
    return sorted(name.removeprefix("gtopk_ext::") for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("gtopk_ext::"))


@functools.cache
def schema(name: str) -> torch.FunctionSchema:
    """The schema of op ``name``, as registered by csrc/ops.cpp."""
    return getattr(torch.ops.gtopk_ext, name).default._schema


def schema_string(name: str) -> str:
    """The schema without the op's name, as ``torch.library.custom_op(schema=...)`` takes it (the Triton ops')."""
    return str(schema(name)).removeprefix(f"gtopk_ext::{name}")


def mutated_args(name: str) -> set[str]:
    return {a.name for a in schema(name).arguments if a.alias_info is not None and a.alias_info.is_write}


_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def check_args(name: str, *args, **kwargs) -> None:
    """Op ``name``'s argument checks, on the arguments of a call (real or fake tensors, any device): its Meta
    kernel called directly, which raises RuntimeError with the message of the C++ kernels."""
    getattr(torch.ops.gtopk_ext, name).default.redispatch(_META, *args, **kwargs)
