// CUDA kernels of the gtopk_ext ops (schemas in csrc/ops.cpp), with the semantics of csrc/cpu/kernels.cpp and
// gtopk_ext/reference.py. No kernel synchronises with the host: thresholds are read and statistics written on the
// device, so every op can be captured in a CUDA graph and overlaps the host's work.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_partition.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/discard_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "../common.h"

namespace gtopk_ext {
namespace {

constexpr int kThreads = 256;         // threads per block of the streaming kernels
constexpr int kFinishThreads = 512;   // the one block that merges the partials and scans the histogram
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

// Enough blocks of a grid-stride kernel to fill the GPU, no more than the work needs (and at least one).
template <typename Kernel>
int resident_grid(Kernel kernel, int threads, size_t shared_bytes, int64_t work_blocks, const at::Device& device) {
  int blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, shared_bytes));
  const int64_t resident = static_cast<int64_t>(multiprocessor_count(device)) * std::max(1, blocks_per_sm);
  return static_cast<int>(std::max<int64_t>(1, std::min(work_blocks, resident)));
}

// ---- gaussian_threshold ---------------------------------------------------------------------------------------

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
__global__ void __launch_bounds__(kThreads) accumulate_kernel(const scalar_t* grad, scalar_t* residual, int64_t n,
                                                              Moments* partials, int32_t* histogram) {
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

// Merges the per-block partials (fixed order) into mean, std, max |acc| and the Gaussian threshold, and when
// k > 0 finds the histogram threshold: each thread sums kBinsPerThread consecutive bins (thread 0 the top ones),
// a block scan gives the count above each thread's bins, and the one thread whose bins hold the k-th largest
// walks them as bin_reaching() does and calls threshold_in_bin(), so CPU and CUDA agree bit for bit.
__global__ void __launch_bounds__(kFinishThreads) finish_kernel(const Moments* partials, int num_partials,
                                                                const int32_t* histogram, double z, int64_t k,
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

at::Tensor gaussian_threshold_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k) {
  check_gaussian_threshold_args(grad, residual, z, k);
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
      const int grid =
          resident_grid(kernel, kThreads, shared_bytes, (n + block_tile - 1) / block_tile, grad.device());
      at::Tensor partials =
          at::empty({static_cast<int64_t>(grid * sizeof(Moments))}, grad.options().dtype(at::kByte));
      Moments* partials_ptr = reinterpret_cast<Moments*>(partials.mutable_data_ptr());
      kernel<<<grid, kThreads, shared_bytes, stream>>>(grad_ptr, residual_ptr, n, partials_ptr, histogram_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      finish_kernel<<<1, kFinishThreads, 0, stream>>>(partials_ptr, grid, histogram_ptr, z, k,
                                                      stats.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (residual_ptr != nullptr) {
      k > 0 ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    } else {
      k > 0 ? run(No{}, Yes{}) : run(No{}, No{});
    }
  });
  return stats;
}

// ---- compact ----------------------------------------------------------------------------------------------------
//
// One read of acc: a single-pass (decoupled look-back) three-way partition of the indices (cub::DevicePartition)
// into the sure candidates (|acc| >= sure_threshold(thr)) and the boundary ones (thr <= |acc| < that), each kept
// in index order and written only while its rank is below the capacity, with their totals on the device. A
// second kernel over at most `capacity` entries keeps the first min(sure, capacity) sure ones and fills the
// remaining slots with boundary ones, merging the two ascending lists by binary search. A plain
// DeviceSelect would need the sure total before writing, i.e. a second pass over acc or a host sync.

// Does |acc[i]| reach the threshold (sure: the upper edge of its histogram bin)? The threshold is read on the
// device at every call, from L1.
template <typename scalar_t>
struct ReachesThreshold {
  const scalar_t* acc;
  const float* threshold;
  bool sure;
  __device__ bool operator()(int32_t i) const {
    const float thr = *threshold;
    return fabsf(static_cast<float>(acc[i])) >= (sure ? sure_threshold(thr) : thr);
  }
};

// Writes index i at position `rank` of a list of `slots` entries, dropping what does not fit.
struct StoreWhileRoom {
  int32_t* list;
  int64_t slots;
  __device__ void operator()(std::ptrdiff_t rank, int32_t i) const {
    if (rank < slots) list[rank] = i;
  }
};

// Number of entries of the ascending list[0, length) below value.
__device__ __forceinline__ int64_t lower_bound(const int32_t* list, int64_t length, int32_t value) {
  int64_t lo = 0, hi = length;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (list[mid] < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Output slot of each kept candidate: its rank in its own list plus the number of kept entries of the other
// list with a smaller index (the lists are disjoint and ascending), so the output is ascending.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) merge_selected_kernel(const scalar_t* acc, const int32_t* sure,
                                                                  const int32_t* boundary,
                                                                  const int32_t* part_totals, int64_t capacity,
                                                                  scalar_t* values, int32_t* indices,
                                                                  int32_t* count) {
  const int64_t sure_total = part_totals[0], boundary_total = part_totals[1];
  const int64_t sure_kept = sure_total < capacity ? sure_total : capacity;
  const int64_t boundary_room = capacity - sure_kept;
  const int64_t boundary_kept = boundary_total < boundary_room ? boundary_total : boundary_room;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) count[0] = static_cast<int32_t>(sure_total + boundary_total);  // < 2^31: at most numel
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = first; t < sure_kept + boundary_kept; t += stride) {
    const bool from_sure = t < sure_kept;
    const int64_t rank = from_sure ? t : t - sure_kept;
    const int32_t idx = from_sure ? sure[rank] : boundary[rank];
    const int64_t slot =
        rank + (from_sure ? lower_bound(boundary, boundary_kept, idx) : lower_bound(sure, sure_kept, idx));
    indices[slot] = idx;
    values[slot] = acc[idx];
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cuda(const at::Tensor& acc, const at::Tensor& threshold,
                                                            int64_t capacity) {
  check_compact_args(acc, threshold, capacity);
  const c10::cuda::CUDAGuard guard(acc.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor acc_contig = acc.contiguous();
  const int64_t n = acc.numel();
  at::Tensor values = at::zeros({capacity}, acc.options());
  at::Tensor indices = at::zeros({capacity}, acc.options().dtype(at::kInt));
  at::Tensor count = at::zeros({1}, acc.options().dtype(at::kInt));
  if (n == 0) return {values, indices, count};

  const int64_t slots = std::min(capacity, n);  // no list can hold more
  at::Tensor lists = at::empty({2 * slots}, acc.options().dtype(at::kInt));
  at::Tensor part_totals = at::empty({2}, acc.options().dtype(at::kInt));
  int32_t* sure_list = lists.mutable_data_ptr<int32_t>();
  int32_t* boundary_list = sure_list + slots;
  const float* threshold_ptr = threshold.const_data_ptr<float>();

  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_cuda", [&] {
    const scalar_t* acc_ptr = acc_contig.const_data_ptr<scalar_t>();
    const auto partition = [&](void* temp, size_t& temp_bytes) {
      return cub::DevicePartition::If(
          temp, temp_bytes, thrust::counting_iterator<int32_t>(0),
          thrust::make_tabulate_output_iterator(StoreWhileRoom{sure_list, slots}),
          thrust::make_tabulate_output_iterator(StoreWhileRoom{boundary_list, slots}),
          thrust::make_discard_iterator(), part_totals.mutable_data_ptr<int32_t>(), static_cast<int>(n),
          ReachesThreshold<scalar_t>{acc_ptr, threshold_ptr, true},
          ReachesThreshold<scalar_t>{acc_ptr, threshold_ptr, false}, stream);
    };
    size_t temp_bytes = 0;
    C10_CUDA_CHECK(partition(nullptr, temp_bytes));
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, acc.options().dtype(at::kByte));
    C10_CUDA_CHECK(partition(temp.mutable_data_ptr(), temp_bytes));

    const auto merge_kernel = merge_selected_kernel<scalar_t>;
    const int grid = resident_grid(merge_kernel, kThreads, 0, (slots + kThreads - 1) / kThreads, acc.device());
    merge_kernel<<<grid, kThreads, 0, stream>>>(acc_ptr, sure_list, boundary_list,
                                                part_totals.const_data_ptr<int32_t>(), capacity,
                                                values.mutable_data_ptr<scalar_t>(),
                                                indices.mutable_data_ptr<int32_t>(),
                                                count.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {values, indices, count};
}

// ---- scatter_add / residual_update ----------------------------------------------------------------------------

// *address += value (negated when kNegate: exact, a sign flip) with the hardware atomics of each dtype
// (fp16: sm_70+; bf16: sm_90+, a compare-and-swap loop before).
template <bool kNegate>
__device__ __forceinline__ void atomic_add(float* address, float value) {
  atomicAdd(address, kNegate ? -value : value);
}

template <bool kNegate>
__device__ __forceinline__ void atomic_add(c10::Half* address, c10::Half value) {
  const unsigned short bits = kNegate ? value.x ^ 0x8000u : value.x;
  atomicAdd(reinterpret_cast<__half*>(address), __ushort_as_half(bits));
}

template <bool kNegate>
__device__ __forceinline__ void atomic_add(c10::BFloat16* address, c10::BFloat16 value) {
  const unsigned short bits = kNegate ? value.x ^ 0x8000u : value.x;
  atomicAdd(reinterpret_cast<__nv_bfloat16*>(address), __ushort_as_bfloat16(bits));
}

// dense[indices[j]] += (-)values[j]; indices outside [0, n) are skipped and counted into *invalid.
template <typename scalar_t, bool kNegate>
__global__ void __launch_bounds__(kThreads) scatter_kernel(scalar_t* dense, int64_t n, const int32_t* indices,
                                                           const scalar_t* values, int64_t m, int32_t* invalid) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    const int32_t idx = indices[j];
    if (idx < 0 || idx >= n) {
      atomicAdd(invalid, 1);
    } else {
      atomic_add<kNegate>(dense + idx, values[j]);
    }
  }
}

template <bool kNegate>
at::Tensor signed_scatter_cuda(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values,
                               const char* op, const char* dense_name) {
  check_scatter_args(dense, indices, values, op, dense_name);
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t m = indices.numel();
  at::Tensor invalid = at::zeros({1}, dense.options().dtype(at::kInt));
  if (m == 0) return invalid;
  GTOPK_DISPATCH_FLOAT_TYPES(dense.scalar_type(), "signed_scatter_cuda", [&] {
    const auto kernel = scatter_kernel<scalar_t, kNegate>;
    const int grid = resident_grid(kernel, kThreads, 0, (m + kThreads - 1) / kThreads, dense.device());
    kernel<<<grid, kThreads, 0, stream>>>(dense.mutable_data_ptr<scalar_t>(), dense.numel(),
                                          indices_contig.const_data_ptr<int32_t>(),
                                          values_contig.const_data_ptr<scalar_t>(), m,
                                          invalid.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return invalid;
}

at::Tensor scatter_add_cuda(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_cuda<false>(dense, indices, values, "scatter_add", "dense");
}

at::Tensor residual_update_cuda(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_cuda<true>(residual, indices, values, "residual_update", "residual");
}

// ---- gaussian_select ----------------------------------------------------------------------------------------
//
// On the GPU more reads of acc are cheap next to the CPU's: gaussian_threshold, the refinement of its threshold
// (a counting pass, then one block), then compact, in sequence on the same stream.

// Adds the count of |acc| above the threshold's bin into fine_counts[kFineBins] and those in the bin by
// sub-bin into fine_counts[sub-bin] (common.h fine_threshold), through a block histogram in shared memory.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fine_count_kernel(const scalar_t* acc, int64_t n, const float* stats,
                                                              int32_t* fine_counts) {
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

__global__ void __launch_bounds__(kFinishThreads) fine_finish_kernel(const int32_t* fine_counts, int64_t k,
                                                                     float* stats) {
  const float threshold = stats[kStatThreshold];
  if (!refinable(threshold)) return;  // the same for every thread
  const int bin = hist_key(threshold);
  const long long above_bin = fine_counts[kFineBins];
  if (above_bin >= k) {  // the same for every thread
    __syncthreads();  // every thread has read the threshold
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
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity) {
  check_gaussian_select_args(grad, residual, z, k, capacity);
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
  auto selection = compact_cuda(acc, stats.narrow(0, kStatThreshold, 1), capacity);
  return {std::get<0>(selection), std::get<1>(selection), std::get<2>(selection), stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) {
  m.impl("gaussian_threshold", &gaussian_threshold_cuda);
  m.impl("compact", &compact_cuda);
  m.impl("gaussian_select", &gaussian_select_cuda);
  m.impl("scatter_add", &scatter_add_cuda);
  m.impl("residual_update", &residual_update_cuda);
}

}  // namespace gtopk_ext
