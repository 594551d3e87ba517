#!/usr/bin/env bash
# The README's first command: sets up .venv and gtopk_ext (scripts/setup.sh), then trains the digits with DDP on
# 4 Gloo processes on the CPU: dense allreduce, gtopk_ext's recipe at densities 0.01 and 0.001 and plain Gaussian-k
# + gTop-k; table on stdout, plot and JSON in demo_out/. Flags go to the demo:
#   bash scripts/demo.sh --seeds 0 1 2 --epochs 10   (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m bench.demo "$@"
