// CPU kernels of scatter_add and residual_update (schemas in csrc/ops.cpp).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../dispatch.h"

namespace gtopk_ext::cpu {
namespace {

// dense[indices[j]] += sign * values[j], skipping (and counting) indices outside [0, numel).
at::Tensor signed_scatter_cpu(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values,
                              float sign) {
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t n = dense.numel();
  const int64_t m = indices.numel();
  int32_t invalid = 0;
  GTOPK_DISPATCH_FLOAT_TYPES(dense.scalar_type(), "signed_scatter_cpu", [&] {
    scalar_t* dense_ptr = dense.mutable_data_ptr<scalar_t>();
    const int32_t* idx_ptr = indices_contig.const_data_ptr<int32_t>();
    const scalar_t* val_ptr = values_contig.const_data_ptr<scalar_t>();
    for (int64_t j = 0; j < m; ++j) {
      const int32_t idx = idx_ptr[j];
      if (idx < 0 || idx >= n) {
        ++invalid;
        continue;
      }
      dense_ptr[idx] =
          static_cast<scalar_t>(static_cast<float>(dense_ptr[idx]) + sign * static_cast<float>(val_ptr[j]));
    }
  });
  at::Tensor invalid_count = at::empty({1}, dense.options().dtype(at::kInt));
  invalid_count.mutable_data_ptr<int32_t>()[0] = invalid;
  return invalid_count;
}

at::Tensor scatter_add_cpu(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  static const OpChecks<decltype(scatter_add_cpu)> checks("gtopk_ext::scatter_add");
  checks(dense, indices, values);
  return signed_scatter_cpu(dense, indices, values, 1.0f);
}

at::Tensor residual_update_cpu(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values) {
  static const OpChecks<decltype(residual_update_cpu)> checks("gtopk_ext::residual_update");
  checks(residual, indices, values);
  return signed_scatter_cpu(residual, indices, values, -1.0f);
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) {
  m.impl("scatter_add", &scatter_add_cpu);
  m.impl("residual_update", &residual_update_cpu);
}

}  // namespace gtopk_ext::cpu
