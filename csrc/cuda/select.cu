// CUDA kernels of gaussian_select (schema in csrc/ops.cpp): on the GPU more reads of acc are cheap next to the
// CPU's, so it runs the statistics pass (threshold.cu), the refinement of its threshold (a counting pass), then
// compact's passes (compact.cu), in sequence on the same stream.
//
// Launches per call, as the code below makes them:
//   1  accumulate_kernel: acc = grad + residual, moments, histogram; its last block: stats and the histogram
//      threshold, the histogram zeroed
//   1  fine_count_kernel: the threshold's bin by sub-bin; its last block: the refined threshold, the counts zeroed
//   2  cub::DevicePartition::If: its tile-state initialisation and its single-pass partition of the indices
//   1  merge_selected_kernel: values, indices, count, the padding slots and, with update_residual, the selected
//      elements of the residual (acc - value)
// = 5, plus one memset on a call that creates or grows the (device, stream)'s workspace. Allocations: the four
// outputs (torch's caching allocator), nothing else once the workspace is large enough. No host synchronisation.
#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

// The sub-bin search of the refinement (histogram.h fine_threshold) over fine_counts (the threshold's bin by
// sub-bin, then the count above the bin), done by one block: stats[kStatThreshold] becomes fine_threshold(bin,
// sub_bin), the sub-bin found as finish_statistics finds the histogram bin (scan_from_top, then one thread's walk),
// so that it equals sub_bin_reaching(). Each thread then zeroes the counts it read: the workspace stays zeroed.
static_assert(kFineBins == kHistBins, "scan_from_top serves both levels");

template <int kBlockThreads>
__device__ void refine_threshold(int32_t* fine_counts, int64_t k, float* stats) {
  const float threshold = stats[kStatThreshold];
  if (!refinable(threshold)) return;  // the same for every thread
  const int bin = hist_key(threshold);
  const long long above_bin = load_count(fine_counts, kFineBins);
  constexpr int kBins = bins_per_thread<kBlockThreads>();
  const int top = kFineBins - 1 - static_cast<int>(threadIdx.x) * kBins;
  long long own = 0;
  // The scan synchronises the block: every thread has read the threshold and above_bin before one writes them.
  const long long above = above_bin + scan_from_top<kBlockThreads>(fine_counts, top, own);
  if (above_bin >= k) {
    if (threadIdx.x == 0) stats[kStatThreshold] = fine_threshold(bin, kFineBins);
  } else if (above < k && above + own >= k) {
    long long total = above;
    for (int j = 0; j < kBins; ++j) {
      total += load_count(fine_counts, top - j);
      if (total >= k) {
        stats[kStatThreshold] = fine_threshold(bin, top - j);
        break;
      }
    }
  } else if (threadIdx.x == blockDim.x - 1 && above + own < k) {  // the whole bin falls short
    stats[kStatThreshold] = fine_threshold(bin, 0);
  }
  for (int j = 0; j < kBins; ++j) fine_counts[top - j] = 0;  // each thread its own counts, after its last read
  if (threadIdx.x == 0) fine_counts[kFineBins] = 0;
}

// Adds the count of |acc| above the threshold's bin into fine_counts[kFineBins] and those in the bin by
// sub-bin into fine_counts[sub-bin] (histogram.h fine_threshold), through a block histogram in shared memory; the
// last block then refines the threshold and zeroes fine_counts.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    fine_count_kernel(const scalar_t* acc, int64_t n, float* stats, int32_t* fine_counts, unsigned int* blocks_done,
                      int64_t k) {
  __shared__ int32_t block_counts[kFineBins];
  __shared__ int32_t block_above;
  const float threshold = stats[kStatThreshold];
  if (!refinable(threshold)) return;  // the same for every thread of the grid
  const int bin = hist_key(threshold);
  for (int s = threadIdx.x; s < kFineBins; s += blockDim.x) block_counts[s] = 0;
  if (threadIdx.x == 0) block_above = 0;
  __syncthreads();
  int32_t above = 0;  // n < 2^31
  // kItems loads in flight per thread before any is used (one a loop step leaves most of the bandwidth unused);
  // element tile + j * blockDim.x + threadIdx.x, so each load is coalesced.
  constexpr int kItems = items_per_thread<scalar_t>();
  const int64_t block_tile = static_cast<int64_t>(blockDim.x) * kItems;
  for (int64_t tile = blockIdx.x * block_tile; tile < n; tile += gridDim.x * block_tile) {
    float magnitude[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = tile + j * blockDim.x + threadIdx.x;
      magnitude[j] = i < n ? fabsf(static_cast<float>(acc[i])) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (tile + j * blockDim.x + threadIdx.x >= n || isnan(magnitude[j])) continue;
      const int key = hist_key(magnitude[j]);
      if (key > bin) {
        ++above;
      } else if (key == bin) {
        atomicAdd(&block_counts[fine_key(magnitude[j])], 1);
      }
    }
  }
  if (above != 0) atomicAdd(&block_above, above);
  __syncthreads();
  for (int s = threadIdx.x; s < kFineBins; s += blockDim.x) {
    if (block_counts[s] != 0) atomicAdd(&fine_counts[s], block_counts[s]);
  }
  if (threadIdx.x == 0 && block_above != 0) atomicAdd(&fine_counts[kFineBins], block_above);
  if (is_last_block(blocks_done)) refine_threshold<kThreads>(fine_counts, k, stats);
}

template <typename scalar_t>
int fine_count_grid(int64_t n, const at::Device& device) {
  const int64_t block_tile = static_cast<int64_t>(kThreads) * items_per_thread<scalar_t>();
  return resident_grid(fine_count_kernel<scalar_t>, kThreads, 0, (n + block_tile - 1) / block_tile, device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gaussian_select_cuda(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity,
    bool update_residual) {
  static const OpChecks<decltype(gaussian_select_cuda)> checks("gtopk_ext::gaussian_select");
  checks(grad, residual, z, k, capacity, update_residual);
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor grad_contig = grad.contiguous();
  const at::Tensor acc = residual.has_value() ? *residual : grad_contig;
  const int64_t n = acc.numel();
  // The outputs, every element of which the kernels write: no fills.
  at::Tensor stats = at::empty({kNumStats}, acc.options().dtype(at::kFloat));
  at::Tensor values = at::empty({capacity}, acc.options());
  at::Tensor indices = at::empty({capacity}, acc.options().dtype(at::kInt));
  at::Tensor count = at::empty({1}, acc.options().dtype(at::kInt));
  float* stats_ptr = stats.mutable_data_ptr<float>();
  // The passes run in stream order, so the statistics pass's scratch and compact's share the same bytes.
  const size_t scratch_bytes =
      std::max(statistics_scratch_bytes(grad_contig, residual.has_value(), k), compact_scratch_bytes(acc, capacity));
  const WorkspaceLease workspace = lease_workspace(acc.device(), stream, scratch_bytes);
  launch_statistics(grad_contig, residual, z, k, stats_ptr, workspace.zeroed, workspace.scratch, stream);
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "gaussian_select_cuda", [&] {
    fine_count_kernel<scalar_t><<<fine_count_grid<scalar_t>(n, acc.device()), kThreads, 0, stream>>>(
        acc.const_data_ptr<scalar_t>(), n, stats_ptr, workspace.zeroed->fine_counts, &workspace.zeroed->blocks_done[1],
        k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  launch_compact(acc, stats_ptr + kStatThreshold, capacity, values, indices, count,
                 update_residual && residual.has_value(), workspace.scratch, stream);
  return {values, indices, count, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) { m.impl("gaussian_select", &gaussian_select_cuda); }

}  // namespace gtopk_ext::cuda
