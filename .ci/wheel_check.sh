#!/usr/bin/env bash
# Installs gtopk_ext as a user does, from what a clean clone holds (the tracked files, with this working tree's
# edits): `pip install --no-build-isolation .` into a fresh virtual environment that has only the pinned torch,
# numpy and the build tools; the CPU kernels only (the test build compiles the .cu files). Then, in a folder
# outside the source tree: imports the installed package, checks that every package of the source tree was
# installed, lists the ops and backends, and runs the README's quick start at 2 ranks.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
torch_pin="$(grep -E '^torch==' "$repo/requirements.txt")"
unset PYTHONPATH FORCE_CUDA  # nothing of the source tree on sys.path; the CPU build below

echo "wheel_check: the tracked files of $repo into $work/src"
mkdir "$work/src" "$work/run"
git -C "$repo" ls-files -z | tar -C "$repo" --null -T - --ignore-failed-read -cf - | tar -C "$work/src" -xf -

echo "wheel_check: a fresh virtual environment ($python -m venv) with $torch_pin, numpy, setuptools, wheel, ninja"
"$python" -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
python -m pip install -q --no-compile "$torch_pin" numpy setuptools wheel ninja
echo "wheel_check: installed in $SECONDS s; pip install --no-build-isolation . (GTOPK_EXT_CUDA=0)"
(cd "$work/src" && GTOPK_EXT_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} bash scripts/pip_install.sh --no-build-isolation --no-compile .)

cd "$work/run"
echo "wheel_check: after $SECONDS s, importing gtopk_ext in $PWD"
python - "$work/src" <<'PY'
import importlib.util
import sys
import sysconfig
from pathlib import Path

import torch

import gtopk_ext as gx
from gtopk_ext import backends

site = Path(sysconfig.get_paths()["purelib"]).resolve()
src = Path(sys.argv[1])
assert Path(gx.__file__).resolve().is_relative_to(site), f"gtopk_ext came from {gx.__file__}, not from {site}"
# Every package of the source tree, installed (a package missing from the wheel fails only outside the tree).
packages = sorted(".".join(init.relative_to(src).parent.parts) for init in src.glob("gtopk_ext/**/__init__.py"))
packages.append("gtopk_ext.triton_kernels")  # triton_kernels/
for name in packages:
    spec = importlib.util.find_spec(name)
    assert spec is not None and Path(spec.origin).resolve().is_relative_to(site), f"{name} is not installed: {spec}"
print(f"wheel_check: gtopk_ext from {Path(gx.__file__).parent}; packages: {', '.join(packages)}")

registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("gtopk_ext::")}
missing = [op for op in backends.Backend.ops if op not in registered and op != "merge_topk"]
assert not missing, f"ops without a registered kernel: {missing}"
for op in sorted(registered):
    keys = [key for key in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(f"gtopk_ext::{op}", key)]
    print(f"  op gtopk_ext::{op:<20} kernels: {', '.join(keys) or 'none'}")
for backend in backends.ALL:
    reasons = backend.not_supported_reasons(torch.device("cpu"))
    print(f"  backend {backend.name:<7} on CPU tensors: {'runs' if not reasons else '; '.join(reasons)}")
assert not backends.CPU.not_supported_reasons(torch.device("cpu"))
PY

echo "wheel_check: the quick start at 2 ranks (CPU, Gloo), as README.md runs it"
CUDA_VISIBLE_DEVICES="" torchrun --nproc-per-node 2 "$work/src/examples/quickstart.py" | tee "$work/quickstart.log"
grep -q "^SparseGradState: " "$work/quickstart.log"
echo "wheel_check: OK in $SECONDS s"
