// CUDA kernels of gaussian_select (schema in csrc/ops.cpp): on the GPU more reads of acc are cheap next to the
// CPU's, so it runs gaussian_threshold, the refinement of its threshold (a counting pass, then one block), then
// compact, in sequence on the same stream.
#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

// Adds the count of |acc| above the threshold's bin into fine_counts[kFineBins] and those in the bin by
// sub-bin into fine_counts[sub-bin] (histogram.h fine_threshold), through a block histogram in shared memory.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    fine_count_kernel(const scalar_t* acc, int64_t n, const float* stats, int32_t* fine_counts) {
  __shared__ int32_t block_counts[kFineBins];
  __shared__ int32_t block_above;
  const float threshold = stats[kStatThreshold];
  if (!refinable(threshold)) return;  // the same for every thread of the grid
  const int bin = hist_key(threshold);
  for (int s = threadIdx.x; s < kFineBins; s += blockDim.x) block_counts[s] = 0;
  if (threadIdx.x == 0) block_above = 0;
  __syncthreads();
  int32_t above = 0;  // n < 2^31
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float magnitude = fabsf(static_cast<float>(acc[i]));
    if (isnan(magnitude)) continue;
    const int key = hist_key(magnitude);
    if (key > bin) {
      ++above;
    } else if (key == bin) {
      atomicAdd(&block_counts[fine_key(magnitude)], 1);
    }
  }
  if (above != 0) atomicAdd(&block_above, above);
  __syncthreads();
  for (int s = threadIdx.x; s < kFineBins; s += blockDim.x) {
    if (block_counts[s] != 0) atomicAdd(&fine_counts[s], block_counts[s]);
  }
  if (threadIdx.x == 0 && block_above != 0) atomicAdd(&fine_counts[kFineBins], block_above);
}

// One block: stats[kStatThreshold] becomes fine_threshold(bin, sub_bin), the sub-bin found as finish_kernel
// finds the histogram bin (scan_from_top, then one thread's walk), so that it equals sub_bin_reaching().
static_assert(kFineBins == kHistBins, "scan_from_top serves both levels");

__global__ void __launch_bounds__(kFinishThreads)
    fine_finish_kernel(const int32_t* fine_counts, int64_t k, float* stats) {
  const float threshold = stats[kStatThreshold];
  if (!refinable(threshold)) return;  // the same for every thread
  const int bin = hist_key(threshold);
  const long long above_bin = fine_counts[kFineBins];
  if (above_bin >= k) {  // the same for every thread
    __syncthreads();     // every thread has read the threshold
    if (threadIdx.x == 0) stats[kStatThreshold] = fine_threshold(bin, kFineBins);
    return;
  }
  const int top = kFineBins - 1 - static_cast<int>(threadIdx.x) * kBinsPerThread;
  int32_t counts[kBinsPerThread];
  long long own = 0;
  // The scan synchronises the block: every thread has read the threshold before one writes it.
  const long long above = above_bin + scan_from_top(fine_counts, top, counts, own);
  if (above < k && above + own >= k) {
    long long total = above;
    for (int j = 0; j < kBinsPerThread; ++j) {
      total += counts[j];
      if (total >= k) {
        stats[kStatThreshold] = fine_threshold(bin, top - j);
        break;
      }
    }
  } else if (threadIdx.x == blockDim.x - 1 && above + own < k) {  // the whole bin falls short
    stats[kStatThreshold] = fine_threshold(bin, 0);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gaussian_select_cuda(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity,
    bool update_residual) {
  static const OpChecks<decltype(gaussian_select_cuda)> checks("gtopk_ext::gaussian_select");
  checks(grad, residual, z, k, capacity, update_residual);
  at::Tensor stats = gaussian_threshold_cuda(grad, residual, z, k);
  const at::Tensor acc = residual.has_value() ? *residual : grad.contiguous();
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = acc.numel();
  at::Tensor fine_counts = at::zeros({kFineBins + 1}, acc.options().dtype(at::kInt));  // sub-bins, then above
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "gaussian_select_cuda", [&] {
    const auto kernel = fine_count_kernel<scalar_t>;
    const int grid = resident_grid(kernel, kThreads, 0, (n + kThreads - 1) / kThreads, acc.device());
    kernel<<<grid, kThreads, 0, stream>>>(acc.const_data_ptr<scalar_t>(), n, stats.const_data_ptr<float>(),
                                          fine_counts.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  fine_finish_kernel<<<1, kFinishThreads, 0, stream>>>(fine_counts.const_data_ptr<int32_t>(), k,
                                                       stats.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto [values, indices, count] = compact_cuda(acc, stats.narrow(0, kStatThreshold, 1), capacity);
  if (update_residual && residual.has_value()) residual_update_unchecked(*residual, indices, values);
  return {values, indices, count, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) { m.impl("gaussian_select", &gaussian_select_cuda); }

}  // namespace gtopk_ext::cuda
