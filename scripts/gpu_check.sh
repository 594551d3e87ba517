#!/usr/bin/env bash
# On a machine with a GPU: builds gtopk_ext in place with the CUDA kernels for that GPU, using the machine's own
# python3 (no venv, no package index), then runs, each step logged:
#   bench  bench.selection --device cuda for the CUDA kernels and for the compiled Triton ones, and a profile
#          of each at 25M elements, d = 0.001 (kernels, their device time, launches per step)
#   ops    the op tests on CUDA tensors (both backends against gtopk_ext/reference.py, opcheck, torch.compile)
#   hook   the DDP hook with two processes on the one GPU (Gloo with CUDA tensors): tests/test_gpu.py
#   suite  the rest of the test suite
#     bash scripts/gpu_check.sh [OUT_DIR [STEP ...]]     # default: gpu_check/ and build bench ops hook suite
# It needs torch with CUDA, triton, pytest, pytest-timeout, hypothesis and expecttest (torch.library.opcheck).
# OUT_DIR receives summary.txt (each step's exit status and seconds), one log per step and the benchmark's
# JSON rows. A step that fails does not stop the next; the script's status is that of the worst step.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-gpu_check}")
shift || true
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build bench ops hook suite)
mkdir -p "$out"
python=${PYTHON:-python3}
unset TRITON_INTERPRET  # compiled Triton kernels, not the interpreter
export PYTHONUNBUFFERED=1

arch=$($python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || {
  echo "gpu_check: torch sees no GPU" | tee "$out/summary.txt"
  exit 1
}

build() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $python -c 'import sys, torch, triton
print(sys.version.split()[0], torch.__version__, triton.__version__, "cxx11 abi:", torch._C._GLIBCXX_USE_CXX11_ABI)'
  "${CXX:-c++}" --version | head -1
  GTOPK_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    $python -m pip install --no-index --no-build-isolation --no-deps -v -e . &&
    $python -c 'from gtopk_ext import backends; assert backends.cuda_kernels_built(), "no CUDA kernels"; print("built")' &&
    # A failing TORCH_CHECK must reach Python as an error (a C++ ABI other than torch's crashes there instead).
    $python -c 'import torch, gtopk_ext
try:
    torch.ops.gtopk_ext.compact(torch.randn(8), torch.ones(1), 0)
except RuntimeError as error:
    print("a failing check raises:", str(error).splitlines()[0])'
}

bench() {
  local status=0 backend
  for backend in cuda triton; do
    $python -m bench.selection --device cuda --backend "$backend" --repeats 15 \
      --json "$out/selection_$backend.json" || status=$?
    $python -m bench.selection --device cuda --backend "$backend" --profile --sizes 25000000 \
      --densities 0.001 || status=$?
  done
  return $status
}

# One pytest per file, each test named as it starts (-v): a crash names its test and spares the other files.
ops() {
  local status=0 file
  for file in tests/test_ops.py tests/test_triton_path.py tests/test_backends.py tests/test_compressors.py; do
    $python -m pytest -v -ra -p no:cacheprovider --timeout=900 "$file" || status=$?
  done
  return $status
}

hook() {
  $python -m pytest -q -ra -p no:cacheprovider --timeout=900 tests/test_gpu.py
}

suite() {
  $python -m pytest -q -ra -p no:cacheprovider --timeout=900 tests \
    --ignore tests/test_ops.py --ignore tests/test_triton_path.py --ignore tests/test_backends.py \
    --ignore tests/test_compressors.py --ignore tests/test_gpu.py
}

worst=0
for step in "${steps[@]}"; do
  echo "== $step"
  start=$SECONDS
  "$step" 2>&1 | tee "$out/$step.log"
  status=${PIPESTATUS[0]}
  echo "$step: exit $status, $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  [ "$status" -gt "$worst" ] && worst=$status
done
exit "$worst"
