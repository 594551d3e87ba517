// CUDA kernels of gaussian_threshold (schema in csrc/ops.cpp), with the semantics of csrc/cpu/threshold.cpp and
// gtopk_ext/reference.py. No kernel synchronises with the host: the statistics are written on the device, so the
// op can be captured in a CUDA graph and overlaps the host's work. One launch: the last block of the pass finishes
// (and zeroes the histogram it read).
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

// A block's partial, read from L2 (__ldcg): other blocks of the same kernel wrote it.
__device__ __forceinline__ Moments load_partial(const Moments* p) {
  return {__ldcg(&p->count), __ldcg(&p->mean), __ldcg(&p->m2), __ldcg(&p->max_abs)};
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

// Merges the per-block partials (fixed order) into mean, std, max |acc| and the Gaussian threshold, and when
// k > 0 finds the histogram threshold: each thread sums bins_per_thread() consecutive bins (thread 0 the top ones),
// a block scan gives the count above each thread's bins, and the one thread whose bins hold the k-th largest
// walks them as bin_reaching() does and calls threshold_in_bin(), so CPU and CUDA agree bit for bit. Each thread
// then zeroes the bins it read: the workspace stays zeroed.
template <int kBlockThreads>
__device__ void finish_statistics(const Moments* partials, int num_partials, int32_t* histogram, double z, int64_t k,
                                  float* stats) {
  Moments m{0.0, 0.0, 0.0, 0.0f};
  for (int p = threadIdx.x; p < num_partials; p += blockDim.x) m = merge(m, load_partial(partials + p));
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

  constexpr int kBins = bins_per_thread<kBlockThreads>();
  const int top_bin = kHistBins - 1 - static_cast<int>(threadIdx.x) * kBins;
  long long own = 0;
  // The bins above kHistInfKey (NaN) are never counted: zero.
  const long long above = scan_from_top<kBlockThreads>(histogram, top_bin, own);
  if (above < k && above + own >= k) {
    long long total = above;
    for (int j = 0; j < kBins; ++j) {
      const int32_t count = load_count(histogram, top_bin - j);
      if (total + count >= k) {
        stats[kStatThreshold] = threshold_in_bin(top_bin - j, total, count, k, max_abs);
        break;
      }
      total += count;
    }
  } else if (threadIdx.x == blockDim.x - 1 && above + own < k) {  // fewer than k non-NaN elements
    stats[kStatThreshold] = threshold_in_bin(-1, above + own, 0, k, max_abs);
  }
  for (int j = 0; j < kBins; ++j) histogram[top_bin - j] = 0;  // each thread its own bins, after its last read
}

// The finish, done by the last block of the statistics pass.
struct LastBlockFinish {
  unsigned int* blocks_done;
  double z;
  int64_t k;
  float* stats;
};

// One grid-stride pass: residual = acc (when kAccumulate), per-block moments into partials[blockIdx.x] and, when
// kHistogram, the counts of |acc| by hist_key() added into histogram; then the last block finishes
// (finish_statistics, zeroing the histogram). Each warp walks whole tiles of
// 32 * kItems elements, so the loop is warp-uniform and the histogram can use warp votes; lane l reads elements
// tile + j * 32 + l (coalesced). grad and residual may alias: every element is read and written by one thread.
template <typename scalar_t, bool kAccumulate, bool kHistogram>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(const scalar_t* grad, scalar_t* residual, int64_t n, Moments* partials, int32_t* histogram,
                      LastBlockFinish finish) {
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
  if (is_last_block(finish.blocks_done)) {
    finish_statistics<kThreads>(partials, gridDim.x, histogram, finish.z, finish.k, finish.stats);
  }
}

// The statistics pass's instance for the dtype and flags, with its dynamic shared memory and grid:
// run(kernel, shared_bytes, grid).
template <typename scalar_t, typename F>
void with_statistics_kernel(bool accumulate, bool histogram, int64_t n, const at::Device& device, F&& run) {
  dispatch_flags(accumulate, histogram, [&](auto accumulate_flag, auto histogram_flag) {
    const auto kernel = accumulate_kernel<scalar_t, decltype(accumulate_flag)::value, decltype(histogram_flag)::value>;
    const size_t shared_bytes = histogram_flag ? kHistBins * sizeof(int32_t) : 0;
    const int64_t block_tile = static_cast<int64_t>(kThreads) * items_per_thread<scalar_t>();
    run(kernel, shared_bytes, resident_grid(kernel, kThreads, shared_bytes, (n + block_tile - 1) / block_tile, device));
  });
}

}  // namespace

size_t statistics_scratch_bytes(const at::Tensor& grad, bool accumulate, int64_t k) {
  size_t bytes = 0;
  GTOPK_DISPATCH_FLOAT_TYPES(grad.scalar_type(), "statistics_scratch_bytes", [&] {
    with_statistics_kernel<scalar_t>(accumulate, k > 0, grad.numel(), grad.device(),
                                     [&](auto, size_t, int grid) { bytes = scratch_piece(grid * sizeof(Moments)); });
  });
  return bytes;
}

// One launch: the pass, whose last block writes stats. grad is contiguous.
void launch_statistics(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k,
                       float* stats, ZeroedCounters* zeroed, char* scratch, cudaStream_t stream) {
  const int64_t n = grad.numel();
  GTOPK_DISPATCH_FLOAT_TYPES(grad.scalar_type(), "launch_statistics", [&] {
    scalar_t* residual_ptr = residual.has_value() ? residual->mutable_data_ptr<scalar_t>() : nullptr;
    with_statistics_kernel<scalar_t>(
        residual_ptr != nullptr, k > 0, n, grad.device(), [&](auto kernel, size_t shared_bytes, int grid) {
          Moments* partials = take_scratch<Moments>(scratch, grid);
          kernel<<<grid, kThreads, shared_bytes, stream>>>(grad.const_data_ptr<scalar_t>(), residual_ptr, n, partials,
                                                           k > 0 ? zeroed->histogram : nullptr,
                                                           LastBlockFinish{&zeroed->blocks_done[0], z, k, stats});
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

namespace {

at::Tensor gaussian_threshold_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k) {
  static const OpChecks<decltype(gaussian_threshold_cuda)> checks("gtopk_ext::gaussian_threshold");
  checks(grad, residual, z, k);
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor grad_contig = grad.contiguous();
  at::Tensor stats = at::empty({kNumStats}, grad.options().dtype(at::kFloat));
  WorkspaceLease workspace =
      lease_workspace(grad.device(), stream, statistics_scratch_bytes(grad_contig, residual.has_value(), k));
  launch_statistics(grad_contig, residual, z, k, stats.mutable_data_ptr<float>(), workspace.zeroed, workspace.scratch,
                    stream);
  return stats;
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) { m.impl("gaussian_threshold", &gaussian_threshold_cuda); }

}  // namespace gtopk_ext::cuda
