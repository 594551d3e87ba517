// CUDA kernels of compact (schema in csrc/ops.cpp), with the semantics of csrc/cpu/compact.cpp. The threshold is
// read on the device: no host synchronisation. 3 launches (the partition's 2, the merge, which also writes the
// padding slots: the outputs need no fills), the scratch from the leased workspace.
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/discard_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <cub/device/device_partition.cuh>

#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

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
// list with a smaller index (the lists are disjoint and ascending), so the output is ascending. part_totals ==
// nullptr: nothing was partitioned (acc is empty). The slots past the kept ones get (index 0, value 0); with
// update, each kept element of acc (the residual) becomes acc - value: what was sent leaves it, as
// residual_update would do (its indices are unique here, so no sort is needed).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    merge_selected_kernel(const scalar_t* acc, const int32_t* sure, const int32_t* boundary, const int32_t* part_totals,
                          int64_t capacity, scalar_t* values, int32_t* indices, int32_t* count, scalar_t* update) {
  const int64_t sure_total = part_totals != nullptr ? part_totals[0] : 0;
  const int64_t boundary_total = part_totals != nullptr ? part_totals[1] : 0;
  const int64_t sure_kept = sure_total < capacity ? sure_total : capacity;
  const int64_t boundary_room = capacity - sure_kept;
  const int64_t boundary_kept = boundary_total < boundary_room ? boundary_total : boundary_room;
  const int64_t kept = sure_kept + boundary_kept;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) count[0] = static_cast<int32_t>(sure_total + boundary_total);  // < 2^31: at most numel
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = first; t < capacity; t += stride) {
    if (t >= kept) {
      indices[t] = 0;
      values[t] = static_cast<scalar_t>(0.0f);
      continue;
    }
    const bool from_sure = t < sure_kept;
    const int64_t rank = from_sure ? t : t - sure_kept;
    const int32_t idx = from_sure ? sure[rank] : boundary[rank];
    const int64_t slot =
        rank + (from_sure ? lower_bound(boundary, boundary_kept, idx) : lower_bound(sure, sure_kept, idx));
    const scalar_t value = acc[idx];
    indices[slot] = idx;
    values[slot] = value;
    // In fp32, rounded once, as residual_update computes it: +0.0 for a finite value, NaN for an infinity.
    if (update != nullptr) update[idx] = static_cast<scalar_t>(static_cast<float>(value) - static_cast<float>(value));
  }
}

// The partition of the indices [0, n) into the first `slots` sure and boundary ones, with both totals into
// part_totals (cub::DevicePartition::If, one read of acc); temp == nullptr asks for temp_bytes.
template <typename scalar_t>
cudaError_t partition_indices(void* temp, size_t& temp_bytes, const scalar_t* acc, const float* threshold, int64_t n,
                              int64_t slots, int32_t* sure_list, int32_t* boundary_list, int32_t* part_totals,
                              cudaStream_t stream) {
  return cub::DevicePartition::If(temp, temp_bytes, thrust::counting_iterator<int32_t>(0),
                                  thrust::make_tabulate_output_iterator(StoreWhileRoom{sure_list, slots}),
                                  thrust::make_tabulate_output_iterator(StoreWhileRoom{boundary_list, slots}),
                                  thrust::make_discard_iterator(), part_totals, static_cast<int>(n),
                                  ReachesThreshold<scalar_t>{acc, threshold, true},
                                  ReachesThreshold<scalar_t>{acc, threshold, false}, stream);
}

template <typename scalar_t>
int merge_grid(int64_t work, const at::Device& device) {
  return resident_grid(merge_selected_kernel<scalar_t>, kThreads, 0, (work + kThreads - 1) / kThreads, device);
}

}  // namespace

size_t compact_scratch_bytes(const at::Tensor& acc, int64_t capacity) {
  const int64_t n = acc.numel();
  if (n == 0) return 0;
  const int64_t slots = std::min(capacity, n);  // no list can hold more
  size_t temp_bytes = 0;
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_scratch_bytes", [&] {
    C10_CUDA_CHECK(partition_indices<scalar_t>(nullptr, temp_bytes, nullptr, nullptr, n, slots, nullptr, nullptr,
                                               nullptr, nullptr));
  });
  return scratch_piece(2 * sizeof(int32_t)) + scratch_piece(2 * slots * sizeof(int32_t)) + scratch_piece(temp_bytes);
}

// 3 launches (2 when acc is empty): the partition's 2 into scratch, then the merge, which writes every slot of
// values and indices and, with update_acc, subtracts what it kept from acc (the residual).
void launch_compact(const at::Tensor& acc, const float* threshold, int64_t capacity, const at::Tensor& values,
                    const at::Tensor& indices, const at::Tensor& count, bool update_acc, char* scratch,
                    cudaStream_t stream) {
  const int64_t n = acc.numel();
  const int64_t slots = std::min(capacity, n);
  int32_t* part_totals = n > 0 ? take_scratch<int32_t>(scratch, 2) : nullptr;
  int32_t* sure_list = take_scratch<int32_t>(scratch, 2 * slots);
  int32_t* boundary_list = sure_list + slots;
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "launch_compact", [&] {
    const scalar_t* acc_ptr = acc.const_data_ptr<scalar_t>();
    if (n > 0) {
      size_t temp_bytes = 0;
      C10_CUDA_CHECK(partition_indices(static_cast<void*>(nullptr), temp_bytes, acc_ptr, threshold, n, slots, sure_list,
                                       boundary_list, part_totals, stream));
      C10_CUDA_CHECK(partition_indices(static_cast<void*>(scratch), temp_bytes, acc_ptr, threshold, n, slots, sure_list,
                                       boundary_list, part_totals, stream));
    }
    merge_selected_kernel<scalar_t><<<merge_grid<scalar_t>(capacity, acc.device()), kThreads, 0, stream>>>(
        acc_ptr, sure_list, boundary_list, part_totals, capacity, values.mutable_data_ptr<scalar_t>(),
        indices.mutable_data_ptr<int32_t>(), count.mutable_data_ptr<int32_t>(),
        update_acc ? acc.mutable_data_ptr<scalar_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cuda(const at::Tensor& acc, const at::Tensor& threshold,
                                                            int64_t capacity) {
  static const OpChecks<decltype(compact_cuda)> checks("gtopk_ext::compact");
  checks(acc, threshold, capacity);
  const c10::cuda::CUDAGuard guard(acc.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor acc_contig = acc.contiguous();
  at::Tensor values = at::empty({capacity}, acc.options());  // every slot written by the merge: no fills
  at::Tensor indices = at::empty({capacity}, acc.options().dtype(at::kInt));
  at::Tensor count = at::empty({1}, acc.options().dtype(at::kInt));
  const WorkspaceLease workspace = lease_workspace(acc.device(), stream, compact_scratch_bytes(acc_contig, capacity));
  launch_compact(acc_contig, threshold.const_data_ptr<float>(), capacity, values, indices, count, false,
                 workspace.scratch, stream);
  return {values, indices, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) { m.impl("compact", &compact_cuda); }

}  // namespace gtopk_ext::cuda
