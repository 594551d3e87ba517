// The histogram threshold's math, shared by the CPU and CUDA kernels (host and device): the bin of |x|, the bin
// and threshold that keep about k elements, gaussian_select's refinement inside a bin, and compact's sure threshold.
#pragma once

#include <cstdint>

#include "layout.h"

namespace gtopk_ext {

// Histogram key of a = |x| (a >= 0 or NaN); keys above kHistInfKey are NaN.
GTOPK_HOST_DEVICE inline int hist_key(float a) { return static_cast<int>(float_bits(a) >> kHistShift); }

// The bin in which the count from the top (starting at top_bin) reaches k, with the count of the bins above it
// in *above; -1 when all bins hold fewer than k.
GTOPK_HOST_DEVICE inline int bin_reaching(const int32_t* counts, int64_t k, int top_bin, int64_t* above) {
  int64_t total = 0;
  for (int bin = top_bin; bin >= 0; --bin) {
    if (total + counts[bin] >= k) {
      *above = total;
      return bin;
    }
    total += counts[bin];
  }
  *above = total;
  return -1;
}

// The threshold inside `bin` (found by bin_reaching, with `above` elements in the bins over it): interpolate
// linearly to keep k elements. Clamped to max_abs when that bin holds the maximum, so that equal values (all in
// one bin) are selected rather than all missed. 0 (select everything) when bin < 0, i.e. k exceeds the non-NaN
// count. Computed in double on every backend so the backends agree bit for bit.
GTOPK_HOST_DEVICE inline float threshold_in_bin(int bin, int64_t above, int32_t count_in_bin, int64_t k,
                                                float max_abs) {
  if (bin < 0) return 0.0f;
  if (bin == kHistInfKey) return bits_float(0x7F800000u);
  const double lo = bits_float(static_cast<uint32_t>(bin) << kHistShift);
  const double hi = bits_float(static_cast<uint32_t>(bin + 1) << kHistShift);
  const double needed = static_cast<double>(k - above);
  float threshold = static_cast<float>(hi - (hi - lo) * needed / static_cast<double>(count_in_bin));
  if (bin == hist_key(max_abs) && threshold > max_abs) threshold = max_abs;
  return threshold;
}

// The threshold that keeps about k elements, from bin counts: the bin where the count from the top reaches k,
// then threshold_in_bin. Only the counts of that bin and the bins above it are read.
GTOPK_HOST_DEVICE inline float threshold_from_histogram(const int32_t* counts, int64_t k, float max_abs) {
  int64_t above = 0;
  const int bin = bin_reaching(counts, k, kHistInfKey, &above);
  return threshold_in_bin(bin, above, bin < 0 ? 0 : counts[bin], k, max_abs);
}

// The sub-bin of a = |x| inside its histogram bin.
GTOPK_HOST_DEVICE inline int fine_key(float a) {
  return static_cast<int>((float_bits(a) >> kFineShift) & (kFineBins - 1));
}

// Whether gaussian_select refines a threshold: positive and finite (0 keeps everything, +inf only infinities).
GTOPK_HOST_DEVICE inline bool refinable(float threshold) {
  return threshold > 0.0f && hist_key(threshold) < kHistInfKey;
}

// The refined threshold: the lower edge of sub-bin `sub_bin` of `bin`, where sub_bin is the highest one at which
// the count from the top (the elements above the bin included) reaches k, kFineBins (the bin's upper edge) when
// the elements above the bin alone reach it, 0 when even the whole bin falls short.
GTOPK_HOST_DEVICE inline float fine_threshold(int bin, int sub_bin) {
  return bits_float((static_cast<uint32_t>(bin) << kHistShift) + (static_cast<uint32_t>(sub_bin) << kFineShift));
}

// sub_bin of fine_threshold from the sub-bin counts of the bin and the count of the elements above it.
inline int sub_bin_reaching(const int32_t* fine_counts, int64_t above, int64_t k) {
  if (above >= k) return kFineBins;
  int64_t total = above;
  for (int sub_bin = kFineBins - 1; sub_bin > 0; --sub_bin) {
    total += fine_counts[sub_bin];
    if (total >= k) return sub_bin;
  }
  return 0;
}

// When more elements pass a threshold than a message has slots, the "sure" ones, at or above the upper edge of
// the threshold's histogram bin, are kept first, and the rest of the slots go to the others in index order: so
// an overflow drops only elements within one bin (2.2%) of the threshold, never a large one at a high index.
GTOPK_HOST_DEVICE inline float sure_threshold(float threshold) {
  const int key = hist_key(threshold);                               // threshold >= 0
  if (!(threshold >= 0.0f) || key >= kHistInfKey) return threshold;  // NaN, +inf
  return bits_float(static_cast<uint32_t>(key + 1) << kHistShift);
}

}  // namespace gtopk_ext
