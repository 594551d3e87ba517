// What the CPU statistics pass hands to the selection (candidates recorded on the way) and the selection steps
// that compact and gaussian_select share: per-range sure/boundary lists and writing them into the outputs.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "lanes.h"

namespace gtopk_ext::cpu {

// An element whose |acc| passed its range's histogram floor: a candidate for the selection.
struct Candidate {
  int32_t index;
  float magnitude;
};

// The candidates of one parallel_for range [begin, end) of the statistics pass, ascending: every element whose
// |acc| was at or above the range's histogram floor when it was read. The floor only rises and never exceeds the
// final threshold (a range's own k largest lie at or below the k-th largest overall), so they include every
// element that the threshold selects. Past max_size the list is dropped (complete = false): reading acc again
// then costs less than the list.
struct RangeCandidates {
  int64_t begin = 0, end = 0, max_size = 0;
  bool complete = true;
  std::vector<Candidate> list;

  // Starts recording [begin, end) when the candidates of a range of independent values would fit in a sixteenth
  // of it: the floor, the k-th largest of the m elements read so far, passes about k / m of them, so about
  // k * (1 + ln(size / k)) elements plus the first chunk. Otherwise the list would cost as much as a second read.
  void start(int64_t range_begin, int64_t range_end, int64_t k) {
    begin = range_begin;
    end = range_end;
    const int64_t size = end - begin;
    max_size = size / 16;
    const double expected = kChunk + (k < size ? k * (1.0 + std::log(static_cast<double>(size) / k)) : size);
    complete = expected <= max_size;
    if (complete) list.reserve(static_cast<size_t>(expected));
  }

  void add(int64_t index, float magnitude) {
    if (!complete) return;
    if (static_cast<int64_t>(list.size()) == max_size) {
      complete = false;
      list = {};
      return;
    }
    list.push_back({static_cast<int32_t>(index), magnitude});
  }
};

// The pass of gaussian_threshold (see csrc/ops.cpp, threshold.cpp) over grad_contig (+ residual): returns its
// float32 stats. With candidates (and k > 0) it also records each parallel range's candidates, in range order.
at::Tensor statistics_pass(const at::Tensor& grad_contig, const std::optional<at::Tensor>& residual, double z,
                           int64_t k, std::vector<RangeCandidates>* candidates);

// The elements with |acc| >= thr of one contiguous range, split into the sure ones (|acc| >= sure_thr) and the
// boundary ones, each list ascending and cut at capacity entries (no range can contribute more).
struct RangeSelection {
  std::vector<int32_t> sure, boundary;
  int64_t sure_count = 0, boundary_count = 0;

  void add(int64_t index, bool is_sure, int64_t capacity) {
    std::vector<int32_t>& list = is_sure ? sure : boundary;
    int64_t& count = is_sure ? sure_count : boundary_count;
    if (count < capacity) list.push_back(static_cast<int32_t>(index));
    ++count;
  }
};

// The outputs of a selection from acc: values and indices of capacity padding slots (value 0, index 0), count.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_selection(const at::Tensor& acc, int64_t capacity) {
  return {at::zeros({capacity}, acc.options()), at::zeros({capacity}, acc.options().dtype(at::kInt)),
          at::empty({1}, acc.options().dtype(at::kInt))};
}

namespace {

template <typename scalar_t>
GTOPK_VECTOR_CLONES void select_range(const scalar_t* __restrict__ acc, int64_t begin, int64_t end, float thr,
                                      float sure_thr, int64_t capacity, RangeSelection& out) {
  out.sure.reserve(std::min(capacity, end - begin));
  out.boundary.reserve(std::min(capacity, end - begin));
  for_each_at_least(acc, begin, end, threshold_floor_bits(thr),
                    [&](int64_t i, float magnitude) { out.add(i, magnitude >= sure_thr, capacity); });
}

// select_range from the statistics pass's candidates of the range, or from acc when they are incomplete.
template <typename scalar_t>
void select_candidates(const RangeCandidates& candidates, const scalar_t* acc, float thr, float sure_thr,
                       int64_t capacity, RangeSelection& out) {
  if (!candidates.complete) {
    select_range(acc, candidates.begin, candidates.end, thr, sure_thr, capacity, out);
    return;
  }
  for (const Candidate& c : candidates.list) {
    if (c.magnitude >= thr) out.add(c.index, c.magnitude >= sure_thr, capacity);
  }
}

// Writes the ranges' selections (in index order) into values and indices, zero-filled with capacity slots: when
// more than capacity were selected, the sure ones first (see sure_threshold in histogram.h), then boundary ones in
// index order. Returns how many were selected before that cut.
template <typename scalar_t>
int64_t write_selection(const std::vector<RangeSelection>& ranges, const scalar_t* acc, int64_t capacity,
                        at::Tensor& values, at::Tensor& indices) {
  int64_t sure_total = 0, total = 0;
  for (const RangeSelection& range : ranges) {
    sure_total += range.sure_count;
    total += range.sure_count + range.boundary_count;
  }
  int64_t sure_left = std::min(sure_total, capacity);  // slots for sure candidates, then boundary ones
  int64_t boundary_left = capacity - sure_left;
  scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
  int32_t* indices_ptr = indices.mutable_data_ptr<int32_t>();
  int64_t out = 0;
  for (const RangeSelection& range : ranges) {
    const int64_t sure = std::min(range.sure_count, sure_left);
    const int64_t boundary = std::min(range.boundary_count, boundary_left);
    sure_left -= sure;
    boundary_left -= boundary;
    int64_t a = 0, b = 0;  // merge the two ascending lists
    while (a < sure || b < boundary) {
      const bool take_sure = b == boundary || (a < sure && range.sure[a] < range.boundary[b]);
      const int32_t idx = take_sure ? range.sure[a++] : range.boundary[b++];
      indices_ptr[out] = idx;
      values_ptr[out] = acc[idx];
      ++out;
    }
  }
  return total;
}

}  // namespace
}  // namespace gtopk_ext::cpu
