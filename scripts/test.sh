#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the test suite: the kernels on the CPU and, under the Triton
# interpreter, the Triton path; compressors, collectives and the DDP hook on real Gloo process groups; WAGMA;
# a smoke run of the benchmarks; and the CMake build.
#   GTOPK_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 bash scripts/test.sh   # what CI runs: the .cu files must build
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
echo "== lint: ruff (pyproject.toml), clang-format (.clang-format)"
ruff check .
find csrc \( -name '*.h' -o -name '*.cpp' -o -name '*.cuh' -o -name '*.cu' \) -print0 | xargs -0 clang-format --dry-run --Werror
# Two pytest workers (PYTEST_WORKERS; 0: one process): most tests keep one core busy at a time (the Triton
# interpreter, the reference kernels, one rank's Python), so a second worker uses the second core. Every test
# makes its own rendezvous file and pid-named namespaces: the workers share no port and no name.
echo "== pytest"
python -m pytest tests -q -ra --timeout=900 --durations=20 -n "${PYTEST_WORKERS:-2}" --dist worksteal "$@"
echo "== CMake build"
bash .ci/cmake_check.sh
