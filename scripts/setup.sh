#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with pinned torch and triton, the test
# and demo dependencies, and gtopk_ext built in place (C++ CPU kernels; CUDA kernels when a toolkit is found).
# Run again, it does only what changed: the packages when requirements.txt changed, the build when csrc/, the
# build files or the build's environment changed (stamps in .venv/.setup/; delete them to redo a step).
#   GTOPK_EXT_CUDA=0 bash scripts/setup.sh   # skip the CUDA kernels (quick iteration)
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

packages=$(fingerprint "" requirements.txt)
if changed packages "$packages"; then
  echo "== installing dependencies (torch 2.14.1, triton 3.8.0, test and demo packages)"
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements.txt
  echo "$packages" > "$STAMPS/packages"
else
  echo "== dependencies: requirements.txt unchanged since they were installed"
fi

# The build's inputs: the sources, the build files, the packages it compiles against and its environment.
build=$(fingerprint "$PWD ${GTOPK_EXT_CUDA:-auto} ${TORCH_CUDA_ARCH_LIST:-} ${CUDA_HOME:-} $packages" \
  csrc setup.py pyproject.toml)
if changed build "$build" || ! compgen -G "gtopk_ext/_C*.so" > /dev/null; then
  echo "== building gtopk_ext (GTOPK_EXT_CUDA=${GTOPK_EXT_CUDA:-auto})"
  MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps -e .
  echo "$build" > "$STAMPS/build"
else
  echo "== gtopk_ext: csrc/, setup.py, pyproject.toml and the build's environment unchanged since it was built"
fi
python -c "import torch, gtopk_ext
cuda = torch._C._dispatch_has_kernel_for_dispatch_key('gtopk_ext::compact', 'CUDA')
print('gtopk_ext is built; CUDA kernels:', 'yes' if cuda else 'no')"
