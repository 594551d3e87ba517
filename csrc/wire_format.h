// The compact wire's codec math (ops wire_encode and wire_decode), shared by the CPU and CUDA kernels (host and
// device). An index is stored as its low 16 bits, and a table of pages (pages[p] = the number of slots whose index
// is below p << 16, num_pages + 1 entries) gives the high bits: 2 bytes per index plus 4 per 65536 elements of the
// bucket, at fixed sizes that sender and receiver both know. A value is stored in float16 after a multiplication by
// 2^shift, one shift per message that brings its largest finite |value| into [2^14, 2^15): float16's 11 significant
// bits whatever the gradient's scale, never an overflow.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "layout.h"

namespace gtopk_ext {

GTOPK_HOST_DEVICE inline bool is_infinite(float x) { return (float_bits(x) & 0x7FFFFFFFu) == 0x7F800000u; }

GTOPK_HOST_DEVICE inline int64_t wire_num_pages(int64_t numel) {
  return (numel + (int64_t{1} << kWirePageShift) - 1) >> kWirePageShift;
}

// The shift of a message whose largest finite |value| is max_abs (>= 0).
GTOPK_HOST_DEVICE inline int32_t wire_shift(float max_abs) {
  const int32_t shift = kWireShiftBase - static_cast<int32_t>(float_bits(max_abs) >> 23);
  return shift < kWireShiftMax ? shift : kWireShiftMax;
}

// 2^e for e in [-126, 127], exactly.
GTOPK_HOST_DEVICE inline float wire_pow2(int32_t e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }

// A NaN (any payload: a corrupted message may hold one) decodes to kWireFloatNan: a CPU's product keeps the
// payload, a GPU's gives its own NaN.
GTOPK_HOST_DEVICE inline float wire_value(uint16_t half_bits, int32_t shift) {
  const float half = static_cast<float>(c10::Half(half_bits, c10::Half::from_bits()));
  return half != half ? bits_float(kWireFloatNan) : half * wire_pow2(-shift);
}

// value * 2^shift rounded to float16 (to nearest even); a finite value whose rounding would decode to infinity
// (|value| within 2^-12 of float32's largest) rounds toward zero instead.
GTOPK_HOST_DEVICE inline uint16_t wire_half_bits(float value, int32_t shift) {
  if (value != value) return kWireHalfNan;
  const uint16_t bits = c10::Half(value * wire_pow2(shift)).x;
  const bool overflowed = is_infinite(wire_value(bits, shift)) && !is_infinite(value);
  return overflowed ? static_cast<uint16_t>(bits - 1) : bits;
}

// The page of slot `slot` (pages ascending): the last p in [0, num_pages) with pages[p] <= slot.
GTOPK_HOST_DEVICE inline int64_t wire_page_of(const int32_t* pages, int64_t num_pages, int64_t slot) {
  int64_t lo = 0, hi = num_pages - 1;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (pages[mid] <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The number of slots among the first `used` (ascending) whose index is below `bound`.
GTOPK_HOST_DEVICE inline int32_t wire_lower_bound(const int32_t* indices, int32_t used, int64_t bound) {
  int32_t lo = 0, hi = used;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (indices[mid] < bound)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Whether entry p of a page table is impossible for a message of `used` slots: outside [0, used], below the entry
// before it, or not 0 at p = 0 and not used at p = num_pages.
GTOPK_HOST_DEVICE inline bool wire_page_is_bad(const int32_t* pages, int64_t num_pages, int64_t p, int32_t used) {
  const int32_t entry = pages[p];
  return entry < 0 || entry > used || (p == 0 && entry != 0) || (p == num_pages && entry != used) ||
         (p > 0 && entry < pages[p - 1]);
}

// The index of used slot j, into *index; false when the message is corrupted there: an index >= numel, or a low
// below the one of slot j - 1 in the same page (the indices of a message ascend).
GTOPK_HOST_DEVICE inline bool wire_slot_index(const int32_t* pages, int64_t num_pages, const int16_t* low, int32_t j,
                                              int64_t numel, int32_t* index) {
  const int64_t page = wire_page_of(pages, num_pages, j);
  const uint16_t bits = static_cast<uint16_t>(low[j]);
  const int64_t full = (page << kWirePageShift) | bits;
  if (full >= numel) return false;
  if (j > 0 && wire_page_of(pages, num_pages, j - 1) == page && static_cast<uint16_t>(low[j - 1]) > bits) return false;
  *index = static_cast<int32_t>(full);
  return true;
}

// The slots a message uses: count clamped to [0, k] (count may exceed k: it counts before truncation).
GTOPK_HOST_DEVICE inline int32_t wire_used(int32_t count, int64_t k) {
  return count < 0 ? 0 : (count > k ? static_cast<int32_t>(k) : count);
}

}  // namespace gtopk_ext
