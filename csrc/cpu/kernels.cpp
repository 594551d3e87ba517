// CPU kernels of the gtopk_ext ops (schemas in csrc/ops.cpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

GTOPK_LANES_INLINE bool any_lane(LaneInts mask) {
  uint64_t halves[kLanes / 2];
  std::memcpy(halves, &mask, sizeof(halves));
  uint64_t any = 0;
  for (uint64_t h : halves) any |= h;
  return any != 0;
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

// Counts |acc| in the histogram when its key is at least floor_key (and it is not NaN).
inline int histogram_key_if_counted(float abs_acc, int floor_key) {
  const int key = hist_key(abs_acc);
  return key >= floor_key && key <= kHistInfKey ? key : -1;
}

template <typename scalar_t, bool kAccumulate, bool kHistogram>
GTOPK_VECTOR_CLONES ChunkMoments accumulate_chunk(const scalar_t* __restrict__ grad, scalar_t* __restrict__ residual,
                                                  int64_t begin, int64_t end, int32_t* __restrict__ histogram,
                                                  int floor_key, float shift) {
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
      if constexpr (kHistogram) {
        const LaneInts keys = reinterpret_cast<LaneInts>(abs_acc) >> kHistShift;
        const LaneInts counted = (keys >= floor_key) & (keys <= kHistInfKey);  // NaN keys are larger
        if (any_lane(counted)) {
          for (int l = 0; l < kLanes; ++l) {
            if (counted[l]) ++histogram[keys[l]];
          }
        }
      }
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
      if constexpr (kHistogram) {
        const int key = histogram_key_if_counted(abs_acc, floor_key);
        if (key >= 0) ++histogram[key];
      }
    }
    for (int l = 0; l < kLanes; ++l) {
      m.sum += sum[l];
      m.sum_sq += sum_sq[l];
      m.max_abs = max_abs[l] > m.max_abs ? max_abs[l] : m.max_abs;
    }
  }
  return m;
}

at::Tensor gaussian_threshold_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                  int64_t k) {
  check_gaussian_threshold_args(grad, residual, z, k);
  const at::Tensor grad_contig = grad.contiguous();
  const int64_t n = grad.numel();
  const int64_t num_chunks = std::max<int64_t>(1, (n + kChunk - 1) / kChunk);
  std::vector<ChunkMoments> partials(num_chunks);
  const int num_threads = at::get_num_threads();
  std::vector<int32_t> histograms(k > 0 ? static_cast<size_t>(num_threads) * kHistBins : 0, 0);
  float shift = 0.0f;

  GTOPK_DISPATCH_FLOAT_TYPES(grad.scalar_type(), "gaussian_threshold_cpu", [&] {
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
        // Once this thread alone has seen k elements at or above a bin, the global threshold lies in or above
        // that bin, so smaller elements need not be counted: the merged counts stay exact where they are read
        // (see threshold_from_histogram), and most elements skip the scalar histogram update.
        int floor_key = 0;
        float max_abs = 0.0f;
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          partials[c] = accumulate_chunk<scalar_t, decltype(accumulate)::value, decltype(with_histogram)::value>(
              grad_ptr, residual_ptr, c * kChunk, std::min(n, (c + 1) * kChunk), histogram, floor_key, shift);
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

  at::Tensor stats = at::empty({kNumStats}, grad.options().dtype(at::kFloat));
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

// The candidates (|acc| >= thr) of one contiguous range, split into the sure ones (|acc| >= sure_thr) and the
// boundary ones, each list ascending and cut at capacity entries (no range can contribute more).
struct RangeSelection {
  std::vector<int32_t> sure, boundary;
  int64_t sure_count = 0, boundary_count = 0;
};

// Tests kLanes elements at once (vectorised) and looks closer only when one passes.
template <typename scalar_t>
GTOPK_VECTOR_CLONES void select_range(const scalar_t* __restrict__ acc, int64_t begin, int64_t end, float thr,
                                      float sure_thr, int64_t capacity, RangeSelection& out) {
  out.sure.resize(std::min(capacity, end - begin));
  out.boundary.resize(std::min(capacity, end - begin));
  int64_t sure = 0, boundary = 0;
  const auto visit = [&](int64_t i) {
    const float magnitude = std::fabs(static_cast<float>(acc[i]));
    if (magnitude >= sure_thr) {
      if (sure < capacity) out.sure[sure] = static_cast<int32_t>(i);
      ++sure;
    } else if (magnitude >= thr) {
      if (boundary < capacity) out.boundary[boundary] = static_cast<int32_t>(i);
      ++boundary;
    }
  };
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    if (any_lane(abs_lanes(load_lanes(acc + i)) >= thr)) {
      for (int l = 0; l < kLanes; ++l) visit(i + l);
    }
  }
  for (; i < end; ++i) visit(i);
  out.sure_count = sure;
  out.boundary_count = boundary;
}

// One read of acc: each thread selects from one contiguous range, then the ranges' lists are merged in range
// order, so indices come out ascending. When more than capacity pass, the sure ones are kept first (see
// sure_threshold in common.h), then boundary ones in index order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cpu(const at::Tensor& acc, const at::Tensor& threshold,
                                                           int64_t capacity) {
  check_compact_args(acc, threshold, capacity);
  const at::Tensor acc_contig = acc.contiguous();
  const int64_t n = acc.numel();
  const float thr = threshold.item<float>();
  const float sure_thr = sure_threshold(thr);
  at::Tensor values = at::zeros({capacity}, acc.options());
  at::Tensor indices = at::zeros({capacity}, acc.options().dtype(at::kInt));
  at::Tensor count = at::empty({1}, acc.options().dtype(at::kInt));

  const int64_t num_ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kChunk));
  const int64_t range_len = (n + num_ranges - 1) / num_ranges;
  std::vector<RangeSelection> ranges(num_ranges);
  int64_t total = 0;

  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_cpu", [&] {
    const scalar_t* acc_ptr = acc_contig.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_ranges, 1, [&](int64_t range_begin, int64_t range_end) {
      for (int64_t r = range_begin; r < range_end; ++r) {
        select_range(acc_ptr, std::min(n, r * range_len), std::min(n, (r + 1) * range_len), thr, sure_thr,
                     capacity, ranges[r]);
      }
    });

    int64_t sure_total = 0;
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
        values_ptr[out] = acc_ptr[idx];
        ++out;
      }
    }
  });

  count.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(total);
  return {values, indices, count};
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
  m.impl("scatter_add", &scatter_add_cpu);
  m.impl("residual_update", &residual_update_cpu);
}

}  // namespace gtopk_ext
