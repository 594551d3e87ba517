// The CPU kernels' SIMD lanes: fixed-width float vectors whose sums do not depend on the instruction set, and the
// scan that visits the elements at or above a floor. Shared by every CPU kernel file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../dispatch.h"
#include "../histogram.h"

namespace gtopk_ext::cpu {
namespace {

// The hot loops are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time (GCC/Clang ifunc).
#if defined(__x86_64__) && defined(__linux__)
#define GTOPK_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GTOPK_VECTOR_CLONES
#endif

// Statistics are reduced per fixed-size chunk and merged in chunk order, so the result does not depend on the
// number of threads; lanes of vector types (and -ffp-contract=off) fix the order of every addition, so it does
// not depend on the instruction set either. Lane sums are float for speed, flushed to double every kBlock.
constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kBlock = 1024;
constexpr int kLanes = 16;

// kLanes floats (or their bit patterns) as one value: GCC/Clang vector extensions, lowered to AVX-512, AVX2 or
// SSE registers by each clone, where the auto-vectoriser gives up on these loops.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t LaneInts __attribute__((vector_size(kLanes * sizeof(int32_t))));
// Functions taking or returning Lanes must be inlined into each clone: called across clones they would pass
// vectors by one ABI and receive them by another.
#define GTOPK_LANES_INLINE inline __attribute__((always_inline))

template <typename scalar_t>
GTOPK_LANES_INLINE Lanes load_lanes(const scalar_t* p) {
  Lanes v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  }
  return v;
}

template <typename scalar_t>
GTOPK_LANES_INLINE void store_lanes(scalar_t* p, Lanes v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int l = 0; l < kLanes; ++l) p[l] = static_cast<scalar_t>(v[l]);
  }
}

GTOPK_LANES_INLINE Lanes abs_lanes(Lanes v) {
  return reinterpret_cast<Lanes>(reinterpret_cast<LaneInts>(v) & 0x7FFFFFFF);
}

// -1 in the lanes of |x| (abs_values) whose bit pattern is at least floor_bits and at most +inf's (so never NaN),
// else 0. Non-negative floats order like their bits. Sign-bit arithmetic rather than a vector compare, which GCC
// lowers lane by lane in these loops.
GTOPK_LANES_INLINE LaneInts lanes_at_least(Lanes abs_values, int32_t floor_bits) {
  const LaneInts bits = reinterpret_cast<LaneInts>(abs_values);
  return ((floor_bits - 1 - bits) & (bits - 0x7F800001)) >> 31;
}

// The floor_bits of lanes_at_least that selects |x| >= threshold: NaN selects nothing, <= 0 everything.
inline int32_t threshold_floor_bits(float threshold) {
  if (threshold != threshold) return 0x7F800001;
  return threshold > 0.0f ? static_cast<int32_t>(float_bits(threshold)) : 0;
}

// The lanes set in a comparison's mask (0 or -1 per lane) as bits: masked by each lane's bit and OR-folded in
// registers (a loop over the lanes or a memcpy to scalars makes GCC extract every lane).
typedef int32_t LaneInts8 __attribute__((vector_size(8 * sizeof(int32_t))));
typedef int32_t LaneInts4 __attribute__((vector_size(4 * sizeof(int32_t))));
GTOPK_LANES_INLINE uint32_t lane_bits(LaneInts mask) {
  static_assert(kLanes == 16, "lane_bits folds 16 lanes");
  constexpr LaneInts kBit = {1 << 0, 1 << 1, 1 << 2,  1 << 3,  1 << 4,  1 << 5,  1 << 6,  1 << 7,
                             1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15};
  const LaneInts bits = mask & kBit;
  const LaneInts8 b8 = __builtin_shufflevector(bits, bits, 0, 1, 2, 3, 4, 5, 6, 7) |
                       __builtin_shufflevector(bits, bits, 8, 9, 10, 11, 12, 13, 14, 15);
  const LaneInts4 b4 = __builtin_shufflevector(b8, b8, 0, 1, 2, 3) | __builtin_shufflevector(b8, b8, 4, 5, 6, 7);
  return static_cast<uint32_t>(b4[0] | b4[1] | b4[2] | b4[3]);
}

// Calls visit(i, |values[i]|) for every i in [begin, end), ascending, whose |values[i]| has a bit pattern of at
// least floor_bits (and is not NaN). kGroup vectors are tested with one lane_bits fold: most groups hold no such
// element when the floor is high, and skipping them at one branch each keeps the scan at memory speed.
template <typename scalar_t, typename Visit>
GTOPK_LANES_INLINE void for_each_at_least(const scalar_t* __restrict__ values, int64_t begin, int64_t end,
                                          int32_t floor_bits, Visit&& visit) {
  constexpr int kGroup = 8;
  int64_t i = begin;
  for (; i + kGroup * kLanes <= end; i += kGroup * kLanes) {
    Lanes magnitude[kGroup];
    LaneInts passed[kGroup];
    LaneInts any_passed = {};
    for (int g = 0; g < kGroup; ++g) {
      magnitude[g] = abs_lanes(load_lanes(values + i + g * kLanes));
      passed[g] = lanes_at_least(magnitude[g], floor_bits);
      any_passed |= passed[g];
    }
    if (lane_bits(any_passed) == 0) continue;
    for (int g = 0; g < kGroup; ++g) {
      for (uint32_t lanes = lane_bits(passed[g]); lanes != 0; lanes &= lanes - 1) {
        const int lane = __builtin_ctz(lanes);
        visit(i + g * kLanes + lane, magnitude[g][lane]);
      }
    }
  }
  for (; i < end; ++i) {
    const float magnitude = std::fabs(static_cast<float>(values[i]));
    if (static_cast<int32_t>(float_bits(magnitude)) >= floor_bits && !std::isnan(magnitude)) visit(i, magnitude);
  }
}

// acc = residual + grad (rounded to the dtype and stored back into residual when error feedback is on).
template <bool kAccumulate, typename scalar_t>
GTOPK_LANES_INLINE Lanes load_acc(const scalar_t* __restrict__ grad, scalar_t* __restrict__ residual) {
  const Lanes g = load_lanes(grad);
  if constexpr (!kAccumulate) {
    return g;
  } else {
    const Lanes sum = load_lanes(residual) + g;
    store_lanes(residual, sum);
    if constexpr (std::is_same_v<scalar_t, float>) {
      return sum;
    } else {
      return load_lanes(residual);  // rounded to the dtype, as stored
    }
  }
}

}  // namespace
}  // namespace gtopk_ext::cpu
