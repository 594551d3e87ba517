// CPU kernel of compact (schema in csrc/ops.cpp).
#include "selection.h"

namespace gtopk_ext::cpu {
namespace {

// One read of acc: each thread selects from one contiguous range, then the ranges' lists are merged in range
// order, so indices come out ascending.
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_cpu(const at::Tensor& acc, const at::Tensor& threshold,
                                                           int64_t capacity) {
  static const OpChecks<decltype(compact_cpu)> checks("gtopk_ext::compact");
  checks(acc, threshold, capacity);
  const at::Tensor acc_contig = acc.contiguous();
  const int64_t n = acc.numel();
  const float thr = threshold.item<float>();
  const float sure_thr = sure_threshold(thr);
  at::Tensor values, indices, count;
  std::tie(values, indices, count) = empty_selection(acc, capacity);
  const int64_t num_ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kChunk));
  const int64_t range_len = (n + num_ranges - 1) / num_ranges;
  std::vector<RangeSelection> ranges(num_ranges);
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "compact_cpu", [&] {
    const scalar_t* acc_ptr = acc_contig.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_ranges, 1, [&](int64_t range_begin, int64_t range_end) {
      for (int64_t r = range_begin; r < range_end; ++r) {
        select_range(acc_ptr, std::min(n, r * range_len), std::min(n, (r + 1) * range_len), thr, sure_thr, capacity,
                     ranges[r]);
      }
    });
    const int64_t selected = write_selection(ranges, acc_ptr, capacity, values, indices);
    count.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(selected);
  });
  return {values, indices, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) { m.impl("compact", &compact_cpu); }

}  // namespace gtopk_ext::cpu
