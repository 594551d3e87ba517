// CPU kernels of wire_encode and wire_decode (schemas in csrc/ops.cpp, the format in wire_format.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "../dispatch.h"
#include "../wire_format.h"

namespace gtopk_ext::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> wire_encode_cpu(const at::Tensor& indices,
                                                                           const at::Tensor& values,
                                                                           const at::Tensor& count, int64_t numel) {
  static const OpChecks<decltype(wire_encode_cpu)> checks("gtopk_ext::wire_encode");
  checks(indices, values, count, numel);
  const at::Tensor indices_contig = indices.contiguous();
  const at::Tensor values_contig = values.contiguous();
  const int64_t k = values.numel();
  const int64_t num_pages = wire_num_pages(numel);
  at::Tensor halves = at::zeros({k}, values.options().dtype(at::kHalf));
  at::Tensor low = at::zeros({k}, values.options().dtype(at::kShort));
  at::Tensor pages = at::empty({num_pages + 1}, values.options().dtype(at::kInt));
  at::Tensor shift = at::empty({1}, values.options().dtype(at::kInt));
  const int32_t used = wire_used(count.item<int32_t>(), k);
  const int32_t* idx = indices_contig.const_data_ptr<int32_t>();
  GTOPK_DISPATCH_FLOAT_TYPES(values.scalar_type(), "wire_encode_cpu", [&] {
    const scalar_t* val = values_contig.const_data_ptr<scalar_t>();
    float max_abs = 0.0f;
    for (int32_t j = 0; j < used; ++j) {
      const float a = std::fabs(static_cast<float>(val[j]));
      if (std::isfinite(a)) max_abs = std::max(max_abs, a);
    }
    const int32_t s = wire_shift(max_abs);
    shift.mutable_data_ptr<int32_t>()[0] = s;
    auto* half_ptr = reinterpret_cast<uint16_t*>(halves.mutable_data_ptr<at::Half>());
    int16_t* low_ptr = low.mutable_data_ptr<int16_t>();
    for (int32_t j = 0; j < used; ++j) {
      half_ptr[j] = wire_half_bits(static_cast<float>(val[j]), s);
      low_ptr[j] = static_cast<int16_t>(static_cast<uint16_t>(idx[j] & 0xFFFF));
    }
  });
  int32_t* page_ptr = pages.mutable_data_ptr<int32_t>();
  for (int64_t p = 0; p <= num_pages; ++p) page_ptr[p] = wire_lower_bound(idx, used, p << kWirePageShift);
  return {halves, low, pages, shift};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wire_decode_cpu(const at::Tensor& halves, const at::Tensor& low,
                                                               const at::Tensor& pages, const at::Tensor& shift,
                                                               const at::Tensor& count, int64_t numel) {
  static const OpChecks<decltype(wire_decode_cpu)> checks("gtopk_ext::wire_decode");
  checks(halves, low, pages, shift, count, numel);
  const at::Tensor halves_contig = halves.contiguous();
  const at::Tensor low_contig = low.contiguous();
  const at::Tensor pages_contig = pages.contiguous();
  const int64_t k = halves.numel();
  const int64_t num_pages = wire_num_pages(numel);
  at::Tensor indices = at::zeros({k}, halves.options().dtype(at::kInt));
  at::Tensor values = at::zeros({k}, halves.options().dtype(at::kFloat));
  const int32_t used = wire_used(count.item<int32_t>(), k);
  int32_t s = shift.item<int32_t>();
  int32_t invalid = 0;
  if (s < -kWireShiftMax || s > kWireShiftMax) {
    ++invalid;
    s = 0;
  }
  const int32_t* page_ptr = pages_contig.const_data_ptr<int32_t>();
  for (int64_t p = 0; p <= num_pages; ++p) invalid += wire_page_is_bad(page_ptr, num_pages, p, used);
  const auto* half_ptr = reinterpret_cast<const uint16_t*>(halves_contig.const_data_ptr<at::Half>());
  const int16_t* low_ptr = low_contig.const_data_ptr<int16_t>();
  int32_t* idx_out = indices.mutable_data_ptr<int32_t>();
  float* val_out = values.mutable_data_ptr<float>();
  for (int32_t j = 0; j < used; ++j) {
    int32_t index = 0;
    if (wire_slot_index(page_ptr, num_pages, low_ptr, j, numel, &index)) {
      idx_out[j] = index;
      val_out[j] = wire_value(half_ptr[j], s);
    } else {
      ++invalid;
    }
  }
  at::Tensor invalid_count = at::empty({1}, halves.options().dtype(at::kInt));
  invalid_count.mutable_data_ptr<int32_t>()[0] = invalid;
  return {indices, values, invalid_count};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) {
  m.impl("wire_encode", &wire_encode_cpu);
  m.impl("wire_decode", &wire_decode_cpu);
}

}  // namespace gtopk_ext::cpu
