// The argument checks that several ops share, for their Meta kernels (csrc/ops.cpp). Host only. Sizes are read as
// SymInts: torch.compile runs the checks on tensors of symbolic shape.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <string_view>

namespace gtopk_ext {

inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op,
              ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.sym_numel() <= std::numeric_limits<int32_t>::max(), op, ": ", name, " has ", t.sym_numel(),
              " elements, but gtopk_ext uses int32 indices and supports at most 2^31 - 1 elements per tensor; "
              "split it into smaller buckets");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device (", ref.device(),
              "), got ", t.device());
}

// The mutated argument of an op must be contiguous: a copy would leave the caller's tensor unchanged.
inline void check_mutable_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is updated in place and must be contiguous");
}

// A number of output slots (named `name`): at least 1, and int32 indices must reach them all.
inline void check_capacity(int64_t capacity, const char* op, const char* name = "capacity") {
  TORCH_CHECK(capacity >= 1, op, ": ", name, " must be >= 1, got ", capacity);
  TORCH_CHECK(capacity <= std::numeric_limits<int32_t>::max(), op, ": ", name, " must be < 2^31, got ", capacity);
}

// A 1-D int32 tensor of indices and the values of the same shape, on `ref`'s device.
inline void check_sparse_set(const at::Tensor& indices, const at::Tensor& values, const at::Tensor& ref, const char* op,
                             const char* indices_name, const char* values_name, const char* ref_name) {
  TORCH_CHECK(indices.scalar_type() == at::kInt && indices.dim() == 1, op, ": ", indices_name,
              " must be a 1-D int32 tensor, got ", indices.scalar_type(), " of ", indices.dim(), " dimensions");
  check_float_tensor(values, op, values_name);
  const std::string_view name(indices_name);  // C++17: torch before 2.13 builds extensions with -std=c++17
  const char* possessive = !name.empty() && name.back() == 's' ? "'" : "'s";  // indices', indices_a's
  TORCH_CHECK(values.sym_sizes() == indices.sym_sizes(), op, ": ", values_name, " must have ", indices_name, possessive,
              " shape ", indices.sym_sizes(), ", got ", values.sym_sizes());
  check_same_device(indices, ref, op, indices_name, ref_name);
  check_same_device(values, ref, op, values_name, ref_name);
}

}  // namespace gtopk_ext
