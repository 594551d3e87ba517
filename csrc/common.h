// What the CPU and CUDA kernels share: argument checks, the statistics layout and the histogram threshold.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#ifdef __CUDACC__
#define GTOPK_HOST_DEVICE __host__ __device__
#else
#define GTOPK_HOST_DEVICE
#endif

// The dtypes every op accepts: fp32, fp16 and bf16 (statistics and sums are computed in fp32 or wider).
#define GTOPK_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace gtopk_ext {

// Calls f(std::bool_constant<a>{}, std::bool_constant<b>{}): a kernel template instantiated for each pair of
// run-time flags (residual or not, histogram or not), the pair chosen once per call.
template <typename F>
void dispatch_flags(bool a, bool b, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (a) {
    b ? f(Yes{}, Yes{}) : f(Yes{}, No{});
  } else {
    b ? f(No{}, Yes{}) : f(No{}, No{});
  }
}

// Layout of gaussian_threshold's float32 output (mirrored in gtopk_ext/_contract.py, compared by a test).
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

// gaussian_select's second level of counts: the threshold's bin split into 2^13 sub-bins by the next bits of the
// pattern (32 consecutive floats each). Linear interpolation inside a 2.2% bin misses k by far when the bin holds
// many more than k elements (values whose spread is small next to their magnitude, e.g. N(30, 1): 0.5k).
constexpr int kFineShift = 5;
constexpr int kFineBins = 1 << (kHistShift - kFineShift);

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

// scatter_add and residual_update on GPUs sum the duplicates of an index in slot order within tiles of this many
// sorted slots, then the tiles' partial sums in order: deterministic whatever the launch (cuda/scatter.cu).
constexpr int64_t kScatterTile = 256;

// The compact wire (ops wire_encode and wire_decode). An index is stored as its low 16 bits, and a table of
// pages (pages[p] = the number of slots whose index is below p << 16, num_pages + 1 entries) gives the high bits:
// 2 bytes per index plus 4 per 65536 elements of the bucket, at fixed sizes that sender and receiver both know.
// A value is stored in float16 after a multiplication by 2^shift, one shift per message that brings its largest
// finite |value| into [2^14, 2^15): float16's 11 significant bits whatever the gradient's scale, never an overflow.
constexpr int kWirePageShift = 16;
constexpr int kWireShiftMax = 126;   // 2^shift and 2^-shift are normal float32 numbers
constexpr int kWireShiftBase = 141;  // shift = min(kWireShiftMax, kWireShiftBase - biased exponent of max |value|)
constexpr uint16_t kWireHalfNan = 0x7E00;  // every NaN is sent as this float16 pattern, on every backend

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

GTOPK_HOST_DEVICE inline float wire_value(uint16_t half_bits, int32_t shift) {
  return static_cast<float>(c10::Half(half_bits, c10::Half::from_bits())) * wire_pow2(-shift);
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

inline void check_max_numel(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.numel() <= std::numeric_limits<int32_t>::max(), op, ": ", name, " has ", t.numel(),
              " elements, but gtopk_ext uses int32 indices and supports at most 2^31 - 1 elements per tensor; "
              "split it into smaller buckets");
}

inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op,
              ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  check_max_numel(t, op, name);
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device (", ref.device(),
              "), got ", t.device());
}

// The mutated argument of an op must be contiguous: a copy would leave the caller's tensor unchanged.
inline void check_mutable_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is updated in place and must be contiguous");
}

inline void check_gaussian_threshold_args(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                          int64_t k, const char* op = "gaussian_threshold") {
  check_float_tensor(grad, op, "grad");
  TORCH_CHECK(std::isfinite(z), op, ": z must be finite, got ", z);
  TORCH_CHECK(z >= 0.0, op, ": z must be >= 0 (the Gaussian threshold is |mean| + z * std), got ", z);
  TORCH_CHECK(k >= 0, op, ": k must be >= 0 (0: Gaussian threshold only), got ", k);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.scalar_type() == grad.scalar_type(), op, ": residual must have grad's dtype (", grad.scalar_type(),
                "), got ", r.scalar_type());
    TORCH_CHECK(r.sizes() == grad.sizes(), op, ": residual must have grad's shape ", grad.sizes(), ", got ", r.sizes());
    check_same_device(r, grad, op, "residual", "grad");
    check_mutable_contiguous(r, op, "residual");
  }
}

// A number of output slots (named `name`): at least 1, and int32 indices must reach them all.
inline void check_capacity(int64_t capacity, const char* op, const char* name = "capacity") {
  TORCH_CHECK(capacity >= 1, op, ": ", name, " must be >= 1, got ", capacity);
  TORCH_CHECK(capacity <= std::numeric_limits<int32_t>::max(), op, ": ", name, " must be < 2^31, got ", capacity);
}

inline void check_compact_args(const at::Tensor& acc, const at::Tensor& threshold, int64_t capacity) {
  constexpr const char* op = "compact";
  check_float_tensor(acc, op, "acc");
  TORCH_CHECK(threshold.scalar_type() == at::kFloat && threshold.numel() == 1, op,
              ": threshold must be a float32 tensor of one element, got ", threshold.scalar_type(), " with ",
              threshold.numel(), " elements");
  check_same_device(threshold, acc, op, "threshold", "acc");
  check_capacity(capacity, op);
}

inline void check_gaussian_select_args(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                       int64_t k, int64_t capacity) {
  constexpr const char* op = "gaussian_select";
  check_gaussian_threshold_args(grad, residual, z, k, op);
  TORCH_CHECK(k >= 1, op, ": k must be >= 1 (it selects at the histogram threshold), got ", k);
  check_capacity(capacity, op);
}

inline void check_merge_args(const at::Tensor& indices_a, const at::Tensor& values_a, const at::Tensor& indices_b,
                             const at::Tensor& values_b, int64_t k) {
  constexpr const char* op = "merge_topk";
  const at::Tensor* sets[2][2] = {{&indices_a, &values_a}, {&indices_b, &values_b}};
  const char* names[2][2] = {{"indices_a", "values_a"}, {"indices_b", "values_b"}};
  for (int s = 0; s < 2; ++s) {
    const at::Tensor& indices = *sets[s][0];
    const at::Tensor& values = *sets[s][1];
    TORCH_CHECK(indices.scalar_type() == at::kInt && indices.dim() == 1, op, ": ", names[s][0],
                " must be a 1-D int32 tensor, got ", indices.scalar_type(), " of ", indices.dim(), " dimensions");
    check_float_tensor(values, op, names[s][1]);
    TORCH_CHECK(values.sizes() == indices.sizes(), op, ": ", names[s][1], " must have ", names[s][0], "'s shape ",
                indices.sizes(), ", got ", values.sizes());
    check_same_device(indices, values_a, op, names[s][0], "values_a");
    check_same_device(values, values_a, op, names[s][1], "values_a");
  }
  TORCH_CHECK(values_b.scalar_type() == values_a.scalar_type(), op, ": values_b must have values_a's dtype (",
              values_a.scalar_type(), "), got ", values_b.scalar_type());
  check_capacity(k, op, "k");
}

inline void check_scatter_args(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values,
                               const char* op, const char* dense_name) {
  check_float_tensor(dense, op, dense_name);
  check_mutable_contiguous(dense, op, dense_name);
  TORCH_CHECK(indices.scalar_type() == at::kInt, op, ": indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.dim() == 1, op, ": indices must be 1-D, got ", indices.dim(), "-D");
  TORCH_CHECK(values.scalar_type() == dense.scalar_type(), op, ": values must have ", dense_name, "'s dtype (",
              dense.scalar_type(), "), got ", values.scalar_type());
  TORCH_CHECK(values.sizes() == indices.sizes(), op, ": values must have indices' shape ", indices.sizes(), ", got ",
              values.sizes());
  check_same_device(indices, dense, op, "indices", dense_name);
  check_same_device(values, dense, op, "values", dense_name);
}

inline void check_wire_count(const at::Tensor& count, const at::Tensor& ref, const char* op, const char* ref_name) {
  TORCH_CHECK(count.scalar_type() == at::kInt && count.numel() == 1, op,
              ": count must be an int32 tensor of one element, got ", count.scalar_type(), " with ", count.numel(),
              " elements");
  check_same_device(count, ref, op, "count", ref_name);
}

inline void check_wire_numel(int64_t numel, const char* op) {
  TORCH_CHECK(numel >= 1 && numel <= std::numeric_limits<int32_t>::max(), op, ": numel must be in [1, 2^31 - 1], got ",
              numel);
}

inline void check_wire_encode_args(const at::Tensor& indices, const at::Tensor& values, const at::Tensor& count,
                                   int64_t numel) {
  constexpr const char* op = "wire_encode";
  TORCH_CHECK(indices.scalar_type() == at::kInt && indices.dim() == 1, op, ": indices must be a 1-D int32 tensor, got ",
              indices.scalar_type(), " of ", indices.dim(), " dimensions");
  check_float_tensor(values, op, "values");
  TORCH_CHECK(values.sizes() == indices.sizes(), op, ": values must have indices' shape ", indices.sizes(), ", got ",
              values.sizes());
  check_same_device(indices, values, op, "indices", "values");
  check_wire_count(count, values, op, "values");
  check_wire_numel(numel, op);
}

inline void check_wire_decode_args(const at::Tensor& halves, const at::Tensor& low, const at::Tensor& pages,
                                   const at::Tensor& shift, const at::Tensor& count, int64_t numel) {
  constexpr const char* op = "wire_decode";
  TORCH_CHECK(halves.scalar_type() == at::kHalf && halves.dim() == 1, op, ": halves must be a 1-D float16 tensor, got ",
              halves.scalar_type(), " of ", halves.dim(), " dimensions");
  TORCH_CHECK(low.scalar_type() == at::kShort && low.sizes() == halves.sizes(), op,
              ": low must be an int16 tensor of halves' shape ", halves.sizes(), ", got ", low.scalar_type(),
              " of shape ", low.sizes());
  check_wire_numel(numel, op);
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.dim() == 1 && pages.numel() == wire_num_pages(numel) + 1, op,
              ": pages must be a 1-D int32 tensor of ", wire_num_pages(numel) + 1, " elements (numel = ", numel,
              "), got ", pages.scalar_type(), " of shape ", pages.sizes());
  TORCH_CHECK(shift.scalar_type() == at::kInt && shift.numel() == 1, op,
              ": shift must be an int32 tensor of one element, got ", shift.scalar_type(), " with ", shift.numel(),
              " elements");
  check_wire_count(count, halves, op, "halves");
  check_same_device(low, halves, op, "low", "halves");
  check_same_device(pages, halves, op, "pages", "halves");
  check_same_device(shift, halves, op, "shift", "halves");
}

}  // namespace gtopk_ext
