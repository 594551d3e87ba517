#!/usr/bin/env bash
# `python -m pip install -v ARGS` showing, of pip's output, only the lines of gtopk_ext's build (what it compiles,
# and a line at least every 20 s while it does); pip's whole output goes to a file, whose last lines are printed on
# failure. scripts/setup.sh and .ci/wheel_check.sh build through it.
set -euo pipefail
log=$(mktemp -t gtopk_ext_pip.XXXXXX)
status=0
# (pip -v indents the build's lines)
python -m pip install -v "$@" 2>&1 | tee "$log" | sed -un -E 's/^[[:space:]]*(gtopk_ext: )/\1/p' || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 60 "$log" >&2
  echo "pip install failed (exit $status); its whole output: $log" >&2
  exit "$status"
fi
rm -f "$log"
