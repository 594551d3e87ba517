// The contract of each gtopk_ext op, in one place: its schema (what it takes and returns) and its Meta kernel (the
// argument checks and the outputs' shapes). Every other backend's kernel runs the Meta kernel's checks first
// (dispatch.h OpChecks); torch.compile's fake tensors run it in place of a kernel; the Triton ops
// (gtopk_ext/triton_kernels/ops.py) take the schemas and run the checks through gtopk_ext/_contract.py. Kernels
// are in cpu/<family>.cpp and cuda/<family>.cu, the layout in layout.h.
#include <ATen/ops/empty.h>
#include <Python.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "checks.h"
#include "layout.h"
#include "wire_format.h"

extern "C" {
// Importing gtopk_ext._C loads this library, which runs the TORCH_LIBRARY blocks below. The module carries the
// layout constants of layout.h, which a test compares with gtopk_ext/_contract.py.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  const struct {
    const char* name;
    long value;
  } constants[] = {
      // clang-format off
      {"STAT_MEAN", gtopk_ext::kStatMean},
      {"STAT_STD", gtopk_ext::kStatStd},
      {"STAT_MAX_ABS", gtopk_ext::kStatMaxAbs},
      {"STAT_GAUSSIAN_THRESHOLD", gtopk_ext::kStatGaussianThreshold},
      {"STAT_THRESHOLD", gtopk_ext::kStatThreshold},
      {"NUM_STATS", gtopk_ext::kNumStats},
      {"HIST_SHIFT", gtopk_ext::kHistShift},
      {"HIST_BINS", gtopk_ext::kHistBins},
      {"HIST_INF_KEY", gtopk_ext::kHistInfKey},
      {"FINE_SHIFT", gtopk_ext::kFineShift},
      {"FINE_BINS", gtopk_ext::kFineBins},
      {"SCATTER_TILE", gtopk_ext::kScatterTile},
      {"WIRE_PAGE_SHIFT", gtopk_ext::kWirePageShift},
      {"WIRE_SHIFT_MAX", gtopk_ext::kWireShiftMax},
      {"WIRE_SHIFT_BASE", gtopk_ext::kWireShiftBase},
      {"WIRE_HALF_NAN", gtopk_ext::kWireHalfNan},
      {"WIRE_FLOAT_NAN", gtopk_ext::kWireFloatNan},
      // clang-format on
  };
  for (const auto& constant : constants) {
    if (PyModule_AddIntConstant(module, constant.name, constant.value) != 0) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
}

TORCH_LIBRARY(gtopk_ext, m) {
  // One pass over acc = grad (+ residual, which becomes acc in place). Returns float32[kNumStats]:
  // mean, std, max |acc| (NaN ignored), the Gaussian threshold |mean| + z * std, and the threshold to
  // use: the histogram threshold that keeps about k elements when k > 0, else the Gaussian one.
  m.def("gaussian_threshold(Tensor grad, Tensor(a!)? residual, float z, int k) -> Tensor");
  // (values[capacity], int32 indices[capacity], int32 count[1]) of the elements with |acc| >= threshold[0],
  // indices ascending; count is the number of such elements before truncation to capacity; the slots past
  // it are padding (index 0, value 0). When more than capacity pass, those >= sure_threshold(threshold)
  // (histogram.h) are kept first, then the others in index order.
  m.def("compact(Tensor acc, Tensor threshold, int capacity) -> (Tensor, Tensor, Tensor)");
  // gaussian_threshold(grad, residual, z, k) with k >= 1, its threshold refined, then compact of acc at it, in
  // one call: returns (values, indices, count, stats), stats[kStatThreshold] being the refined threshold. The
  // refinement moves the threshold to the lower edge of the sub-bin (32 float patterns) of its histogram bin that
  // holds the k-th largest |acc| (histogram.h fine_threshold), so the count reaches k within that sub-bin's ties
  // even when the bin holds many more than k. update_residual (with a residual): what was selected then leaves
  // it, as residual_update(residual, indices, values) would do: each stored slot's element becomes acc - value,
  // +0.0 (NaN for an infinity), with no sort (the indices are unique); error feedback in one call.
  m.def(
      "gaussian_select(Tensor grad, Tensor(a!)? residual, float z, int k, int capacity, bool update_residual=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // gTop-k's merge of two sparse sets: the union of their slots' indices (padding slots join index 0), each
  // index's values summed in float32 in slot order (a's slots, then b's), the k largest |sums| kept (NaN first;
  // ties to the lower index), by ascending index and padded with (0, 0). Returns (int32 indices[k], values[k]
  // in values_a's dtype, int32 union_size[1]).
  m.def(
      "merge_topk(Tensor indices_a, Tensor values_a, Tensor indices_b, Tensor values_b, int k) -> "
      "(Tensor, Tensor, Tensor)");
  // dense[indices[j]] += values[j], duplicates summed. Out-of-range indices are skipped, never written;
  // returns int32[1], how many were skipped.
  m.def("scatter_add(Tensor(a!) dense, Tensor indices, Tensor values) -> Tensor");
  // residual[indices[j]] -= values[j]: what was sent leaves the residual (exactly zero when values came
  // from compact on this residual). Same index rules and return value as scatter_add.
  m.def("residual_update(Tensor(a!) residual, Tensor indices, Tensor values) -> Tensor");
  // The compact wire (wire_format.h): the first used = clamp(count[0], 0, k) slots of a message whose indices
  // ascend within [0, numel) as (float16 halves[k]: value * 2^shift, int16 low[k]: index & 0xFFFF, int32
  // pages[num_pages + 1]: pages[p] = the used slots with index < p << 16, int32 shift[1]); slots past used
  // are (0, 0).
  m.def("wire_encode(Tensor indices, Tensor values, Tensor count, int numel) -> (Tensor, Tensor, Tensor, Tensor)");
  // Its inverse: (int32 indices[k], float32 values[k], int32 invalid[1]). invalid counts what shows a corrupted
  // message: a shift out of range, a page table that does not ascend from 0 to used, a low that does not
  // ascend within its page, an index >= numel; such slots come out as (0, 0), so nothing downstream is written
  // out of bounds. Slots past used are (0, 0).
  m.def(
      "wire_decode(Tensor halves, Tensor low, Tensor pages, Tensor shift, Tensor count, int numel) -> "
      "(Tensor, Tensor, Tensor)");
}

namespace gtopk_ext {
namespace {

// The Meta kernels: each op's argument checks, then outputs of the right dtype and shape on the meta device.
// A failed check raises RuntimeError with the op's name, the argument's name and what it must be.

at::TensorOptions on_meta(at::ScalarType dtype) { return at::TensorOptions().dtype(dtype).device(at::kMeta); }

at::Tensor stats_output() { return at::empty({kNumStats}, on_meta(at::kFloat)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> selection_outputs(const at::Tensor& acc, int64_t capacity) {
  return {at::empty({capacity}, on_meta(acc.scalar_type())), at::empty({capacity}, on_meta(at::kInt)),
          at::empty({1}, on_meta(at::kInt))};
}

void check_gaussian_threshold_args(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k, const char* op) {
  check_float_tensor(grad, op, "grad");
  TORCH_CHECK(std::isfinite(z), op, ": z must be finite, got ", z);
  TORCH_CHECK(z >= 0.0, op, ": z must be >= 0 (the Gaussian threshold is |mean| + z * std), got ", z);
  TORCH_CHECK(k >= 0, op, ": k must be >= 0 (0: Gaussian threshold only), got ", k);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.scalar_type() == grad.scalar_type(), op, ": residual must have grad's dtype (", grad.scalar_type(),
                "), got ", r.scalar_type());
    TORCH_CHECK(r.sym_sizes() == grad.sym_sizes(), op, ": residual must have grad's shape ", grad.sym_sizes(), ", got ",
                r.sym_sizes());
    check_same_device(r, grad, op, "residual", "grad");
    check_mutable_contiguous(r, op, "residual");
  }
}

at::Tensor gaussian_threshold_meta(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z,
                                   int64_t k) {
  check_gaussian_threshold_args(grad, residual, z, k, "gaussian_threshold");
  return stats_output();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_meta(const at::Tensor& acc, const at::Tensor& threshold,
                                                            int64_t capacity) {
  constexpr const char* op = "compact";
  check_float_tensor(acc, op, "acc");
  TORCH_CHECK(threshold.scalar_type() == at::kFloat && threshold.sym_numel() == 1, op,
              ": threshold must be a float32 tensor of one element, got ", threshold.scalar_type(), " with ",
              threshold.sym_numel(), " elements");
  check_same_device(threshold, acc, op, "threshold", "acc");
  check_capacity(capacity, op);
  return selection_outputs(acc, capacity);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gaussian_select_meta(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, double z, int64_t k, int64_t capacity,
    bool /*update_residual*/) {
  constexpr const char* op = "gaussian_select";
  check_gaussian_threshold_args(grad, residual, z, k, op);
  TORCH_CHECK(k >= 1, op, ": k must be >= 1 (it selects at the histogram threshold), got ", k);
  check_capacity(capacity, op);
  auto [values, indices, count] = selection_outputs(grad, capacity);
  return {values, indices, count, stats_output()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_topk_meta(const at::Tensor& indices_a, const at::Tensor& values_a,
                                                               const at::Tensor& indices_b, const at::Tensor& values_b,
                                                               int64_t k) {
  constexpr const char* op = "merge_topk";
  check_sparse_set(indices_a, values_a, values_a, op, "indices_a", "values_a", "values_a");
  check_sparse_set(indices_b, values_b, values_a, op, "indices_b", "values_b", "values_a");
  TORCH_CHECK(values_b.scalar_type() == values_a.scalar_type(), op, ": values_b must have values_a's dtype (",
              values_a.scalar_type(), "), got ", values_b.scalar_type());
  check_capacity(k, op, "k");
  return {at::empty({k}, on_meta(at::kInt)), at::empty({k}, on_meta(values_a.scalar_type())),
          at::empty({1}, on_meta(at::kInt))};
}

at::Tensor signed_scatter_meta(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values,
                               const char* op, const char* dense_name) {
  check_float_tensor(dense, op, dense_name);
  check_mutable_contiguous(dense, op, dense_name);
  TORCH_CHECK(indices.scalar_type() == at::kInt, op, ": indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.dim() == 1, op, ": indices must be 1-D, got ", indices.dim(), "-D");
  TORCH_CHECK(values.scalar_type() == dense.scalar_type(), op, ": values must have ", dense_name, "'s dtype (",
              dense.scalar_type(), "), got ", values.scalar_type());
  TORCH_CHECK(values.sym_sizes() == indices.sym_sizes(), op, ": values must have indices' shape ", indices.sym_sizes(),
              ", got ", values.sym_sizes());
  check_same_device(indices, dense, op, "indices", dense_name);
  check_same_device(values, dense, op, "values", dense_name);
  return at::empty({1}, on_meta(at::kInt));
}

at::Tensor scatter_add_meta(const at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_meta(dense, indices, values, "scatter_add", "dense");
}

at::Tensor residual_update_meta(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values) {
  return signed_scatter_meta(residual, indices, values, "residual_update", "residual");
}

void check_wire_count(const at::Tensor& count, const at::Tensor& ref, const char* op, const char* ref_name) {
  TORCH_CHECK(count.scalar_type() == at::kInt && count.sym_numel() == 1, op,
              ": count must be an int32 tensor of one element, got ", count.scalar_type(), " with ", count.sym_numel(),
              " elements");
  check_same_device(count, ref, op, "count", ref_name);
}

void check_wire_numel(int64_t numel, const char* op) {
  TORCH_CHECK(numel >= 1 && numel <= std::numeric_limits<int32_t>::max(), op, ": numel must be in [1, 2^31 - 1], got ",
              numel);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> wire_encode_meta(const at::Tensor& indices,
                                                                            const at::Tensor& values,
                                                                            const at::Tensor& count, int64_t numel) {
  constexpr const char* op = "wire_encode";
  check_sparse_set(indices, values, values, op, "indices", "values", "values");
  check_wire_count(count, values, op, "values");
  check_wire_numel(numel, op);
  const c10::SymInt k = values.sym_numel();
  return {at::empty_symint({k}, on_meta(at::kHalf)), at::empty_symint({k}, on_meta(at::kShort)),
          at::empty({wire_num_pages(numel) + 1}, on_meta(at::kInt)), at::empty({1}, on_meta(at::kInt))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wire_decode_meta(const at::Tensor& halves, const at::Tensor& low,
                                                                const at::Tensor& pages, const at::Tensor& shift,
                                                                const at::Tensor& count, int64_t numel) {
  constexpr const char* op = "wire_decode";
  TORCH_CHECK(halves.scalar_type() == at::kHalf && halves.dim() == 1, op, ": halves must be a 1-D float16 tensor, got ",
              halves.scalar_type(), " of ", halves.dim(), " dimensions");
  TORCH_CHECK(low.scalar_type() == at::kShort && low.sym_sizes() == halves.sym_sizes(), op,
              ": low must be an int16 tensor of halves' shape ", halves.sym_sizes(), ", got ", low.scalar_type(),
              " of shape ", low.sym_sizes());
  check_wire_numel(numel, op);
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.dim() == 1 && pages.sym_numel() == wire_num_pages(numel) + 1, op,
              ": pages must be a 1-D int32 tensor of ", wire_num_pages(numel) + 1, " elements (numel = ", numel,
              "), got ", pages.scalar_type(), " of shape ", pages.sym_sizes());
  TORCH_CHECK(shift.scalar_type() == at::kInt && shift.sym_numel() == 1, op,
              ": shift must be an int32 tensor of one element, got ", shift.scalar_type(), " with ", shift.sym_numel(),
              " elements");
  check_wire_count(count, halves, op, "halves");
  check_same_device(low, halves, op, "low", "halves");
  check_same_device(pages, halves, op, "pages", "halves");
  check_same_device(shift, halves, op, "shift", "halves");
  const c10::SymInt k = halves.sym_numel();
  return {at::empty_symint({k}, on_meta(at::kInt)), at::empty_symint({k}, on_meta(at::kFloat)),
          at::empty({1}, on_meta(at::kInt))};
}

}  // namespace

TORCH_LIBRARY_IMPL(gtopk_ext, Meta, m) {
  m.impl("gaussian_threshold", &gaussian_threshold_meta);
  m.impl("compact", &compact_meta);
  m.impl("gaussian_select", &gaussian_select_meta);
  m.impl("merge_topk", &merge_topk_meta);
  m.impl("scatter_add", &scatter_add_meta);
  m.impl("residual_update", &residual_update_meta);
  m.impl("wire_encode", &wire_encode_meta);
  m.impl("wire_decode", &wire_decode_meta);
}

}  // namespace gtopk_ext
