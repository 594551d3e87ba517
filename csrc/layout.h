// The layouts that every backend, the reference and the Python side share: the statistics tensor, the histogram's
// bins, the scatter tiles and the compact wire's constants, and the float32 bit patterns they are defined on.
// Mirrored in gtopk_ext/_contract.py (gtopk_ext._C exports these values; a test compares them).
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define GTOPK_HOST_DEVICE __host__ __device__
#else
#define GTOPK_HOST_DEVICE
#endif

namespace gtopk_ext {

// gaussian_threshold's float32 output.
constexpr int64_t kStatMean = 0;
constexpr int64_t kStatStd = 1;
constexpr int64_t kStatMaxAbs = 2;
constexpr int64_t kStatGaussianThreshold = 3;
constexpr int64_t kStatThreshold = 4;
constexpr int64_t kNumStats = 5;

// The histogram bins |acc| by the top bits of its float32 pattern: 8 exponent bits and 5 mantissa bits, so a
// bin spans 2^(1/32) (about 2.2%) on a log scale covering every finite float, with no range to guess.
// Non-negative floats order like their bit patterns, so counting bins from the top finds the k-th largest.
constexpr int kHistShift = 18;
constexpr int kHistBins = 1 << (31 - kHistShift);
constexpr int kHistInfKey = 0x7F800000 >> kHistShift;  // +inf's bin; NaNs have larger keys and are skipped

// gaussian_select's second level of counts: the threshold's bin split into 2^13 sub-bins by the next bits of the
// pattern (32 consecutive floats each). Linear interpolation inside a 2.2% bin misses k by far when the bin holds
// many more than k elements (values whose spread is small next to their magnitude, e.g. N(30, 1): 0.5k).
constexpr int kFineShift = 5;
constexpr int kFineBins = 1 << (kHistShift - kFineShift);

// scatter_add and residual_update on GPUs sum the duplicates of an index in slot order within tiles of this many
// sorted slots, then the tiles' partial sums in order: deterministic whatever the launch (cuda/scatter.cu).
constexpr int64_t kScatterTile = 256;

// The compact wire (wire_format.h): pages of 2^16 elements, and the shift that scales a message's values.
constexpr int kWirePageShift = 16;
constexpr int kWireShiftMax = 126;   // 2^shift and 2^-shift are normal float32 numbers
constexpr int kWireShiftBase = 141;  // shift = min(kWireShiftMax, kWireShiftBase - biased exponent of max |value|)
constexpr uint16_t kWireHalfNan = 0x7E00;        // every NaN is sent as this float16 pattern, on every backend
constexpr uint32_t kWireFloatNan = 0x7FC00000u;  // every NaN half decodes to this float32 pattern, on every backend

GTOPK_HOST_DEVICE inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

GTOPK_HOST_DEVICE inline float bits_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

}  // namespace gtopk_ext
