#!/usr/bin/env bash
# `python -m pip install -v ARGS` showing, of pip's output, only the lines of gtopk_ext's build (what it compiles,
# and a line at least every 20 s while it does); pip's whole output goes to $PIP_LOG (default: a temporary file),
# and on failure its last lines are printed. scripts/setup.sh and .ci/wheel_check.sh build through it.
set -euo pipefail
log=${PIP_LOG:-$(mktemp)}
status=0
python -m pip install -v "$@" 2>&1 | tee "$log" | { grep --line-buffered '^gtopk_ext: ' || true; } || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 60 "$log" >&2
  echo "pip install failed (exit $status); its whole output: $log" >&2
  exit "$status"
fi
