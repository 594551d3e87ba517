#!/usr/bin/env bash
# Builds CMakeLists.txt (CPU kernels only, to keep CI fast) in a temporary folder with the python on PATH, then
# loads the built library in a fresh Python process that does not import gtopk_ext and checks the ops on tiny
# hand-computed cases: the CMake build must register working ops by itself.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$(command -v python3 || command -v python)"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"

echo "cmake_check: configuring $repo in $build (GTOPK_EXT_CUDA=0, python $python, torch at $prefix)"
cmake -S "$repo" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" -DPython_EXECUTABLE="$python" -DGTOPK_EXT_CUDA=0 \
  --log-level=WARNING
echo "cmake_check: building"
cmake --build "$build" -j "$(nproc)"
library="$build/libgtopk_ext.so"
echo "cmake_check: loading $library without importing gtopk_ext, checking the ops"
"$python" - "$library" <<'PY'
import sys

import torch

torch.ops.load_library(sys.argv[1])
assert "gtopk_ext" not in sys.modules, "the check must use the CMake-built library, not the package"
ops = torch.ops.gtopk_ext

acc = torch.tensor([0.5, -2.0, 1.0, -0.25, 3.0])
values, indices, count = ops.compact(acc, torch.tensor([1.0]), 4)
assert values.tolist() == [-2.0, 1.0, 3.0, 0.0] and indices.tolist() == [1, 2, 4, 0] and count.tolist() == [3], (
    values, indices, count)

stats = ops.gaussian_threshold(torch.tensor([1.0, -1.0, 1.0, -1.0]), None, 2.0, 0)
assert stats.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0], stats  # mean, std, max |x|, |mean| + 2 std, threshold

dense = torch.zeros(4)
invalid = ops.scatter_add(dense, torch.tensor([1, 3, 1, 7], dtype=torch.int32), torch.tensor([1.0, 2.0, 0.5, 9.0]))
assert dense.tolist() == [0.0, 1.5, 0.0, 2.0] and invalid.tolist() == [1], (dense, invalid)
print("cmake_check: compact, gaussian_threshold and scatter_add give the hand-checked results")
PY
echo "cmake_check: OK"
