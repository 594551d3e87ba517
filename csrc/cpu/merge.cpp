// CPU kernel of merge_topk (schema in csrc/ops.cpp): gTop-k's merge of two sparse sets.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../dispatch.h"
#include "../histogram.h"

namespace gtopk_ext::cpu {
namespace {

// The union of two sets of slots, ascending by index, with each index's float32 sum: `size` entries of arrays
// sized for the largest union.
struct Union {
  std::vector<int32_t> indices;
  std::vector<float> sums;
  int64_t size = 0;

  explicit Union(int64_t capacity) : indices(capacity), sums(capacity) {}

  void add(int32_t index, float sum) {
    indices[size] = index;
    sums[size] = sum;
    ++size;
  }
};

// The length of the strictly ascending prefix of non-negative indices when every later slot is padding (index 0),
// as compact and merge_topk write them; -1 for any other layout.
int64_t padded_ascending_prefix(const int32_t* indices, int64_t n) {
  if (n > 0 && indices[0] < 0) return -1;
  int64_t prefix = 0;
  while (prefix < n && (prefix == 0 || indices[prefix] > indices[prefix - 1])) ++prefix;
  for (int64_t j = prefix; j < n; ++j) {
    if (indices[j] != 0) return -1;
  }
  return prefix;
}

// Messages as they come: a linear merge of the two ascending prefixes. Index 0 (a prefix's first slot, and every
// padding slot) is summed first, in slot order.
template <typename scalar_t>
void merge_padded(const int32_t* ia, const scalar_t* va, int64_t na, int64_t pa, const int32_t* ib, const scalar_t* vb,
                  int64_t nb, int64_t pb, Union& out) {
  bool has_zero = false;
  float zero_sum = 0.0f;
  const auto add_zeros = [&](const int32_t* indices, const scalar_t* values, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      if (indices[j] == 0) {
        has_zero = true;
        zero_sum += static_cast<float>(values[j]);
      }
    }
  };
  add_zeros(ia, va, na);
  add_zeros(ib, vb, nb);
  if (has_zero) out.add(0, zero_sum);
  int64_t a = pa > 0 && ia[0] == 0 ? 1 : 0;
  int64_t b = pb > 0 && ib[0] == 0 ? 1 : 0;
  while (a < pa || b < pb) {
    const bool take_a = b == pb || (a < pa && ia[a] <= ib[b]);
    const bool take_b = a == pa || (b < pb && ib[b] <= ia[a]);
    float sum = 0.0f;
    if (take_a) sum += static_cast<float>(va[a]);
    if (take_b) sum += static_cast<float>(vb[b]);
    out.add(take_a ? ia[a] : ib[b], sum);
    a += take_a;
    b += take_b;
  }
}

// Any other slots: a stable sort of all of them by index keeps the slot order within an index.
template <typename scalar_t>
void merge_sorted(const int32_t* ia, const scalar_t* va, int64_t na, const int32_t* ib, const scalar_t* vb, int64_t nb,
                  Union& out) {
  const auto index_of = [&](int64_t slot) { return slot < na ? ia[slot] : ib[slot - na]; };
  const auto value_of = [&](int64_t slot) { return static_cast<float>(slot < na ? va[slot] : vb[slot - na]); };
  std::vector<int64_t> slots(na + nb);
  std::iota(slots.begin(), slots.end(), 0);
  std::stable_sort(slots.begin(), slots.end(), [&](int64_t x, int64_t y) { return index_of(x) < index_of(y); });
  for (size_t j = 0; j < slots.size(); ++j) {
    if (j == 0 || index_of(slots[j]) != index_of(slots[j - 1])) out.add(index_of(slots[j]), 0.0f);
    out.sums[out.size - 1] += value_of(slots[j]);
  }
}

// A key per union entry that orders them best first: NaN sums (alike), then larger |sums|, then lower indices.
inline uint64_t merge_rank_key(float sum, int32_t index) {
  const uint32_t magnitude = std::isnan(sum) ? 0x7FFFFFFFu : float_bits(sum) & 0x7FFFFFFFu;
  return (static_cast<uint64_t>(0x7FFFFFFFu - magnitude) << 32) | (static_cast<uint32_t>(index) ^ 0x80000000u);
}

// The histogram bin of a union entry's sum (histogram.h), NaN in the top bin: higher bins rank better.
inline int merge_rank_bin(float sum) { return std::isnan(sum) ? kHistBins - 1 : hist_key(std::fabs(sum)); }

// Whether each union entry is among the k best (merge_rank_key order), for a union of more than k entries. As for
// the threshold, a histogram finds the bin of the k-th best; only that bin's entries are ranked one by one.
std::vector<uint8_t> best_k(const Union& merged, int64_t k) {
  const int64_t size = merged.size;
  std::vector<int32_t> counts(kHistBins, 0);
  std::vector<int> bins(size);
  for (int64_t j = 0; j < size; ++j) ++counts[bins[j] = merge_rank_bin(merged.sums[j])];
  int64_t above = 0;
  const int bin = bin_reaching(counts.data(), k, kHistBins - 1, &above);
  std::vector<uint64_t> in_bin;
  in_bin.reserve(counts[bin]);
  for (int64_t j = 0; j < size; ++j) {
    if (bins[j] == bin) in_bin.push_back(merge_rank_key(merged.sums[j], merged.indices[j]));
  }
  const int64_t rank_in_bin = k - above - 1;
  std::nth_element(in_bin.begin(), in_bin.begin() + rank_in_bin, in_bin.end());
  const uint64_t kth = in_bin[rank_in_bin];
  std::vector<uint8_t> kept(size);
  for (int64_t j = 0; j < size; ++j) {
    kept[j] = bins[j] > bin || (bins[j] == bin && merge_rank_key(merged.sums[j], merged.indices[j]) <= kth);
  }
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_topk_cpu(const at::Tensor& indices_a, const at::Tensor& values_a,
                                                              const at::Tensor& indices_b, const at::Tensor& values_b,
                                                              int64_t k) {
  static const OpChecks<decltype(merge_topk_cpu)> checks("gtopk_ext::merge_topk");
  checks(indices_a, values_a, indices_b, values_b, k);
  const at::Tensor ia = indices_a.contiguous(), ib = indices_b.contiguous();
  const at::Tensor va = values_a.contiguous(), vb = values_b.contiguous();
  at::Tensor indices = at::zeros({k}, ia.options());
  at::Tensor values = at::zeros({k}, va.options());
  at::Tensor union_size = at::empty({1}, ia.options());
  Union merged(ia.numel() + ib.numel());
  GTOPK_DISPATCH_FLOAT_TYPES(va.scalar_type(), "merge_topk_cpu", [&] {
    const int32_t* ia_ptr = ia.const_data_ptr<int32_t>();
    const int32_t* ib_ptr = ib.const_data_ptr<int32_t>();
    const scalar_t* va_ptr = va.const_data_ptr<scalar_t>();
    const scalar_t* vb_ptr = vb.const_data_ptr<scalar_t>();
    const int64_t pa = padded_ascending_prefix(ia_ptr, ia.numel());
    const int64_t pb = padded_ascending_prefix(ib_ptr, ib.numel());
    if (pa >= 0 && pb >= 0) {
      merge_padded(ia_ptr, va_ptr, ia.numel(), pa, ib_ptr, vb_ptr, ib.numel(), pb, merged);
    } else {
      merge_sorted(ia_ptr, va_ptr, ia.numel(), ib_ptr, vb_ptr, ib.numel(), merged);
    }
    const int64_t size = merged.size;
    const std::vector<uint8_t> kept = size > k ? best_k(merged, k) : std::vector<uint8_t>(size, 1);
    int32_t* out_indices = indices.mutable_data_ptr<int32_t>();
    scalar_t* out_values = values.mutable_data_ptr<scalar_t>();
    int64_t out = 0;
    for (int64_t j = 0; j < size; ++j) {  // in the union's ascending order
      if (!kept[j]) continue;
      out_indices[out] = merged.indices[j];
      out_values[out] = static_cast<scalar_t>(merged.sums[j]);
      ++out;
    }
    union_size.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(size);
  });
  return {indices, values, union_size};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, CPU, m) { m.impl("merge_topk", &merge_topk_cpu); }

}  // namespace gtopk_ext::cpu
