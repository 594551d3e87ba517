// CUDA kernels of wire_encode and wire_decode (schemas in csrc/ops.cpp, the format in wire_format.h). Every slot and
// every page is one thread's work; the message's largest finite |value| is an atomicMax on its float32 pattern
// (non-negative floats order as their patterns), an exact and order-free reduction.
#include "../wire_format.h"
#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

__device__ __forceinline__ int32_t used_slots(const int32_t* count, int64_t k) { return wire_used(*count, k); }

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    wire_max_kernel(const scalar_t* values, const int32_t* count, int64_t k, unsigned int* max_bits) {
  const int32_t used = used_slots(count, k);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned int local = 0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < used; j += stride) {
    const float magnitude = fabsf(static_cast<float>(values[j]));
    if (magnitude == magnitude && !is_infinite(magnitude)) local = max(local, float_bits(magnitude));
  }
  if (local != 0) atomicMax(max_bits, local);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    wire_encode_kernel(const int32_t* indices, const scalar_t* values, const int32_t* count, int64_t k,
                       const unsigned int* max_bits, uint16_t* halves, int16_t* low, int32_t* shift_out) {
  const int32_t used = used_slots(count, k);
  const int32_t shift = wire_shift(bits_float(*max_bits));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const bool live = j < used;
    halves[j] = live ? wire_half_bits(static_cast<float>(values[j]), shift) : uint16_t{0};
    low[j] = live ? static_cast<int16_t>(static_cast<uint16_t>(indices[j] & 0xFFFF)) : int16_t{0};
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *shift_out = shift;
}

__global__ void __launch_bounds__(kThreads)
    wire_pages_kernel(const int32_t* indices, const int32_t* count, int64_t k, int64_t num_pages, int32_t* pages) {
  const int32_t used = used_slots(count, k);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p <= num_pages; p += stride) {
    pages[p] = wire_lower_bound(indices, used, p << kWirePageShift);
  }
}

__global__ void __launch_bounds__(kThreads) wire_check_pages_kernel(const int32_t* pages, const int32_t* count,
                                                                    int64_t k, int64_t num_pages, int32_t* invalid) {
  const int32_t used = used_slots(count, k);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p <= num_pages; p += stride) {
    if (wire_page_is_bad(pages, num_pages, p, used)) atomicAdd(invalid, 1);
  }
}

__global__ void __launch_bounds__(kThreads)
    wire_decode_kernel(const uint16_t* halves, const int16_t* low, const int32_t* pages, const int32_t* shift_in,
                       const int32_t* count, int64_t k, int64_t num_pages, int64_t numel, int32_t* indices,
                       float* values, int32_t* invalid) {
  const int32_t used = used_slots(count, k);
  int32_t shift = *shift_in;
  const bool bad_shift = shift < -kWireShiftMax || shift > kWireShiftMax;
  if (bad_shift) shift = 0;
  if (bad_shift && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(invalid, 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    int32_t index = 0;
    float value = 0.0f;
    if (j < used) {
      if (wire_slot_index(pages, num_pages, low, static_cast<int32_t>(j), numel, &index)) {
        value = wire_value(halves[j], shift);
      } else {
        index = 0;
        atomicAdd(invalid, 1);
      }
    }
    indices[j] = index;
    values[j] = value;
  }
}

// Blocks of kThreads threads that cover `work` elements.
int64_t work_blocks(int64_t work) { return (work + kThreads - 1) / kThreads; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> wire_encode_cuda(const at::Tensor& indices,
                                                                            const at::Tensor& values,
                                                                            const at::Tensor& count, int64_t numel) {
  static const OpChecks<decltype(wire_encode_cuda)> checks("gtopk_ext::wire_encode");
  checks(indices, values, count, numel);
  const c10::cuda::CUDAGuard guard(values.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t k = values.numel();
  const int64_t num_pages = wire_num_pages(numel);
  at::Tensor max_bits = at::zeros({1}, values.options().dtype(at::kInt));
  at::Tensor halves = at::empty({k}, values.options().dtype(at::kHalf));
  at::Tensor low = at::empty({k}, values.options().dtype(at::kShort));
  at::Tensor pages = at::empty({num_pages + 1}, values.options().dtype(at::kInt));
  at::Tensor shift = at::empty({1}, values.options().dtype(at::kInt));
  auto* max_ptr = reinterpret_cast<unsigned int*>(max_bits.mutable_data_ptr<int32_t>());
  GTOPK_DISPATCH_FLOAT_TYPES(values.scalar_type(), "wire_encode_cuda", [&] {
    const int max_grid = resident_grid(wire_max_kernel<scalar_t>, kThreads, 0, work_blocks(k), values.device());
    wire_max_kernel<scalar_t><<<max_grid, kThreads, 0, stream>>>(values_contig.const_data_ptr<scalar_t>(),
                                                                 count.const_data_ptr<int32_t>(), k, max_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int encode_grid = resident_grid(wire_encode_kernel<scalar_t>, kThreads, 0, work_blocks(k), values.device());
    wire_encode_kernel<scalar_t><<<encode_grid, kThreads, 0, stream>>>(
        indices_contig.const_data_ptr<int32_t>(), values_contig.const_data_ptr<scalar_t>(),
        count.const_data_ptr<int32_t>(), k, max_ptr, reinterpret_cast<uint16_t*>(halves.mutable_data_ptr<at::Half>()),
        low.mutable_data_ptr<int16_t>(), shift.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  wire_pages_kernel<<<resident_grid(wire_pages_kernel, kThreads, 0, work_blocks(num_pages + 1), values.device()),
                      kThreads, 0, stream>>>(indices_contig.const_data_ptr<int32_t>(), count.const_data_ptr<int32_t>(),
                                             k, num_pages, pages.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {halves, low, pages, shift};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wire_decode_cuda(const at::Tensor& halves, const at::Tensor& low,
                                                                const at::Tensor& pages, const at::Tensor& shift,
                                                                const at::Tensor& count, int64_t numel) {
  static const OpChecks<decltype(wire_decode_cuda)> checks("gtopk_ext::wire_decode");
  checks(halves, low, pages, shift, count, numel);
  const c10::cuda::CUDAGuard guard(halves.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor halves_contig = halves.contiguous();
  const at::Tensor low_contig = low.contiguous();
  const at::Tensor pages_contig = pages.contiguous();
  const int64_t k = halves.numel();
  const int64_t num_pages = wire_num_pages(numel);
  at::Tensor indices = at::empty({k}, halves.options().dtype(at::kInt));
  at::Tensor values = at::empty({k}, halves.options().dtype(at::kFloat));
  at::Tensor invalid = at::zeros({1}, halves.options().dtype(at::kInt));
  wire_check_pages_kernel<<<resident_grid(wire_check_pages_kernel, kThreads, 0, work_blocks(num_pages + 1),
                                          halves.device()),
                            kThreads, 0, stream>>>(pages_contig.const_data_ptr<int32_t>(),
                                                   count.const_data_ptr<int32_t>(), k, num_pages,
                                                   invalid.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  wire_decode_kernel<<<resident_grid(wire_decode_kernel, kThreads, 0, work_blocks(k), halves.device()), kThreads, 0,
                       stream>>>(reinterpret_cast<const uint16_t*>(halves_contig.const_data_ptr<at::Half>()),
                                 low_contig.const_data_ptr<int16_t>(), pages_contig.const_data_ptr<int32_t>(),
                                 shift.const_data_ptr<int32_t>(), count.const_data_ptr<int32_t>(), k, num_pages, numel,
                                 indices.mutable_data_ptr<int32_t>(), values.mutable_data_ptr<float>(),
                                 invalid.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {indices, values, invalid};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CUDA, m) {
  m.impl("wire_encode", &wire_encode_cuda);
  m.impl("wire_decode", &wire_decode_cuda);
}

}  // namespace gtopk_ext::cuda
