#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with pinned torch and triton, the test
# and demo dependencies, and gtopk_ext built in place (C++ CPU kernels; CUDA kernels when a toolkit is found).
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
echo "== installing dependencies (torch 2.14.1, triton 3.8.0, test and demo packages)"
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
echo "== building gtopk_ext (GTOPK_EXT_CUDA=${GTOPK_EXT_CUDA:-auto})"
MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import torch, gtopk_ext
cuda = torch._C._dispatch_has_kernel_for_dispatch_key('gtopk_ext::compact', 'CUDA')
print('gtopk_ext is built; CUDA kernels:', 'yes' if cuda else 'no')"
