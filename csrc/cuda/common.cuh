// What the CUDA kernel files share: launch shapes, the grid size of grid-stride kernels, the finishing blocks' scan
// over 8192 counts, the last-block test, the workspace (workspace.cu), and the host functions that gaussian_select
// (select.cu) composes.
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
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "../histogram.h"

namespace gtopk_ext::cuda {

// The workspace (workspace.cu): one buffer per (device, stream) that starts with these counters, which
// are zero before every call because the kernels that use them leave them zeroed (the finishing blocks zero what
// they have read), followed by scratch that every call overwrites.
struct ZeroedCounters {
  int32_t histogram[kHistBins];        // the statistics pass's bins of |acc|
  int32_t fine_counts[kFineBins + 1];  // gaussian_select's sub-bins of the threshold's bin, then those above
  unsigned int blocks_done[2];         // blocks that finished the statistics pass / the fine counting pass
};

// The workspace of the current call, locked: calls from several host threads on one stream launch in turn.
struct WorkspaceLease {
  std::unique_lock<std::mutex> lock;
  ZeroedCounters* zeroed;
  char* scratch;  // at least the bytes asked for, 256-byte aligned
};

// The workspace of (device, stream), grown to at least scratch_bytes of scratch. Allocates (and zeroes the counters,
// one memset) only when there is none yet or it is too small; a grown one's predecessors stay allocated, since a
// CUDA graph captured with them replays on their addresses.
WorkspaceLease lease_workspace(const at::Device& device, cudaStream_t stream, size_t scratch_bytes);

// Scratch is cut into 256-byte aligned pieces: `bytes` rounded up, and the next piece of `count` Ts at `cursor`.
constexpr size_t scratch_piece(size_t bytes) { return (bytes + 255) / 256 * 256; }

template <typename T>
T* take_scratch(char*& cursor, int64_t count) {
  T* piece = reinterpret_cast<T*>(cursor);
  cursor += scratch_piece(static_cast<size_t>(count) * sizeof(T));
  return piece;
}

// The passes that gaussian_select composes: the scratch each needs, and its launches into a leased workspace
// (launch counts in select.cu).
size_t statistics_scratch_bytes(const at::Tensor& grad, bool accumulate, int64_t k);
void launch_statistics(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k,
                       float* stats, ZeroedCounters* zeroed, char* scratch, cudaStream_t stream);
size_t compact_scratch_bytes(const at::Tensor& acc, int64_t capacity);
void launch_compact(const at::Tensor& acc, const float* threshold, int64_t capacity, const at::Tensor& values,
                    const at::Tensor& indices, const at::Tensor& count, bool update_acc, char* scratch,
                    cudaStream_t stream);

namespace {

constexpr int kThreads = 256;  // threads per block of the streaming kernels
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

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

// Bins of the 8192 that each thread of a finishing block of kBlockThreads owns.
template <int kBlockThreads>
constexpr int bins_per_thread() {
  static_assert(kHistBins % kBlockThreads == 0, "every finishing thread owns the same number of bins");
  return kHistBins / kBlockThreads;
}

// A bin count that a finishing block reads, from L2: other blocks of the same kernel wrote it.
__device__ __forceinline__ int32_t load_count(const int32_t* bin_counts, int bin) { return __ldcg(bin_counts + bin); }

// The scan of the finishing blocks over 8192 counts: thread t sums the bins_per_thread() of them from
// top = 8191 - t * bins_per_thread() down into own and gets the sum of all counts above them (a block-wide exclusive
// scan, which synchronises the block). The one thread whose bins hold the crossing reads its bins again to walk them:
// no counts are held in registers across the scan.
template <int kBlockThreads>
__device__ long long scan_from_top(const int32_t* bin_counts, int top, long long& own) {
  using BlockScan = cub::BlockScan<long long, kBlockThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  own = 0;
#pragma unroll
  for (int j = 0; j < bins_per_thread<kBlockThreads>(); ++j) own += load_count(bin_counts, top - j);
  long long above = 0;
  BlockScan(scan_storage).ExclusiveSum(own, above);
  return above;
}

// Whether this block is the last of its grid to get here (all threads call it). Every thread's earlier writes
// (stores, atomics) are fenced before thread 0 counts the block, so the last block sees every block's; it resets
// the counter for the next call. What the last block then reads it reads from L2 (__ldcg).
__device__ bool is_last_block(unsigned int* blocks_done) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    if (last) *blocks_done = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

}  // namespace
}  // namespace gtopk_ext::cuda
