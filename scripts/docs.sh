#!/usr/bin/env bash
# Builds the API reference from the docstrings with pdoc into build/api/ (git ignores build/): open
# build/api/index.html. pdoc imports gtopk_ext, so the extension must be built first (scripts/setup.sh; CI runs
# this after the tests). Installs pdoc (docs/requirements.txt) into the active environment when it is missing.
#   bash scripts/docs.sh            # with .venv/ when there is one
#   PYTHON=python3 bash scripts/docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import pdoc" 2>/dev/null || "$PYTHON" -m pip install -q -r docs/requirements.txt
rm -rf build/api
# google: the docstrings' "Args:" sections; pdoc also renders their reST roles (:func:, :class:) as links.
"$PYTHON" -m pdoc --docformat google --no-show-source -o build/api gtopk_ext
echo "== API reference: build/api/index.html"
