// CPU kernel of gaussian_select (schema in csrc/ops.cpp): the statistics pass (threshold.cpp) recording
// candidates, the threshold refined inside its histogram bin, and the selection from the candidates.
#include "selection.h"

namespace gtopk_ext::cpu {
namespace {

// The counts of fine_threshold (histogram.h) for `bin`: the elements above it, and those in it by sub-bin.
struct FineCounts {
  int64_t above = 0;
  std::vector<int32_t> counts = std::vector<int32_t>(kFineBins, 0);

  void add(float magnitude, int bin) {
    const int key = hist_key(magnitude);
    if (key > bin) {
      ++above;
    } else if (key == bin) {
      ++counts[fine_key(magnitude)];
    }
  }
};

template <typename scalar_t>
GTOPK_VECTOR_CLONES void count_fine_range(const scalar_t* __restrict__ acc, int64_t begin, int64_t end, int bin,
                                          FineCounts& out) {
  for_each_at_least(acc, begin, end, bin << kHistShift, [&](int64_t, float magnitude) { out.add(magnitude, bin); });
}

// gaussian_select's refined threshold (see csrc/ops.cpp) from the sub-bin counts of thr's bin, taken from each
// range's candidates (they hold every element of that bin and above) or, where those overflowed, from acc.
template <typename scalar_t>
float refine_threshold(float thr, int64_t k, const std::vector<RangeCandidates>& candidates, const scalar_t* acc) {
  if (!refinable(thr)) return thr;
  const int bin = hist_key(thr);
  std::vector<FineCounts> per_range(candidates.size());
  at::parallel_for(0, static_cast<int64_t>(candidates.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RangeCandidates& range = candidates[r];
      if (!range.complete) {
        count_fine_range(acc, range.begin, range.end, bin, per_range[r]);
        continue;
      }
      for (const Candidate& c : range.list) per_range[r].add(c.magnitude, bin);
    }
  });
  FineCounts total;
  for (const FineCounts& range : per_range) {
    total.above += range.above;
    for (int s = 0; s < kFineBins; ++s) total.counts[s] += range.counts[s];
  }
  return fine_threshold(bin, sub_bin_reaching(total.counts.data(), total.above, k));
}

// update_residual: the stored slots leave the residual. Their indices are unique, so a parallel gather-subtract,
// with residual_update's arithmetic (scatter.cpp): in fp32, rounded once.
template <typename scalar_t>
void subtract_stored(scalar_t* residual, const int32_t* indices, const scalar_t* values, int64_t stored) {
  at::parallel_for(0, stored, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      scalar_t& element = residual[indices[j]];
      element = static_cast<scalar_t>(static_cast<float>(element) - static_cast<float>(values[j]));
    }
  });
}

// gaussian_threshold, its threshold refined, then compact at it, without a second read of acc while the
// candidates that the statistics pass recorded suffice (a range whose candidates overflowed reads acc again).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gaussian_select_cpu(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity,
    bool update_residual) {
  static const OpChecks<decltype(gaussian_select_cpu)> checks("gtopk_ext::gaussian_select");
  checks(grad, residual, z, k, capacity, update_residual);
  const at::Tensor grad_contig = grad.contiguous();
  std::vector<RangeCandidates> candidates;
  at::Tensor stats = statistics_pass(grad_contig, residual, z, k, &candidates);
  const at::Tensor& acc = residual.has_value() ? *residual : grad_contig;
  at::Tensor values, indices, count;
  std::tie(values, indices, count) = empty_selection(acc, capacity);
  std::vector<RangeSelection> ranges(candidates.size());
  GTOPK_DISPATCH_FLOAT_TYPES(acc.scalar_type(), "gaussian_select_cpu", [&] {
    const scalar_t* acc_ptr = acc.const_data_ptr<scalar_t>();
    float& thr = stats.mutable_data_ptr<float>()[kStatThreshold];
    thr = refine_threshold(thr, k, candidates, acc_ptr);
    const float sure_thr = sure_threshold(thr);
    at::parallel_for(0, static_cast<int64_t>(candidates.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        select_candidates(candidates[r], acc_ptr, thr, sure_thr, capacity, ranges[r]);
      }
    });
    const int64_t selected = write_selection(ranges, acc_ptr, capacity, values, indices);
    count.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(selected);
    if (update_residual && residual.has_value()) {
      subtract_stored(residual->mutable_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(),
                      values.const_data_ptr<scalar_t>(), std::min(selected, capacity));
    }
  });
  return {values, indices, count, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) { m.impl("gaussian_select", &gaussian_select_cpu); }

}  // namespace gtopk_ext::cpu
