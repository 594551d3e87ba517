// Which host path the CUDA kernels take, from $GTOPK_EXT_CUDA_PATH, read once per process (host only):
//   fused (default)  a cached workspace that the kernels leave zeroed, each op's finishing step in the last block of
//                    its pass, outputs written in full (no fills): gaussian_select with update_residual is 5 launches
//                    and allocates only its outputs (csrc/cuda/select.cu counts them)
//   legacy           the path before it (fills, a finishing kernel per pass, temporaries allocated per call, the
//                    residual updated by the sorting scatter), kept until a GPU run confirms the fused one
// gtopk_ext._C.cuda_path() returns the name, so the choice can be checked and tested without a GPU.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

namespace gtopk_ext {

enum class CudaPath { kFused, kLegacy };

inline CudaPath parse_cuda_path(const char* value) {
  const std::string_view name = value == nullptr ? "" : value;
  if (name.empty() || name == "fused") return CudaPath::kFused;
  if (name == "legacy") return CudaPath::kLegacy;
  TORCH_CHECK(false, "GTOPK_EXT_CUDA_PATH must be fused (the default) or legacy, got '", name, "'");
}

// Read at the first call; an invalid value raises at every call (a static whose initialisation throws is retried).
inline CudaPath cuda_path() {
  static const CudaPath path = parse_cuda_path(std::getenv("GTOPK_EXT_CUDA_PATH"));
  return path;
}

inline const char* cuda_path_name(CudaPath path) { return path == CudaPath::kLegacy ? "legacy" : "fused"; }

}  // namespace gtopk_ext
