// CUDA kernels of scatter_add and residual_update (schemas in csrc/ops.cpp).
#include <ATen/ops/arange.h>

#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

// Deterministic: a stable radix sort of (index, slot) pairs groups the duplicates in slot order; piece_sums_kernel
// sums each piece (the slots of one index inside a tile of kScatterTile sorted slots) in fp32, a run's first piece
// from dense's value; apply_run_sums_kernel adds each run's pieces in order and writes dense once, one rounding.
// No float atomics: the same bits on every run, rank and grid size (replicas stay bitwise equal), and the
// semantics of gtopk_ext/reference.py and the Triton kernels.

__device__ __forceinline__ bool in_dense(int32_t index, int64_t n) { return index >= 0 && index < n; }

template <typename scalar_t, bool kNegate>
__global__ void __launch_bounds__(kThreads)
    piece_sums_kernel(const scalar_t* dense, int64_t n, const int32_t* sorted_indices, const int32_t* slots,
                      const scalar_t* values, int64_t m, float* piece_sums) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < m; first += stride) {
    const int32_t index = sorted_indices[first];
    const bool run_start = first == 0 || sorted_indices[first - 1] != index;
    if (!run_start && first % kScatterTile != 0) continue;
    float acc = run_start && in_dense(index, n) ? static_cast<float>(dense[index]) : -0.0f;
    int64_t slot = first;
    do {
      const float value = static_cast<float>(values[slots[slot]]);
      acc += kNegate ? -value : value;
      ++slot;
    } while (slot < m && slot % kScatterTile != 0 && sorted_indices[slot] == index);
    piece_sums[first] = acc;
  }
}

// Indices outside [0, n) are skipped and counted into *invalid (an integer count: its total is exact).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    apply_run_sums_kernel(scalar_t* dense, int64_t n, const int32_t* sorted_indices, const float* piece_sums, int64_t m,
                          int32_t* invalid) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < m; first += stride) {
    const int32_t index = sorted_indices[first];
    if (!in_dense(index, n)) {
      atomicAdd(invalid, 1);
      continue;
    }
    if (first > 0 && sorted_indices[first - 1] == index) continue;
    float total = piece_sums[first];
    for (int64_t piece = (first / kScatterTile + 1) * kScatterTile; piece < m && sorted_indices[piece] == index;
         piece += kScatterTile) {
      total += piece_sums[piece];
    }
    dense[index] = static_cast<scalar_t>(total);
  }
}

template <bool kNegate>
at::Tensor signed_scatter_cuda(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t m = indices.numel();
  at::Tensor invalid = at::zeros({1}, dense.options().dtype(at::kInt));
  if (m == 0) return invalid;
  const auto int_options = indices.options().dtype(at::kInt);
  at::Tensor slots_in = at::arange(m, int_options);
  at::Tensor sorted_indices = at::empty({m}, int_options);
  at::Tensor slots = at::empty({m}, int_options);
  at::Tensor piece_sums = at::empty({m}, dense.options().dtype(at::kFloat));
  const auto sort = [&](void* temp, size_t& temp_bytes) {  // LSD radix sort: stable, slot order kept
    return cub::DeviceRadixSort::SortPairs(
        temp, temp_bytes, indices_contig.const_data_ptr<int32_t>(), sorted_indices.mutable_data_ptr<int32_t>(),
        slots_in.const_data_ptr<int32_t>(), slots.mutable_data_ptr<int32_t>(), static_cast<int>(m), 0, 32, stream);
  };
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(sort(nullptr, temp_bytes));
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, dense.options().dtype(at::kByte));
  C10_CUDA_CHECK(sort(temp.mutable_data_ptr(), temp_bytes));
  GTOPK_DISPATCH_FLOAT_TYPES(dense.scalar_type(), "signed_scatter_cuda", [&] {
    const int64_t work_blocks = (m + kThreads - 1) / kThreads;
    const auto pieces = piece_sums_kernel<scalar_t, kNegate>;
    pieces<<<resident_grid(pieces, kThreads, 0, work_blocks, dense.device()), kThreads, 0, stream>>>(
        dense.const_data_ptr<scalar_t>(), dense.numel(), sorted_indices.const_data_ptr<int32_t>(),
        slots.const_data_ptr<int32_t>(), values_contig.const_data_ptr<scalar_t>(), m,
        piece_sums.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto apply = apply_run_sums_kernel<scalar_t>;
    apply<<<resident_grid(apply, kThreads, 0, work_blocks, dense.device()), kThreads, 0, stream>>>(
        dense.mutable_data_ptr<scalar_t>(), dense.numel(), sorted_indices.const_data_ptr<int32_t>(),
        piece_sums.const_data_ptr<float>(), m, invalid.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return invalid;
}

at::Tensor scatter_add_cuda(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  static const OpChecks<decltype(scatter_add_cuda)> checks("gtopk_ext::scatter_add");
  checks(dense, indices, values);
  return signed_scatter_cuda<false>(dense, indices, values);
}

at::Tensor residual_update_cuda(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values) {
  static const OpChecks<decltype(residual_update_cuda)> checks("gtopk_ext::residual_update");
  checks(residual, indices, values);
  return signed_scatter_cuda<true>(residual, indices, values);
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) {
  m.impl("scatter_add", &scatter_add_cuda);
  m.impl("residual_update", &residual_update_cuda);
}

}  // namespace gtopk_ext::cuda
