// CUDA kernels of scatter_add and residual_update (schemas in csrc/ops.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

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
    kernel<<<grid, kThreads, 0, stream>>>(
        dense.mutable_data_ptr<scalar_t>(), dense.numel(), indices_contig.const_data_ptr<int32_t>(),
        values_contig.const_data_ptr<scalar_t>(), m, invalid.mutable_data_ptr<int32_t>());
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

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) {
  m.impl("scatter_add", &scatter_add_cuda);
  m.impl("residual_update", &residual_update_cuda);
}

}  // namespace gtopk_ext::cuda
