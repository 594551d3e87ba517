// What the CUDA kernel files share: launch shapes, the grid size of grid-stride kernels, the finishing blocks' scan
// over 8192 counts, and the host functions that gaussian_select (select.cu) composes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "../dispatch.h"
#include "../histogram.h"

namespace gtopk_ext::cuda {

// gaussian_threshold (threshold.cu) and compact (compact.cu), which gaussian_select runs in sequence.
at::Tensor gaussian_threshold_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cuda(const at::Tensor& acc, const at::Tensor& threshold,
                                                            int64_t capacity);
// residual_update's sorting scatter without its checks (scatter.cu): gaussian_select's update_residual.
at::Tensor residual_update_unchecked(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values);

namespace {

constexpr int kThreads = 256;        // threads per block of the streaming kernels
constexpr int kFinishThreads = 512;  // the one block that merges the partials and scans the histogram
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kHistBins % kFinishThreads == 0, "every finishing thread owns the same number of bins");
constexpr int kBinsPerThread = kHistBins / kFinishThreads;

// Elements per thread per loop step: 16 bytes of loads in flight per thread and array.
template <typename scalar_t>
constexpr int items_per_thread() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

int multiprocessor_count(const at::Device& device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.index()));
  return count;
}

// Enough blocks of a grid-stride kernel to fill the GPU, no more than the work needs (and at least one). The
// occupancy of each (kernel, launch shape, device) is asked of the driver once: every step launches the same
// kernels, and a step's fixed cost is mostly host work.
template <typename Kernel>
int resident_grid(Kernel kernel, int threads, size_t shared_bytes, int64_t work_blocks, const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, int>, int64_t> resident_blocks;
  const auto key =
      std::make_tuple(reinterpret_cast<const void*>(kernel), threads, shared_bytes, static_cast<int>(device.index()));
  int64_t resident = 0;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = resident_blocks.find(key);
    if (found != resident_blocks.end()) resident = found->second;
  }
  if (resident == 0) {
    int blocks_per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, shared_bytes));
    resident = static_cast<int64_t>(multiprocessor_count(device)) * std::max(1, blocks_per_sm);
    const std::lock_guard<std::mutex> lock(mutex);
    resident_blocks[key] = resident;
  }
  return static_cast<int>(std::max<int64_t>(1, std::min(work_blocks, resident)));
}

// The scan of both finishing kernels over 8192 counts: thread t loads the kBinsPerThread of them from
// top = 8191 - t * kBinsPerThread down into counts, sets own to their sum and gets the sum of all counts above
// them (a block-wide exclusive scan, which synchronises the block).
__device__ long long scan_from_top(const int32_t* bin_counts, int top, int32_t (&counts)[kBinsPerThread],
                                   long long& own) {
  using BlockScan = cub::BlockScan<long long, kFinishThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  own = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    counts[j] = bin_counts[top - j];
    own += counts[j];
  }
  long long above = 0;
  BlockScan(scan_storage).ExclusiveSum(own, above);
  return above;
}

}  // namespace
}  // namespace gtopk_ext::cuda
