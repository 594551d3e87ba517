// CPU kernels of the gtopk_ext ops (schemas in csrc/ops.cpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../common.h"

namespace gtopk_ext {
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

GTOPK_LANES_INLINE Lanes abs_lanes(Lanes v) { return reinterpret_cast<Lanes>(reinterpret_cast<LaneInts>(v) & 0x7FFFFFFF); }

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

// Sums of (acc - shift) and its square, shift being acc[0]: centring on a sample keeps the float lane sums
// accurate when |mean| >> std (equal values give a deviation of exactly 0).
struct ChunkMoments {
  double sum = 0.0;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
};

// An element whose |acc| passed its range's histogram floor: a candidate for the selection.
struct Candidate {
  int32_t index;
  float magnitude;
};

// The candidates of one parallel_for range [begin, end) of the statistics pass, ascending: every element whose
// |acc| was at or above the range's histogram floor when it was read. The floor only rises and never exceeds the
// final threshold (a range's own k largest lie at or below the k-th largest overall), so they include every
// element that the threshold selects. Past max_size the list is dropped (complete = false): reading acc again
// then costs less than the list.
struct RangeCandidates {
  int64_t begin = 0, end = 0, max_size = 0;
  bool complete = true;
  std::vector<Candidate> list;

  // Starts recording [begin, end) when the candidates of a range of independent values would fit in a sixteenth
  // of it: the floor, the k-th largest of the m elements read so far, passes about k / m of them, so about
  // k * (1 + ln(size / k)) elements plus the first chunk. Otherwise the list would cost as much as a second read.
  void start(int64_t range_begin, int64_t range_end, int64_t k) {
    begin = range_begin;
    end = range_end;
    const int64_t size = end - begin;
    max_size = size / 16;
    const double expected = kChunk + (k < size ? k * (1.0 + std::log(static_cast<double>(size) / k)) : size);
    complete = expected <= max_size;
    if (complete) list.reserve(static_cast<size_t>(expected));
  }

  void add(int64_t index, float magnitude) {
    if (!complete) return;
    if (static_cast<int64_t>(list.size()) == max_size) {
      complete = false;
      list = {};
      return;
    }
    list.push_back({static_cast<int32_t>(index), magnitude});
  }
};

template <typename scalar_t, bool kAccumulate, bool kHistogram>
GTOPK_VECTOR_CLONES ChunkMoments accumulate_chunk(const scalar_t* __restrict__ grad, scalar_t* __restrict__ residual,
                                                  int64_t begin, int64_t end, int32_t* __restrict__ histogram,
                                                  int32_t floor_bits, RangeCandidates* candidates, float shift) {
  ChunkMoments m;
  for (int64_t block = begin; block < end; block += kBlock) {
    const int64_t block_end = std::min(end, block + kBlock);
    Lanes sum = {}, sum_sq = {}, max_abs = {};
    int64_t i = block;
    for (; i + kLanes <= block_end; i += kLanes) {
      const Lanes acc = load_acc<kAccumulate>(grad + i, residual + i);
      const Lanes centred = acc - shift;
      sum += centred;
      sum_sq += centred * centred;
      const Lanes abs_acc = abs_lanes(acc);
      max_abs = abs_acc > max_abs ? abs_acc : max_abs;  // NaN compares false: ignored
    }
    for (; i < block_end; ++i) {  // the tail, in lane 0
      float acc = static_cast<float>(grad[i]);
      if constexpr (kAccumulate) {
        residual[i] = static_cast<scalar_t>(static_cast<float>(residual[i]) + acc);
        acc = static_cast<float>(residual[i]);
      }
      const float centred = acc - shift;
      sum[0] += centred;
      sum_sq[0] += centred * centred;
      const float abs_acc = std::fabs(acc);
      max_abs[0] = abs_acc > max_abs[0] ? abs_acc : max_abs[0];
    }
    if constexpr (kHistogram) {  // a second look at the block while it is in L1: acc as stored
      for_each_at_least(kAccumulate ? residual : grad, block, block_end, floor_bits, [&](int64_t i, float magnitude) {
        ++histogram[hist_key(magnitude)];
        if (candidates != nullptr) candidates->add(i, magnitude);
      });
    }
    for (int l = 0; l < kLanes; ++l) {
      m.sum += sum[l];
      m.sum_sq += sum_sq[l];
      m.max_abs = max_abs[l] > m.max_abs ? max_abs[l] : m.max_abs;
    }
  }
  return m;
}

// The pass of gaussian_threshold (see csrc/ops.cpp) over grad_contig (+ residual): returns its float32 stats.
// With candidates (and k > 0) it also records each parallel range's candidates, in range order.
at::Tensor statistics_pass(const at::Tensor& grad_contig, const std::optional<at::Tensor>& residual, double z,
                           int64_t k, std::vector<RangeCandidates>* candidates) {
  const int64_t n = grad_contig.numel();
  const int64_t num_chunks = std::max<int64_t>(1, (n + kChunk - 1) / kChunk);
  std::vector<ChunkMoments> partials(num_chunks);
  const int num_threads = at::get_num_threads();
  std::vector<int32_t> histograms(k > 0 ? static_cast<size_t>(num_threads) * kHistBins : 0, 0);
  // Indexed by each parallel range's first chunk, so that reading them in chunk order gives index order.
  std::vector<RangeCandidates> by_first_chunk(candidates != nullptr && k > 0 ? num_chunks : 0);
  float shift = 0.0f;

  GTOPK_DISPATCH_FLOAT_TYPES(grad_contig.scalar_type(), "gaussian_threshold_cpu", [&] {
    const scalar_t* grad_ptr = grad_contig.const_data_ptr<scalar_t>();
    scalar_t* residual_ptr = residual.has_value() ? residual->mutable_data_ptr<scalar_t>() : nullptr;
    if (n > 0) {  // acc[0], as the pass will compute it
      shift = static_cast<float>(grad_ptr[0]);
      if (residual_ptr != nullptr) {
        shift = static_cast<float>(static_cast<scalar_t>(static_cast<float>(residual_ptr[0]) + shift));
      }
    }
    const auto run = [&](auto accumulate, auto with_histogram) {
      at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
        int32_t* histogram = with_histogram ? histograms.data() + size_t(at::get_thread_num()) * kHistBins : nullptr;
        RangeCandidates* range_candidates = nullptr;
        if (!by_first_chunk.empty()) {
          range_candidates = &by_first_chunk[chunk_begin];
          range_candidates->start(chunk_begin * kChunk, std::min(n, chunk_end * kChunk), k);
        }
        // Once this range alone has seen k elements at or above a bin, the global threshold lies in or above
        // that bin, so smaller elements need not be counted: the merged counts stay exact where they are read
        // (see threshold_from_histogram), and most elements skip the scalar histogram update.
        int floor_key = 0;
        float max_abs = 0.0f;
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          partials[c] = accumulate_chunk<scalar_t, decltype(accumulate)::value, decltype(with_histogram)::value>(
              grad_ptr, residual_ptr, c * kChunk, std::min(n, (c + 1) * kChunk), histogram,
              floor_key << kHistShift, range_candidates, shift);
          if constexpr (decltype(with_histogram)::value) {
            max_abs = partials[c].max_abs > max_abs ? partials[c].max_abs : max_abs;
            int64_t above = 0;
            floor_key = std::max(floor_key, bin_reaching(histogram, k, hist_key(max_abs), &above));
          }
        }
      });
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (residual_ptr != nullptr) {
      k > 0 ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    } else {
      k > 0 ? run(No{}, Yes{}) : run(No{}, No{});
    }
  });
  if (!by_first_chunk.empty()) {
    for (RangeCandidates& range : by_first_chunk) {
      if (range.end > range.begin) candidates->push_back(std::move(range));
    }
  }

  double sum = 0.0, sum_sq = 0.0;
  float max_abs = 0.0f;
  for (const ChunkMoments& m : partials) {
    sum += m.sum;
    sum_sq += m.sum_sq;
    max_abs = m.max_abs > max_abs ? m.max_abs : max_abs;
  }
  const double centred_mean = n > 0 ? sum / n : 0.0;
  const double mean = shift + centred_mean;
  double variance = n > 0 ? sum_sq / n - centred_mean * centred_mean : 0.0;
  if (variance < 0.0) variance = 0.0;  // rounding; a NaN stays NaN so non-finite input shows
  const double std_dev = std::sqrt(variance);
  const float gaussian = static_cast<float>(std::fabs(mean) + z * std_dev);

  at::Tensor stats = at::empty({kNumStats}, grad_contig.options().dtype(at::kFloat));
  float* out = stats.mutable_data_ptr<float>();
  out[kStatMean] = static_cast<float>(mean);
  out[kStatStd] = static_cast<float>(std_dev);
  out[kStatMaxAbs] = max_abs;
  out[kStatGaussianThreshold] = gaussian;
  if (k > 0) {
    for (int t = 1; t < num_threads; ++t) {
      const int32_t* src = histograms.data() + static_cast<size_t>(t) * kHistBins;
      for (int b = 0; b < kHistBins; ++b) histograms[b] += src[b];
    }
    out[kStatThreshold] = threshold_from_histogram(histograms.data(), k, max_abs);
  } else {
    out[kStatThreshold] = gaussian;
  }
  return stats;
}

at::Tensor gaussian_threshold_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                  int64_t k) {
  check_gaussian_threshold_args(grad, residual, z, k);
  return statistics_pass(grad.contiguous(), residual, z, k, nullptr);
}

// The elements with |acc| >= thr of one contiguous range, split into the sure ones (|acc| >= sure_thr) and the
// boundary ones, each list ascending and cut at capacity entries (no range can contribute more).
struct RangeSelection {
  std::vector<int32_t> sure, boundary;
  int64_t sure_count = 0, boundary_count = 0;

  void add(int64_t index, bool is_sure, int64_t capacity) {
    std::vector<int32_t>& list = is_sure ? sure : boundary;
    int64_t& count = is_sure ? sure_count : boundary_count;
    if (count < capacity) list.push_back(static_cast<int32_t>(index));
    ++count;
  }
};

template <typename scalar_t>
GTOPK_VECTOR_CLONES void select_range(const scalar_t* __restrict__ acc, int64_t begin, int64_t end, float thr,
                                      float sure_thr, int64_t capacity, RangeSelection& out) {
  out.sure.reserve(std::min(capacity, end - begin));
  out.boundary.reserve(std::min(capacity, end - begin));
  for_each_at_least(acc, begin, end, threshold_floor_bits(thr), [&](int64_t i, float magnitude) {
    out.add(i, magnitude >= sure_thr, capacity);
  });
}

// select_range from the statistics pass's candidates of the range, or from acc when they are incomplete.
template <typename scalar_t>
void select_candidates(const RangeCandidates& candidates, const scalar_t* acc, float thr, float sure_thr,
                       int64_t capacity, RangeSelection& out) {
  if (!candidates.complete) {
    select_range(acc, candidates.begin, candidates.end, thr, sure_thr, capacity, out);
    return;
  }
  for (const Candidate& c : candidates.list) {
    if (c.magnitude >= thr) out.add(c.index, c.magnitude >= sure_thr, capacity);
  }
}

// Writes the ranges' selections (in index order) into values and indices, zero-filled with capacity slots: when
// more than capacity were selected, the sure ones first (see sure_threshold in common.h), then boundary ones in
// index order. Returns how many were selected before that cut.
template <typename scalar_t>
int64_t write_selection(const std::vector<RangeSelection>& ranges, const scalar_t* acc, int64_t capacity,
                        at::Tensor& values, at::Tensor& indices) {
  int64_t sure_total = 0, total = 0;
  for (const RangeSelection& range : ranges) {
    sure_total += range.sure_count;
    total += range.sure_count + range.boundary_count;
  }
  int64_t sure_left = std::min(sure_total, capacity);  // slots for sure candidates, then boundary ones
  int64_t boundary_left = capacity - sure_left;
  scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
  int32_t* indices_ptr = indices.mutable_data_ptr<int32_t>();
  int64_t out = 0;
  for (const RangeSelection& range : ranges) {
    const int64_t sure = std::min(range.sure_count, sure_left);
    const int64_t boundary = std::min(range.boundary_count, boundary_left);
    sure_left -= sure;
    boundary_left -= boundary;
    int64_t a = 0, b = 0;  // merge the two ascending lists
    while (a < sure || b < boundary) {
      const bool take_sure = b == boundary || (a < sure && range.sure[a] < range.boundary[b]);
      const int32_t idx = take_sure ? range.sure[a++] : range.boundary[b++];
      indices_ptr[out] = idx;
      values_ptr[out] = acc[idx];
      ++out;
    }
  }
  return total;
}

// The outputs of a selection from acc: values and indices of capacity padding slots (value 0, index 0), count.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_selection(const at::Tensor& acc, int64_t capacity) {
  return {at::zeros({capacity}, acc.options()), at::zeros({capacity}, acc.options().dtype(at::kInt)),
          at::empty({1}, acc.options().dtype(at::kInt))};
}

// One read of acc: each thread selects from one contiguous range, then the ranges' lists are merged in range
// order, so indices come out ascending.
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cpu(const at::Tensor& acc, const at::Tensor& threshold,
                                                           int64_t capacity) {
  check_compact_args(acc, threshold, capacity);
  const at::Tensor acc_contig = acc.contiguous();
  const int64_t n = acc.numel();
  const float thr = threshold.item<float>();
  const float sure_thr = sure_threshold(thr);
  at::Tensor values, indices, count;
  std::tie(values, indices, count) = empty_selection(acc, capacity);
  const int64_t num_ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kChunk));
  const int64_t range_len = (n + num_ranges - 1) / num_ranges;
  std::vector<RangeSelection> ranges(num_ranges);
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_cpu", [&] {
    const scalar_t* acc_ptr = acc_contig.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_ranges, 1, [&](int64_t range_begin, int64_t range_end) {
      for (int64_t r = range_begin; r < range_end; ++r) {
        select_range(acc_ptr, std::min(n, r * range_len), std::min(n, (r + 1) * range_len), thr, sure_thr,
                     capacity, ranges[r]);
      }
    });
    const int64_t selected = write_selection(ranges, acc_ptr, capacity, values, indices);
    count.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(selected);
  });
  return {values, indices, count};
}

// The counts of fine_threshold (common.h) for `bin`: the elements above it, and those in it by sub-bin.
struct FineCounts {
  int64_t above = 0;
  std::vector<int32_t> counts = std::vector<int32_t>(kFineBins, 0);

  void add(float magnitude, int bin) {
    const int key = hist_key(magnitude);
    if (key > bin) {
      ++above;
    } else if (key == bin) {
      ++counts[fine_key(magnitude)];
    }
  }
};

template <typename scalar_t>
GTOPK_VECTOR_CLONES void count_fine_range(const scalar_t* __restrict__ acc, int64_t begin, int64_t end, int bin,
                                          FineCounts& out) {
  for_each_at_least(acc, begin, end, bin << kHistShift, [&](int64_t, float magnitude) { out.add(magnitude, bin); });
}

// gaussian_select's refined threshold (see csrc/ops.cpp) from the sub-bin counts of thr's bin, taken from each
// range's candidates (they hold every element of that bin and above) or, where those overflowed, from acc.
template <typename scalar_t>
float refine_threshold(float thr, int64_t k, const std::vector<RangeCandidates>& candidates, const scalar_t* acc) {
  if (!refinable(thr)) return thr;
  const int bin = hist_key(thr);
  std::vector<FineCounts> per_range(candidates.size());
  at::parallel_for(0, static_cast<int64_t>(candidates.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RangeCandidates& range = candidates[r];
      if (!range.complete) {
        count_fine_range(acc, range.begin, range.end, bin, per_range[r]);
        continue;
      }
      for (const Candidate& c : range.list) per_range[r].add(c.magnitude, bin);
    }
  });
  FineCounts total;
  for (const FineCounts& range : per_range) {
    total.above += range.above;
    for (int s = 0; s < kFineBins; ++s) total.counts[s] += range.counts[s];
  }
  return fine_threshold(bin, sub_bin_reaching(total.counts.data(), total.above, k));
}

// gaussian_threshold, its threshold refined, then compact at it, without a second read of acc while the
// candidates that the statistics pass recorded suffice (a range whose candidates overflowed reads acc again).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gaussian_select_cpu(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity) {
  check_gaussian_select_args(grad, residual, z, k, capacity);
  const at::Tensor grad_contig = grad.contiguous();
  std::vector<RangeCandidates> candidates;
  at::Tensor stats = statistics_pass(grad_contig, residual, z, k, &candidates);
  const at::Tensor& acc = residual.has_value() ? *residual : grad_contig;
  at::Tensor values, indices, count;
  std::tie(values, indices, count) = empty_selection(acc, capacity);
  std::vector<RangeSelection> ranges(candidates.size());
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "gaussian_select_cpu", [&] {
    const scalar_t* acc_ptr = acc.const_data_ptr<scalar_t>();
    float& thr = stats.mutable_data_ptr<float>()[kStatThreshold];
    thr = refine_threshold(thr, k, candidates, acc_ptr);
    const float sure_thr = sure_threshold(thr);
    at::parallel_for(0, static_cast<int64_t>(candidates.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        select_candidates(candidates[r], acc_ptr, thr, sure_thr, capacity, ranges[r]);
      }
    });
    const int64_t selected = write_selection(ranges, acc_ptr, capacity, values, indices);
    count.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(selected);
  });
  return {values, indices, count, stats};
}

// ---- gTop-k merge ----------------------------------------------------------------------------------------------

// The union of two sets of slots, ascending by index, with each index's float32 sum: `size` entries of arrays
// sized for the largest union.
struct Union {
  std::vector<int32_t> indices;
  std::vector<float> sums;
  int64_t size = 0;

  explicit Union(int64_t capacity) : indices(capacity), sums(capacity) {}

  void add(int32_t index, float sum) {
    indices[size] = index;
    sums[size] = sum;
    ++size;
  }
};

// The length of the strictly ascending prefix of non-negative indices when every later slot is padding (index 0),
// as compact and merge_topk write them; -1 for any other layout.
int64_t padded_ascending_prefix(const int32_t* indices, int64_t n) {
  if (n > 0 && indices[0] < 0) return -1;
  int64_t prefix = 0;
  while (prefix < n && (prefix == 0 || indices[prefix] > indices[prefix - 1])) ++prefix;
  for (int64_t j = prefix; j < n; ++j) {
    if (indices[j] != 0) return -1;
  }
  return prefix;
}

// Messages as they come: a linear merge of the two ascending prefixes. Index 0 (a prefix's first slot, and every
// padding slot) is summed first, in slot order.
template <typename scalar_t>
void merge_padded(const int32_t* ia, const scalar_t* va, int64_t na, int64_t pa, const int32_t* ib,
                  const scalar_t* vb, int64_t nb, int64_t pb, Union& out) {
  bool has_zero = false;
  float zero_sum = 0.0f;
  const auto add_zeros = [&](const int32_t* indices, const scalar_t* values, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      if (indices[j] == 0) {
        has_zero = true;
        zero_sum += static_cast<float>(values[j]);
      }
    }
  };
  add_zeros(ia, va, na);
  add_zeros(ib, vb, nb);
  if (has_zero) out.add(0, zero_sum);
  int64_t a = pa > 0 && ia[0] == 0 ? 1 : 0;
  int64_t b = pb > 0 && ib[0] == 0 ? 1 : 0;
  while (a < pa || b < pb) {
    const bool take_a = b == pb || (a < pa && ia[a] <= ib[b]);
    const bool take_b = a == pa || (b < pb && ib[b] <= ia[a]);
    float sum = 0.0f;
    if (take_a) sum += static_cast<float>(va[a]);
    if (take_b) sum += static_cast<float>(vb[b]);
    out.add(take_a ? ia[a] : ib[b], sum);
    a += take_a;
    b += take_b;
  }
}

// Any other slots: a stable sort of all of them by index keeps the slot order within an index.
template <typename scalar_t>
void merge_sorted(const int32_t* ia, const scalar_t* va, int64_t na, const int32_t* ib, const scalar_t* vb,
                  int64_t nb, Union& out) {
  const auto index_of = [&](int64_t slot) { return slot < na ? ia[slot] : ib[slot - na]; };
  const auto value_of = [&](int64_t slot) { return static_cast<float>(slot < na ? va[slot] : vb[slot - na]); };
  std::vector<int64_t> slots(na + nb);
  std::iota(slots.begin(), slots.end(), 0);
  std::stable_sort(slots.begin(), slots.end(), [&](int64_t x, int64_t y) { return index_of(x) < index_of(y); });
  for (size_t j = 0; j < slots.size(); ++j) {
    if (j == 0 || index_of(slots[j]) != index_of(slots[j - 1])) out.add(index_of(slots[j]), 0.0f);
    out.sums[out.size - 1] += value_of(slots[j]);
  }
}

// A key per union entry that orders them best first: NaN sums (alike), then larger |sums|, then lower indices.
inline uint64_t merge_rank_key(float sum, int32_t index) {
  const uint32_t magnitude = std::isnan(sum) ? 0x7FFFFFFFu : float_bits(sum) & 0x7FFFFFFFu;
  return (static_cast<uint64_t>(0x7FFFFFFFu - magnitude) << 32) | (static_cast<uint32_t>(index) ^ 0x80000000u);
}

// The histogram bin of a union entry's sum (common.h), NaN in the top bin: higher bins rank better.
inline int merge_rank_bin(float sum) { return std::isnan(sum) ? kHistBins - 1 : hist_key(std::fabs(sum)); }

// Whether each union entry is among the k best (merge_rank_key order), for a union of more than k entries. As for
// the threshold, a histogram finds the bin of the k-th best; only that bin's entries are ranked one by one.
std::vector<uint8_t> best_k(const Union& merged, int64_t k) {
  const int64_t size = merged.size;
  std::vector<int32_t> counts(kHistBins, 0);
  std::vector<int> bins(size);
  for (int64_t j = 0; j < size; ++j) ++counts[bins[j] = merge_rank_bin(merged.sums[j])];
  int64_t above = 0;
  const int bin = bin_reaching(counts.data(), k, kHistBins - 1, &above);
  std::vector<uint64_t> in_bin;
  in_bin.reserve(counts[bin]);
  for (int64_t j = 0; j < size; ++j) {
    if (bins[j] == bin) in_bin.push_back(merge_rank_key(merged.sums[j], merged.indices[j]));
  }
  const int64_t rank_in_bin = k - above - 1;
  std::nth_element(in_bin.begin(), in_bin.begin() + rank_in_bin, in_bin.end());
  const uint64_t kth = in_bin[rank_in_bin];
  std::vector<uint8_t> kept(size);
  for (int64_t j = 0; j < size; ++j) {
    kept[j] = bins[j] > bin || (bins[j] == bin && merge_rank_key(merged.sums[j], merged.indices[j]) <= kth);
  }
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_topk_cpu(const at::Tensor& indices_a, const at::Tensor& values_a,
                                                              const at::Tensor& indices_b, const at::Tensor& values_b,
                                                              int64_t k) {
  check_merge_args(indices_a, values_a, indices_b, values_b, k);
  const at::Tensor ia = indices_a.contiguous(), ib = indices_b.contiguous();
  const at::Tensor va = values_a.contiguous(), vb = values_b.contiguous();
  at::Tensor indices = at::zeros({k}, ia.options());
  at::Tensor values = at::zeros({k}, va.options());
  at::Tensor union_size = at::empty({1}, ia.options());
  Union merged(ia.numel() + ib.numel());
  GTOPK_DISPATCH_FLOAT_TYPES(va.scalar_type(), "merge_topk_cpu", [&] {
    const int32_t* ia_ptr = ia.const_data_ptr<int32_t>();
    const int32_t* ib_ptr = ib.const_data_ptr<int32_t>();
    const scalar_t* va_ptr = va.const_data_ptr<scalar_t>();
    const scalar_t* vb_ptr = vb.const_data_ptr<scalar_t>();
    const int64_t pa = padded_ascending_prefix(ia_ptr, ia.numel());
    const int64_t pb = padded_ascending_prefix(ib_ptr, ib.numel());
    if (pa >= 0 && pb >= 0) {
      merge_padded(ia_ptr, va_ptr, ia.numel(), pa, ib_ptr, vb_ptr, ib.numel(), pb, merged);
    } else {
      merge_sorted(ia_ptr, va_ptr, ia.numel(), ib_ptr, vb_ptr, ib.numel(), merged);
    }
    const int64_t size = merged.size;
    const std::vector<uint8_t> kept = size > k ? best_k(merged, k) : std::vector<uint8_t>(size, 1);
    int32_t* out_indices = indices.mutable_data_ptr<int32_t>();
    scalar_t* out_values = values.mutable_data_ptr<scalar_t>();
    int64_t out = 0;
    for (int64_t j = 0; j < size; ++j) {  // in the union's ascending order
      if (!kept[j]) continue;
      out_indices[out] = merged.indices[j];
      out_values[out] = static_cast<scalar_t>(merged.sums[j]);
      ++out;
    }
    union_size.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(size);
  });
  return {indices, values, union_size};
}

// dense[indices[j]] += sign * values[j], skipping (and counting) indices outside [0, numel).
at::Tensor signed_scatter_cpu(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values,
                              float sign, const char* op, const char* dense_name) {
  check_scatter_args(dense, indices, values, op, dense_name);
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t n = dense.numel();
  const int64_t m = indices.numel();
  int32_t invalid = 0;
  GTOPK_DISPATCH_FLOAT_TYPES(dense.scalar_type(), "signed_scatter_cpu", [&] {
    scalar_t* dense_ptr = dense.mutable_data_ptr<scalar_t>();
    const int32_t* idx_ptr = indices_contig.const_data_ptr<int32_t>();
    const scalar_t* val_ptr = values_contig.const_data_ptr<scalar_t>();
    for (int64_t j = 0; j < m; ++j) {
      const int32_t idx = idx_ptr[j];
      if (idx < 0 || idx >= n) {
        ++invalid;
        continue;
      }
      dense_ptr[idx] = static_cast<scalar_t>(static_cast<float>(dense_ptr[idx]) + sign * static_cast<float>(val_ptr[j]));
    }
  });
  at::Tensor invalid_count = at::empty({1}, dense.options().dtype(at::kInt));
  invalid_count.mutable_data_ptr<int32_t>()[0] = invalid;
  return invalid_count;
}

at::Tensor scatter_add_cpu(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_cpu(dense, indices, values, 1.0f, "scatter_add", "dense");
}

at::Tensor residual_update_cpu(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_cpu(residual, indices, values, -1.0f, "residual_update", "residual");
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) {
  m.impl("gaussian_threshold", &gaussian_threshold_cpu);
  m.impl("compact", &compact_cpu);
  m.impl("gaussian_select", &gaussian_select_cpu);
  m.impl("merge_topk", &merge_topk_cpu);
  m.impl("scatter_add", &scatter_add_cpu);
  m.impl("residual_update", &residual_update_cpu);
}

}  // namespace gtopk_ext
