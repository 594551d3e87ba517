// CUDA kernels of gaussian_threshold (schema in csrc/ops.cpp), with the semantics of csrc/cpu/threshold.cpp and
// gtopk_ext/reference.py. No kernel synchronises with the host: the statistics are written on the device, so the
// op can be captured in a CUDA graph and overlaps the host's work.
#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

// Count, mean and sum of squared deviations (merged with Chan et al.'s formula, exact for equal values: their
// deviations are 0) and the largest |acc| (NaN ignored).
struct Moments {
  double count;
  double mean;
  double m2;
  float max_abs;
};

__device__ __forceinline__ Moments merge(const Moments& a, const Moments& b) {
  const float max_abs = b.max_abs > a.max_abs ? b.max_abs : a.max_abs;
  if (b.count == 0.0) return {a.count, a.mean, a.m2, max_abs};
  if (a.count == 0.0) return {b.count, b.mean, b.m2, max_abs};
  const double count = a.count + b.count;
  const double delta = b.mean - a.mean;
  const double weight_b = b.count / count;
  return {count, a.mean + delta * weight_b, a.m2 + b.m2 + delta * delta * a.count * weight_b, max_abs};
}

__device__ __forceinline__ Moments shuffle_down(const Moments& m, int offset) {
  return {__shfl_down_sync(kFullMask, m.count, offset), __shfl_down_sync(kFullMask, m.mean, offset),
          __shfl_down_sync(kFullMask, m.m2, offset), __shfl_down_sync(kFullMask, m.max_abs, offset)};
}

__device__ __forceinline__ Moments warp_merge(Moments m) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) m = merge(m, shuffle_down(m, offset));
  return m;
}

// The block's merged moments, valid in thread 0. A fixed merge tree: results do not vary from run to run.
__device__ Moments block_merge(Moments m) {
  __shared__ Moments per_warp[kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  m = warp_merge(m);
  if (lane == 0) per_warp[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < static_cast<int>(blockDim.x / kWarpSize) ? per_warp[lane] : Moments{0.0, 0.0, 0.0, 0.0f};
    m = warp_merge(m);
  }
  return m;
}

// acc = grad (+ residual, rounded to the dtype as the CPU kernel does): the value the statistics describe.
template <typename scalar_t, bool kAccumulate>
__device__ __forceinline__ float acc_value(float grad, float residual) {
  return kAccumulate ? static_cast<float>(static_cast<scalar_t>(residual + grad)) : grad;
}

// One grid-stride pass: residual = acc (when kAccumulate), per-block moments into partials[blockIdx.x] and, when
// kHistogram, the counts of |acc| by hist_key() added into histogram. Each warp walks whole tiles of
// 32 * kItems elements, so the loop is warp-uniform and the histogram can use warp votes; lane l reads elements
// tile + j * 32 + l (coalesced). grad and residual may alias: every element is read and written by one thread.
template <typename scalar_t, bool kAccumulate, bool kHistogram>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(const scalar_t* grad, scalar_t* residual, int64_t n, Moments* partials, int32_t* histogram) {
  constexpr int kItems = items_per_thread<scalar_t>();
  constexpr int64_t kWarpTile = static_cast<int64_t>(kWarpSize) * kItems;
  extern __shared__ int32_t block_histogram[];
  if constexpr (kHistogram) {
    for (int bin = threadIdx.x; bin < kHistBins; bin += blockDim.x) block_histogram[bin] = 0;
    __syncthreads();
  }
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t first_tile = (blockIdx.x * warps_per_block + threadIdx.x / kWarpSize) * kWarpTile;
  const int64_t tile_stride = static_cast<int64_t>(gridDim.x) * warps_per_block * kWarpTile;

  // Sums of (acc - shift), shift being this thread's first acc: centring keeps the float partial sums accurate
  // when |mean| >> std. Each step's float sums are added to double ones.
  float shift = 0.0f;
  if (first_tile + lane < n) {
    const int64_t i = first_tile + lane;
    shift = acc_value<scalar_t, kAccumulate>(static_cast<float>(grad[i]),
                                             kAccumulate ? static_cast<float>(residual[i]) : 0.0f);
  }
  double sum = 0.0, sum_sq = 0.0;
  int64_t count = 0;
  float max_abs = 0.0f;

  for (int64_t tile = first_tile; tile < n; tile += tile_stride) {
    // All loads before any store: residual may alias grad, which would otherwise serialise them.
    float g[kItems], r[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = tile + j * kWarpSize + lane;
      g[j] = i < n ? static_cast<float>(grad[i]) : 0.0f;
    }
    if constexpr (kAccumulate) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t i = tile + j * kWarpSize + lane;
        r[j] = i < n ? static_cast<float>(residual[i]) : 0.0f;
      }
    }
    float step_sum = 0.0f, step_sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = tile + j * kWarpSize + lane;
      const bool valid = i < n;
      const float acc = acc_value<scalar_t, kAccumulate>(g[j], kAccumulate ? r[j] : 0.0f);
      if constexpr (kAccumulate) {
        if (valid) residual[i] = static_cast<scalar_t>(acc);
      }
      const float centred = valid ? acc - shift : 0.0f;
      step_sum += centred;
      step_sum_sq += centred * centred;
      count += valid;
      const float abs_acc = valid ? fabsf(acc) : 0.0f;
      max_abs = abs_acc > max_abs ? abs_acc : max_abs;  // NaN compares false: ignored
      if constexpr (kHistogram) {
        const int key = valid && !isnan(abs_acc) ? hist_key(abs_acc) : -1;  // NaNs with small payloads share inf's key
        // Lanes sharing lane 0's bin (zeros, repeated values) add with one atomic; the others one each.
        const int lead_key = __shfl_sync(kFullMask, key, 0);
        const unsigned same = __ballot_sync(kFullMask, key == lead_key);
        if (key == lead_key) {
          if (lane == 0 && key >= 0) atomicAdd(&block_histogram[key], __popc(same));
        } else if (key >= 0) {
          atomicAdd(&block_histogram[key], 1);
        }
      }
    }
    sum += step_sum;
    sum_sq += step_sum_sq;
  }

  Moments m{0.0, 0.0, 0.0, max_abs};
  if (count > 0) {
    const double c = static_cast<double>(count);
    double m2 = sum_sq - sum * sum / c;
    if (m2 < 0.0) m2 = 0.0;  // rounding; a NaN stays NaN so non-finite input shows
    m = {c, shift + sum / c, m2, max_abs};
  }
  m = block_merge(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
  if constexpr (kHistogram) {
    __syncthreads();
    for (int bin = threadIdx.x; bin < kHistBins; bin += blockDim.x) {
      const int32_t c = block_histogram[bin];
      if (c != 0) atomicAdd(&histogram[bin], c);
    }
  }
}

// Merges the per-block partials (fixed order) into mean, std, max |acc| and the Gaussian threshold, and when
// k > 0 finds the histogram threshold: each thread sums kBinsPerThread consecutive bins (thread 0 the top ones),
// a block scan gives the count above each thread's bins, and the one thread whose bins hold the k-th largest
// walks them as bin_reaching() does and calls threshold_in_bin(), so CPU and CUDA agree bit for bit.
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(const Moments* partials, int num_partials, const int32_t* histogram, double z, int64_t k,
                  float* stats) {
  Moments m{0.0, 0.0, 0.0, 0.0f};
  for (int p = threadIdx.x; p < num_partials; p += blockDim.x) m = merge(m, partials[p]);
  m = block_merge(m);
  __shared__ float max_abs;
  if (threadIdx.x == 0) {
    const double mean = m.count > 0.0 ? m.mean : 0.0;
    double variance = m.count > 0.0 ? m.m2 / m.count : 0.0;
    if (variance < 0.0) variance = 0.0;
    const double std_dev = sqrt(variance);
    // Unfused multiply and add, as the CPU kernel computes it (-ffp-contract=off).
    const float gaussian = static_cast<float>(__dadd_rn(fabs(mean), __dmul_rn(z, std_dev)));
    stats[kStatMean] = static_cast<float>(mean);
    stats[kStatStd] = static_cast<float>(std_dev);
    stats[kStatMaxAbs] = m.max_abs;
    stats[kStatGaussianThreshold] = gaussian;
    if (k == 0) stats[kStatThreshold] = gaussian;
    max_abs = m.max_abs;
  }
  if (k == 0) return;
  __syncthreads();

  const int top_bin = kHistBins - 1 - static_cast<int>(threadIdx.x) * kBinsPerThread;
  int32_t counts[kBinsPerThread];
  long long own = 0;
  // The bins above kHistInfKey (NaN) are never counted: zero.
  const long long above = scan_from_top(histogram, top_bin, counts, own);
  if (above < k && above + own >= k) {
    long long total = above;
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (total + counts[j] >= k) {
        stats[kStatThreshold] = threshold_in_bin(top_bin - j, total, counts[j], k, max_abs);
        break;
      }
      total += counts[j];
    }
  } else if (threadIdx.x == blockDim.x - 1 && above + own < k) {  // fewer than k non-NaN elements
    stats[kStatThreshold] = threshold_in_bin(-1, above + own, 0, k, max_abs);
  }
}

}  // namespace

at::Tensor gaussian_threshold_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k) {
  static const OpChecks<decltype(gaussian_threshold_cuda)> checks("gtopk_ext::gaussian_threshold");
  checks(grad, residual, z, k);
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor grad_contig = grad.contiguous();
  const int64_t n = grad.numel();
  at::Tensor stats = at::empty({kNumStats}, grad.options().dtype(at::kFloat));
  at::Tensor histogram = k > 0 ? at::zeros({kHistBins}, grad.options().dtype(at::kInt)) : at::Tensor();
  int32_t* histogram_ptr = k > 0 ? histogram.mutable_data_ptr<int32_t>() : nullptr;

  GTOPK_DISPATCH_FLOAT_TYPES(grad.scalar_type(), "gaussian_threshold_cuda", [&] {
    const scalar_t* grad_ptr = grad_contig.const_data_ptr<scalar_t>();
    scalar_t* residual_ptr = residual.has_value() ? residual->mutable_data_ptr<scalar_t>() : nullptr;
    const auto run = [&](auto accumulate, auto with_histogram) {
      const auto kernel = accumulate_kernel<scalar_t, decltype(accumulate)::value, decltype(with_histogram)::value>;
      const size_t shared_bytes = with_histogram ? kHistBins * sizeof(int32_t) : 0;
      const int64_t block_tile = static_cast<int64_t>(kThreads) * items_per_thread<scalar_t>();
      const int grid = resident_grid(kernel, kThreads, shared_bytes, (n + block_tile - 1) / block_tile, grad.device());
      at::Tensor partials = at::empty({static_cast<int64_t>(grid * sizeof(Moments))}, grad.options().dtype(at::kByte));
      Moments* partials_ptr = reinterpret_cast<Moments*>(partials.mutable_data_ptr());
      kernel<<<grid, kThreads, shared_bytes, stream>>>(grad_ptr, residual_ptr, n, partials_ptr, histogram_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      finish_kernel<<<1, kFinishThreads, 0, stream>>>(partials_ptr, grid, histogram_ptr, z, k,
                                                      stats.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    dispatch_flags(residual_ptr != nullptr, k > 0, run);
  });
  return stats;
}

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) { m.impl("gaussian_threshold", &gaussian_threshold_cuda); }

}  // namespace gtopk_ext::cuda
