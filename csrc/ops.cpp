// The op schemas of gtopk_ext: the one place that defines what each op takes and returns. Argument checks and
// layout constants are in common.h; kernels in cpu/<family>.cpp and cuda/<family>.cu; the Python side of each
// op's contract (checks for the fakes and the Triton ops, layout, fakes) in gtopk_ext/_contract.py.
#include <Python.h>
#include <torch/library.h>

#include "common.h"

extern "C" {
// Importing gtopk_ext._C loads this library, which runs the TORCH_LIBRARY blocks below. The module carries the
// layout constants of common.h, which a test compares with gtopk_ext/_contract.py.
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
  // One pass over acc = grad (+ residual, which becomes acc in place). Returns float32[5]:
  // mean, std, max |acc| (NaN ignored), the Gaussian threshold |mean| + z * std, and the threshold to
  // use: the histogram threshold that keeps about k elements when k > 0, else the Gaussian one.
  m.def("gaussian_threshold(Tensor grad, Tensor(a!)? residual, float z, int k) -> Tensor");
  // (values[capacity], int32 indices[capacity], int32 count[1]) of the elements with |acc| >= threshold[0],
  // indices ascending; count is the number of such elements before truncation to capacity; the slots past
  // it are padding (index 0, value 0). When more than capacity pass, those >= sure_threshold(threshold)
  // (common.h) are kept first, then the others in index order.
  m.def("compact(Tensor acc, Tensor threshold, int capacity) -> (Tensor, Tensor, Tensor)");
  // gaussian_threshold(grad, residual, z, k) with k >= 1, its threshold refined, then compact(acc, stats[4:5],
  // capacity), in one call: returns (values, indices, count, stats), stats[4] being the refined threshold. The
  // refinement counts the elements of the threshold's histogram bin by the next 13 bits of their pattern and
  // moves the threshold to the lower edge of the sub-bin (32 float patterns) holding the k-th largest |acc|
  // (common.h fine_threshold), so the count reaches k within that sub-bin's ties even when the bin holds many
  // more than k. The CPU kernel counts and selects from the candidates that its statistics pass recorded
  // instead of reading acc again (while they fit in a sixteenth of the data: about density < 0.01).
  m.def(
      "gaussian_select(Tensor grad, Tensor(a!)? residual, float z, int k, int capacity) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  // gTop-k's merge of two sparse sets: the union of their slots' indices (padding slots join index 0), each
  // index's values summed in float32 in slot order (a's slots, then b's), the k largest |sums| kept (NaN first;
  // ties to the lower index), by ascending index and padded with (0, 0). Returns (int32 indices[k], values[k]
  // in values_a's dtype, int32 union_size[1]). CPU kernel only: on a GPU, gtopk_ext.ops.merge_topk merges
  // with torch's sort and unique, which are fast there.
  m.def(
      "merge_topk(Tensor indices_a, Tensor values_a, Tensor indices_b, Tensor values_b, int k) -> "
      "(Tensor, Tensor, Tensor)");
  // dense[indices[j]] += values[j], duplicates summed. Out-of-range indices are skipped, never written;
  // returns int32[1], how many were skipped.
  m.def("scatter_add(Tensor(a!) dense, Tensor indices, Tensor values) -> Tensor");
  // residual[indices[j]] -= values[j]: what was sent leaves the residual (exactly zero when values came
  // from compact on this residual). Same index rules and return value as scatter_add.
  m.def("residual_update(Tensor(a!) residual, Tensor indices, Tensor values) -> Tensor");
  // The compact wire (common.h): the first used = clamp(count[0], 0, k) slots of a message whose indices ascend
  // within [0, numel) as (float16 halves[k]: value * 2^shift, int16 low[k]: index & 0xFFFF, int32
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
