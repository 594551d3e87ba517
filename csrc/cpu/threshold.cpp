// CPU kernel of gaussian_threshold (schema in csrc/ops.cpp): one pass for the moments, max |acc| and the
// histogram threshold; gaussian_select (select.cpp) runs the same pass and keeps its candidates.
#include "selection.h"

namespace gtopk_ext::cpu {
namespace {

// Sums of (acc - shift) and its square, shift being acc[0]: centring on a sample keeps the float lane sums
// accurate when |mean| >> std (equal values give a deviation of exactly 0).
struct ChunkMoments {
  double sum = 0.0;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
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

}  // namespace

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
              grad_ptr, residual_ptr, c * kChunk, std::min(n, (c + 1) * kChunk), histogram, floor_key << kHistShift,
              range_candidates, shift);
          if constexpr (decltype(with_histogram)::value) {
            max_abs = partials[c].max_abs > max_abs ? partials[c].max_abs : max_abs;
            int64_t above = 0;
            floor_key = std::max(floor_key, bin_reaching(histogram, k, hist_key(max_abs), &above));
          }
        }
      });
    };
    dispatch_flags(residual_ptr != nullptr, k > 0, run);
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

namespace {

at::Tensor gaussian_threshold_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                  int64_t k) {
  static const OpChecks<decltype(gaussian_threshold_cpu)> checks("gtopk_ext::gaussian_threshold");
  checks(grad, residual, z, k);
  return statistics_pass(grad.contiguous(), residual, z, k, nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) { m.impl("gaussian_threshold", &gaussian_threshold_cpu); }

}  // namespace gtopk_ext::cpu
