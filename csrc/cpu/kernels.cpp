// CPU kernels of the gtopk_ext ops (schemas in csrc/ops.cpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common.h"

namespace gtopk_ext {
namespace {

// Statistics are reduced per fixed-size chunk and merged in chunk order, so the result does not depend on the
// number of threads. Lanes let the compiler vectorise the double-precision sums.
constexpr int64_t kChunk = 1 << 16;
constexpr int kLanes = 8;

struct ChunkMoments {
  double sum = 0.0;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
};

template <typename scalar_t>
ChunkMoments accumulate_chunk(const scalar_t* grad, scalar_t* residual, int64_t begin, int64_t end,
                              int32_t* histogram) {
  double sum[kLanes] = {};
  double sum_sq[kLanes] = {};
  float max_abs[kLanes] = {};
  int64_t i = begin;
  float acc[kLanes];
  for (; i + kLanes <= end; i += kLanes) {
    if (residual != nullptr) {
      for (int l = 0; l < kLanes; ++l) {
        residual[i + l] = static_cast<scalar_t>(static_cast<float>(residual[i + l]) + static_cast<float>(grad[i + l]));
        acc[l] = static_cast<float>(residual[i + l]);
      }
    } else {
      for (int l = 0; l < kLanes; ++l) acc[l] = static_cast<float>(grad[i + l]);
    }
    for (int l = 0; l < kLanes; ++l) {
      const double a = acc[l];
      sum[l] += a;
      sum_sq[l] += a * a;
      const float abs_a = std::fabs(acc[l]);
      max_abs[l] = abs_a > max_abs[l] ? abs_a : max_abs[l];  // NaN compares false: ignored
    }
    if (histogram != nullptr) {
      for (int l = 0; l < kLanes; ++l) {
        const int key = hist_key(std::fabs(acc[l]));
        if (key <= kHistInfKey) ++histogram[key];
      }
    }
  }
  ChunkMoments m;
  for (; i < end; ++i) {
    if (residual != nullptr) {
      residual[i] = static_cast<scalar_t>(static_cast<float>(residual[i]) + static_cast<float>(grad[i]));
    }
    const float a = static_cast<float>(residual != nullptr ? residual[i] : grad[i]);
    m.sum += a;
    m.sum_sq += static_cast<double>(a) * a;
    const float abs_a = std::fabs(a);
    m.max_abs = abs_a > m.max_abs ? abs_a : m.max_abs;
    if (histogram != nullptr) {
      const int key = hist_key(abs_a);
      if (key <= kHistInfKey) ++histogram[key];
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    m.sum += sum[l];
    m.sum_sq += sum_sq[l];
    m.max_abs = max_abs[l] > m.max_abs ? max_abs[l] : m.max_abs;
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

  GTOPK_DISPATCH_FLOAT_TYPES(grad.scalar_type(), "gaussian_threshold_cpu", [&] {
    const scalar_t* grad_ptr = grad_contig.const_data_ptr<scalar_t>();
    scalar_t* residual_ptr = residual.has_value() ? residual->mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      int32_t* histogram = k > 0 ? histograms.data() + static_cast<size_t>(at::get_thread_num()) * kHistBins : nullptr;
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        partials[c] = accumulate_chunk(grad_ptr, residual_ptr, c * kChunk, std::min(n, (c + 1) * kChunk), histogram);
      }
    });
  });

  double sum = 0.0, sum_sq = 0.0;
  float max_abs = 0.0f;
  for (const ChunkMoments& m : partials) {
    sum += m.sum;
    sum_sq += m.sum_sq;
    max_abs = m.max_abs > max_abs ? m.max_abs : max_abs;
  }
  const double mean = n > 0 ? sum / n : 0.0;
  double variance = n > 0 ? sum_sq / n - mean * mean : 0.0;
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

// Each thread compacts one contiguous range into a buffer of at most `capacity` entries (no range can
// contribute more), then the buffers are concatenated in range order: one read of acc, indices ascending.
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cpu(const at::Tensor& acc, const at::Tensor& threshold,
                                                           int64_t capacity) {
  check_compact_args(acc, threshold, capacity);
  const at::Tensor acc_contig = acc.contiguous();
  const int64_t n = acc.numel();
  const float thr = threshold.item<float>();
  at::Tensor values = at::zeros({capacity}, acc.options());
  at::Tensor indices = at::zeros({capacity}, acc.options().dtype(at::kInt));
  at::Tensor count = at::empty({1}, acc.options().dtype(at::kInt));

  const int64_t num_ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kChunk));
  const int64_t range_len = (n + num_ranges - 1) / num_ranges;
  std::vector<int64_t> found(num_ranges, 0);
  std::vector<std::vector<int32_t>> range_indices(num_ranges);

  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_cpu", [&] {
    const scalar_t* acc_ptr = acc_contig.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_ranges, 1, [&](int64_t range_begin, int64_t range_end) {
      for (int64_t r = range_begin; r < range_end; ++r) {
        const int64_t begin = r * range_len, end = std::min(n, (r + 1) * range_len);
        std::vector<int32_t>& kept = range_indices[r];
        kept.reserve(std::min<int64_t>(capacity, std::max<int64_t>(0, end - begin)));
        int64_t hits = 0;
        int64_t i = begin;
        // Test kLanes elements at once (vectorised) and look closer only when one passes.
        for (; i + kLanes <= end; i += kLanes) {
          bool any = false;
          for (int l = 0; l < kLanes; ++l) any |= std::fabs(static_cast<float>(acc_ptr[i + l])) >= thr;
          if (!any) continue;
          for (int l = 0; l < kLanes; ++l) {
            if (std::fabs(static_cast<float>(acc_ptr[i + l])) >= thr) {
              if (hits < capacity) kept.push_back(static_cast<int32_t>(i + l));
              ++hits;
            }
          }
        }
        for (; i < end; ++i) {
          if (std::fabs(static_cast<float>(acc_ptr[i])) >= thr) {
            if (hits < capacity) kept.push_back(static_cast<int32_t>(i));
            ++hits;
          }
        }
        found[r] = hits;
      }
    });

    scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
    int32_t* indices_ptr = indices.mutable_data_ptr<int32_t>();
    int64_t offset = 0;
    for (int64_t r = 0; r < num_ranges && offset < capacity; ++r) {
      const int64_t take = std::min<int64_t>(range_indices[r].size(), capacity - offset);
      for (int64_t j = 0; j < take; ++j) {
        const int32_t idx = range_indices[r][j];
        indices_ptr[offset + j] = idx;
        values_ptr[offset + j] = acc_ptr[idx];
      }
      offset += take;
    }
  });

  int64_t total = 0;
  for (int64_t h : found) total += h;
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
