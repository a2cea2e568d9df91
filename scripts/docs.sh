#!/usr/bin/env bash
# The API reference (pdoc, offline) into site/: every module of hooked, loaders and analysis, and the tutorials.
# Fails on any pdoc warning (a module that does not import, a broken reference).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/build_docs.py "${1:-site}"
