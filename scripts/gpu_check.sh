#!/usr/bin/env bash
# shellcheck disable=SC2317  # the phases are functions called by name
# On a machine with a GPU (a lent one has its own torch, triton and python3, and no network): builds gtopk_ext in
# place with the CUDA kernels for that GPU, then checks it in phases, in this order, each bounded in time and the
# whole run within GPU_CHECK_BUDGET seconds (default 540: a lent machine runs one call for at most 10 minutes; what
# does not fit is reported as skipped, to be run in a second call by naming it):
#   build    python setup.py build_ext --inplace (GTOPK_EXT_CUDA=1, this GPU's arch); the versions -> versions.json
#   ops      the op tests on CUDA tensors for the CUDA and Triton backends (against gtopk_ext/reference.py, CUDA
#            graphs, the launch budget), one pytest process per file so that a crash names its file; the cases of
#            the CPU backend (CI runs those) are left out unless GPU_CHECK_ALL_TESTS=1
#   hook     the DDP hook with two processes on the one GPU: tests/test_gpu.py
#   graph    scripts/gpu_selection.py: Gaussian-k compress with error feedback on the CUDA kernels and the Triton
#            ones at 25M and 100M elements, d = 0.001: kernels, launches and allocations per call, host syncs, and
#            the time eager and captured in a CUDA graph against x.add_(y) (CUDA events, median of 15) ->
#            selection.json, selection.md
#   bench    python -m bench.selection --device cuda for each backend, and its --profile at 25M, d = 0.001
#     bash scripts/gpu_check.sh [--dry-run] [OUT_DIR [PHASE ...]]   # OUT_DIR: default $OUT, else gpu_check/
# Phases named without build get it first when the CUDA kernels are not built (a fresh machine).
# --dry-run runs every phase on the CPU instead (no GPU needed), to check this script: no build (the extension
# must be built already), pytest only collects, gpu_selection.py and bench.selection run small sizes on the CPU.
# OUT_DIR ends up with at most 5 files (a lent machine returns 8): summary.txt (each phase's status and seconds),
# versions.json, selection.json, selection.md and logs.tar.gz (every phase's log, pytest's per file, the benchmark's
# JSON), written again after each phase so that a run stopped at its limit still returns what it did. A failing
# phase does not stop the next; the exit status is the worst phase's. Wheels in .whl/ (pytest plugins missing
# there, say) are installed into a folder on PYTHONPATH first.
set -uo pipefail
cd "$(dirname "$0")/.." || exit

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
out=$(realpath -m "${1:-${OUT:-gpu_check}}")
shift || true
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(build ops hook graph bench)
mkdir -p "$out"
logs=$(mktemp -d)
python=${PYTHON:-python3}
# GTOPK_EXT_PRINT_FAILURES (tests/conftest.py): a failure's traceback as it happens, in case a crash follows.
export PYTHONUNBUFFERED=1 GTOPK_EXT_PRINT_FAILURES=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${GPU_CHECK_BUDGET:-540}
deadline=$((SECONDS + budget))

if [ "$dry_run" = 1 ]; then
  device=cpu
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
else
  device=cuda
  unset TRITON_INTERPRET  # the compiled Triton kernels, not the interpreter
  if ! arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())'); then
    echo "gpu_check: torch sees no GPU" | tee "$out/summary.txt"
    exit 1
  fi
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

# Seconds a step may run: its own cap, within what is left of the budget (less a reserve for packing); at least 1
# (`timeout 0` would not limit it at all).
limit() {
  local left=$((deadline - SECONDS - 15))
  left=$((left < $1 ? left : $1))
  echo $((left < 1 ? 1 : left))
}

pack() {
  tar -czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
}

# One pytest process per file under `timeout`, its log named after the file; extra arguments go to pytest.
pytest_file() {
  local file=$1 cap=$2 log
  shift 2
  log="$logs/pytest_$(basename "$file" .py).log"
  if [ "$dry_run" = 1 ]; then
    set -- --collect-only "$@"
  fi
  timeout -k 10 "$(limit "$cap")" "$python" -m pytest -v -ra -p no:cacheprovider --timeout="$cap" "$file" "$@" \
    >"$log" 2>&1
  local status=$?
  echo "$file: exit $status, $(tail -1 "$log")"
  return "$status"
}

build() {
  # The system's compiler, not the image's CC/CXX: on the lent H200 those are a wrapper (/opt/gcc/bin/g++) whose
  # extension crashes at the first failing TORCH_CHECK that formats a number; /usr/bin/g++, the same GCC 13.3,
  # builds one that raises.
  local cc=${GPU_CHECK_CC:-/usr/bin/gcc} cxx=${GPU_CHECK_CXX:-/usr/bin/g++}
  if [ ! -x "$cc" ] || [ ! -x "$cxx" ]; then
    cc=${CC:-gcc}
    cxx=${CXX:-g++}
  fi
  GPU_CHECK_BUILD_CXX=$cxx "$python" - <<'EOF' >"$out/versions.json"
import json, os, platform, shutil, subprocess, sys
from importlib import metadata
import torch
versions = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cxx11_abi": torch._C._GLIBCXX_USE_CXX11_ABI, "machine": platform.machine()}
try:
    import triton
    versions["triton"] = triton.__version__
except ImportError:
    versions["triton"] = None
if torch.cuda.is_available():
    versions.update(gpu=torch.cuda.get_device_name(), capability="%d.%d" % torch.cuda.get_device_capability(),
                    multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count)
def output(*command):
    if shutil.which(command[0]) is None:
        return []
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout.strip().splitlines() if result.returncode == 0 else []
versions["driver"] = next(iter(output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")), None)
versions["nvcc"] = next((line for line in output("nvcc", "--version") if "release" in line), None)
versions["cxx"] = next(iter(output(os.environ["GPU_CHECK_BUILD_CXX"], "--version")), None)
versions["git_commit"] = next(iter(output("git", "rev-parse", "HEAD")), None)
for dist in ("pytest", "pytest-timeout", "hypothesis", "numpy", "expecttest"):
    try:
        versions[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        versions[dist] = None
print(json.dumps(versions, indent=1))
EOF
  cat "$out/versions.json"
  if [ "$dry_run" = 1 ]; then
    echo "dry run: would run CC=$cc CXX=$cxx GTOPK_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=<arch> $python setup.py build_ext" \
      "--inplace"
  else
    CC=$cc CXX=$cxx GTOPK_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      timeout -k 10 "$(limit 300)" "$python" setup.py build_ext --inplace || return
  fi
  # An in-place build has no editable install to map gtopk_ext.triton_kernels to triton_kernels/ (.gitignore'd link).
  [ -e gtopk_ext/triton_kernels ] || ln -s ../triton_kernels gtopk_ext/triton_kernels
  "$python" -c 'import gtopk_ext, gtopk_ext.triton_kernels as triton_kernels; from gtopk_ext import backends
print("built: CUDA kernels", backends.cuda_kernels_built(), gtopk_ext.__file__, triton_kernels.__file__)' || return
  # A failing TORCH_CHECK must reach Python as an error (an extension of another C++ ABI, or of the wrapper above,
  # crashes there instead).
  "$python" -c 'import torch, gtopk_ext
try:
    torch.ops.gtopk_ext.compact(torch.randn(8), torch.ones(1), 0)
except RuntimeError as error:
    print("a failing check raises:", str(error).splitlines()[0])'
}

graph() {
  local cap args=(--device "$device" --json "$out/selection.json" --markdown "$out/selection.md")
  if [ "$dry_run" = 1 ]; then
    args+=(--sizes 20000 --repeats 3)
  fi
  cap=$(limit 240)
  # Two backends, each in its own process with half of the phase's time.
  timeout -k 10 "$cap" "$python" scripts/gpu_selection.py "${args[@]}" --timeout "$((cap / 2))"
}

# The GPU backends' cases (a module's name counts: all of test_triton_path), less the Triton build for sm_80 and
# sm_90 without a GPU, which CI runs.
GPU_CASES="(cuda or triton or gpu or devices) and not builds_for_sm80"

ops() {
  local status=0 file cap select=(-k "$GPU_CASES")
  [ "${GPU_CHECK_ALL_TESTS:-0}" = 1 ] && select=()
  for file in tests/test_ops.py tests/test_triton_path.py tests/test_wire.py tests/test_backends.py tests/test_compressors.py; do
    case $file in
      */test_ops.py) cap=180 ;;
      */test_triton_path.py) cap=150 ;;
      *) cap=60 ;;
    esac
    pytest_file "$file" "$cap" "${select[@]}" || status=$?
  done
  return "$status"
}

hook() {
  pytest_file tests/test_gpu.py 200
}

bench() {
  local status=0 backend sizes=() repeats=15
  if [ "$dry_run" = 1 ]; then
    sizes=(--sizes 5000 --densities 0.01)
    repeats=2
  fi
  for backend in cuda triton; do
    [ "$dry_run" = 1 ] && [ "$backend" = cuda ] && backend=cpu
    timeout -k 10 "$(limit 90)" "$python" -m bench.selection --device "$device" --backend "$backend" \
      --repeats "$repeats" "${sizes[@]}" --json "$logs/bench_selection_$backend.json" || status=$?
    timeout -k 10 "$(limit 60)" "$python" -m bench.selection --device "$device" --backend "$backend" --profile \
      --sizes "$([ "$dry_run" = 1 ] && echo 5000 || echo 25000000)" --densities 0.001 || status=$?
  done
  return "$status"
}

: >"$out/summary.txt"
worst=0
if [ "$dry_run" = 0 ] && [[ " ${phases[*]} " != *" build "* ]] &&
  ! "$python" -c 'from gtopk_ext import backends; assert backends.cuda_kernels_built()' 2>/dev/null; then
  phases=(build "${phases[@]}")
fi
for phase in "${phases[@]}"; do
  if ! declare -F "$phase" >/dev/null || [ "$phase" = limit ] || [ "$phase" = pack ] || [ "$phase" = pytest_file ]; then
    echo "$phase: no such phase" | tee -a "$out/summary.txt"
    worst=2
    continue
  fi
  if [ "$(limit 1000)" -lt 20 ]; then
    echo "$phase: skipped, the budget of $budget s is spent" | tee -a "$out/summary.txt"
    worst=$((worst > 1 ? worst : 1))
    continue
  fi
  echo "== $phase"
  start=$SECONDS
  "$phase" 2>&1 | tee "$logs/$phase.log"
  status=${PIPESTATUS[0]}
  echo "$phase: exit $status, $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  [ "$status" -gt "$worst" ] && worst=$status
  pack
done
rm -rf "$logs"
exit "$worst"
