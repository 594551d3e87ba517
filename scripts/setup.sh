#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with pinned torch and triton, the test
# and demo dependencies, and gtopk_ext built in place, printing each source as it compiles (setup.py: the C++ CPU
# kernels; the CUDA kernels, several minutes, when torch sees a GPU or when asked).
# Run again, it does only what changed: the packages when requirements.txt changed, the build when csrc/, the
# build files or the build's environment changed (stamps in .venv/.setup/; delete them to redo a step).
#   FORCE_CUDA=1 bash scripts/setup.sh       # compile the CUDA kernels with no GPU (= GTOPK_EXT_CUDA=1, as CI)
#   GTOPK_EXT_CUDA=0 bash scripts/setup.sh   # skip them where torch sees a GPU (quick iteration)
#   TORCH_CUDA_ARCH_LIST="9.0" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMPS=.venv/.setup
mkdir -p "$STAMPS"

# The fingerprint of a step's inputs: the files' contents and the given strings.
fingerprint() {
  local strings=$1
  shift
  { printf '%s\n' "$strings"; find "$@" -type f -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1
}
# Whether a step must run: its stamp is missing or holds another fingerprint.
changed() { [ "$(cat "$STAMPS/$1" 2>/dev/null)" != "$2" ]; }
# Runs a command, saying every 30 s that it still runs (pip is silent for minutes while it unpacks torch).
with_heartbeat() {
  local status=0 beat
  (elapsed=0; while sleep 30; do elapsed=$((elapsed + 30)); echo "   ... still installing (${elapsed} s)"; done) &
  beat=$!
  "$@" || status=$?
  kill "$beat"
  return "$status"
}

packages=$(fingerprint "" requirements.txt)
if changed packages "$packages"; then
  echo "== installing dependencies (torch 2.14.1, triton 3.8.0, test and demo packages)"
  with_heartbeat python -m pip install -q --upgrade pip
  with_heartbeat python -m pip install -q -r requirements.txt
  echo "$packages" > "$STAMPS/packages"
else
  echo "== dependencies: requirements.txt unchanged since they were installed"
fi

# The build's inputs: the sources, the build files, the packages it compiles against and its environment (whether
# torch sees a GPU included: by default that decides the CUDA kernels).
gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
build=$(fingerprint "$PWD ${GTOPK_EXT_CUDA:-auto} ${FORCE_CUDA:-} ${TORCH_CUDA_ARCH_LIST:-} ${CUDA_HOME:-} $gpus \
  $packages" csrc setup.py pyproject.toml)
if changed build "$build" || ! compgen -G "gtopk_ext/_C*.so" > /dev/null; then
  echo "== building gtopk_ext (torch sees $gpus GPUs; GTOPK_EXT_CUDA=${GTOPK_EXT_CUDA:-auto} FORCE_CUDA=${FORCE_CUDA:-0})"
  MAX_JOBS=${MAX_JOBS:-2} bash scripts/pip_install.sh --no-build-isolation --no-deps -e .
  echo "$build" > "$STAMPS/build"
else
  echo "== gtopk_ext: csrc/, setup.py, pyproject.toml and the build's environment unchanged since it was built"
fi
python -c "import torch, gtopk_ext
cuda = torch._C._dispatch_has_kernel_for_dispatch_key('gtopk_ext::compact', 'CUDA')
print('gtopk_ext is built; CUDA kernels:', 'yes' if cuda else 'no')"
