#!/usr/bin/env bash
# The README's first command: sets up .venv and gtopk_ext (scripts/setup.sh: the CUDA kernels only where torch sees
# a GPU or FORCE_CUDA=1), then trains the digits with DDP on 4 Gloo processes on the CPU: DDP's allreduce,
# fp16_compress_hook, PowerSGD and gtopk_ext's recipe (on the sparse path: the same table every run) at densities
# 0.01 and 0.001; as root each rank sits behind an emulated 1 Gbit/s link and the table has each method's seconds to
# 95% test accuracy (else it says why not, runs on loopback and shows the bytes). It prints the regime R it measured
# (DDP's exchange over the compute) and what its picture shows at that R. Table on stdout, plot and JSON in
# demo_out/. Flags go to the demo:
#   bash scripts/demo.sh --seeds 0 1 2 --epochs 10   (see --help; --loopback: no emulated links)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m bench.demo --rate 1gbit "$@"
