"""The Triton kernels of the compact wire (semantics: csrc/wire_format.h), behind gtopk_ext.triton_kernels.ops."""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import to_float32


@triton.jit
def wire_used(count_ptr, k):
    """The slots a message uses: count clamped to [0, k]."""
    return tl.minimum(tl.maximum(tl.load(count_ptr), 0), k)


@triton.jit
def wire_pow2(e):
    """2^e, exactly, for int32 e in [-126, 127]."""
    return ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def wire_max_kernel(values_ptr, count_ptr, partial_max_ptr, k, BLOCK: tl.constexpr):
    """partial_max[program] = the largest finite |value| among the program's used slots (0 when none)."""
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = slots < wire_used(count_ptr, k)
    magnitude = tl.abs(to_float32(tl.load(values_ptr + slots, mask=live, other=0.0)))
    magnitude = tl.where(live & (magnitude < float("inf")), magnitude, 0.0)  # NaN and inf compare false
    tl.store(partial_max_ptr + tl.program_id(0), tl.max(magnitude, axis=0))


@triton.jit
def wire_encode_kernel(indices_ptr, values_ptr, count_ptr, max_abs_ptr, halves_ptr, low_ptr, shift_ptr, k,
                       SHIFT_MAX: tl.constexpr, SHIFT_BASE: tl.constexpr, HALF_NAN: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Each slot's float16 pattern of value * 2^shift (to nearest even; toward zero where the nearest would
    decode to infinity; NaN as HALF_NAN) and its index's low 16 bits; (0, 0) past the used slots."""
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_k = slots < k
    live = slots < wire_used(count_ptr, k)
    exponent = (tl.load(max_abs_ptr).to(tl.uint32, bitcast=True) >> 23).to(tl.int32)
    shift = tl.minimum(SHIFT_BASE - exponent, SHIFT_MAX)
    value = to_float32(tl.load(values_ptr + slots, mask=live, other=0.0))
    bits = (value * wire_pow2(shift)).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    decoded = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * wire_pow2(-shift)
    overflowed = (tl.abs(decoded) == float("inf")) & (tl.abs(value) != float("inf"))
    bits = tl.where(overflowed, bits - 1, bits)
    bits = tl.where(value != value, HALF_NAN, bits)
    bits = tl.where(live, bits, 0)
    low = tl.where(live, tl.load(indices_ptr + slots, mask=live, other=0) & 0xFFFF, 0)
    tl.store(halves_ptr + slots, bits.to(tl.uint16).to(tl.float16, bitcast=True), mask=in_k)
    tl.store(low_ptr + slots, low.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_k)
    tl.store(shift_ptr, shift, mask=tl.program_id(0) == 0)


@triton.jit
def wire_pages_kernel(indices_ptr, count_ptr, pages_ptr, num_pages, k, PAGE_SHIFT: tl.constexpr,
                      BLOCK: tl.constexpr):
    """pages[p] = how many used slots have an index below p << PAGE_SHIFT (a binary search per page)."""
    pages = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = pages <= num_pages
    bound = pages << PAGE_SHIFT
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + wire_used(count_ptr, k)
    for _ in range(32):  # the range [lo, hi) halves each step: 32 steps cover 2^31 slots
        active = live & (lo < hi)
        mid = lo + (hi - lo) // 2
        right = active & (tl.load(indices_ptr + mid, mask=active, other=0) < bound)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    tl.store(pages_ptr + pages, lo, mask=live)


@triton.jit
def wire_page_of(pages_ptr, num_pages, slots, live):
    """The last page p < num_pages with pages[p] <= slot (a binary search per lane)."""
    lo = tl.zeros(slots.shape, dtype=tl.int32)
    hi = tl.zeros(slots.shape, dtype=tl.int32) + (num_pages - 1)
    for _ in range(32):
        active = live & (lo < hi)
        mid = (lo + hi + 1) // 2
        take = active & (tl.load(pages_ptr + mid, mask=active, other=0) <= slots)
        lo = tl.where(take, mid, lo)
        hi = tl.where(active & ~take, mid - 1, hi)
    return lo


@triton.jit
def wire_check_pages_kernel(pages_ptr, count_ptr, invalid_ptr, num_pages, k, BLOCK: tl.constexpr):
    """Adds to invalid[0] the page-table entries that no encoding makes (csrc/wire_format.h wire_page_is_bad)."""
    pages = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = pages <= num_pages
    used = wire_used(count_ptr, k)
    entry = tl.load(pages_ptr + pages, mask=live, other=0)
    before = tl.load(pages_ptr + pages - 1, mask=live & (pages > 0), other=0)
    bad = live & ((entry < 0) | (entry > used) | ((pages == 0) & (entry != 0)) |
                  ((pages == num_pages) & (entry != used)) | ((pages > 0) & (entry < before)))
    count = tl.sum(bad.to(tl.int32), axis=0)
    tl.atomic_add(invalid_ptr, count, mask=count > 0, sem="relaxed")


@triton.jit
def wire_decode_kernel(halves_ptr, low_ptr, pages_ptr, shift_ptr, count_ptr, indices_ptr, values_ptr, invalid_ptr,
                       num_pages, numel, k, PAGE_SHIFT: tl.constexpr, SHIFT_MAX: tl.constexpr,
                       FLOAT_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """Each used slot's index (page << PAGE_SHIFT | low) and value (half * 2^-shift; a NaN half as the pattern
    FLOAT_NAN, which a GPU's product would not keep); a slot whose index reaches numel or descends within its page,
    and a shift out of range, count into invalid[0]; such slots and the slots past the used ones are (0, 0)."""
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_k = slots < k
    live = slots < wire_used(count_ptr, k)
    shift = tl.load(shift_ptr)
    bad_shift = (shift < -SHIFT_MAX) | (shift > SHIFT_MAX)
    shift = tl.where(bad_shift, 0, shift)
    page = wire_page_of(pages_ptr, num_pages, slots, live)
    previous_page = wire_page_of(pages_ptr, num_pages, slots - 1, live & (slots > 0))
    low = tl.load(low_ptr + slots, mask=live, other=0).to(tl.uint16, bitcast=True).to(tl.int64)
    previous_low = tl.load(low_ptr + slots - 1, mask=live & (slots > 0), other=0).to(tl.uint16, bitcast=True)
    index = (page.to(tl.int64) << PAGE_SHIFT) | low
    descends = (slots > 0) & (previous_page == page) & (previous_low.to(tl.int64) > low)
    bad = live & ((index >= numel) | descends)
    ok = live & ~bad
    half = tl.load(halves_ptr + slots, mask=ok, other=0.0).to(tl.float32)
    tl.store(indices_ptr + slots, tl.where(ok, index, 0).to(tl.int32), mask=in_k)
    nan = tl.full([BLOCK], FLOAT_NAN, tl.uint32).to(tl.float32, bitcast=True)
    value = tl.where(half != half, nan, half * wire_pow2(-shift))
    tl.store(values_ptr + slots, tl.where(ok, value, 0.0), mask=in_k)
    count = tl.sum(bad.to(tl.int32), axis=0) + (bad_shift & (tl.program_id(0) == 0)).to(tl.int32)
    tl.atomic_add(invalid_ptr, count, mask=count > 0, sem="relaxed")
