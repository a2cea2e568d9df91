#!/usr/bin/env bash
# README command 2: set up and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 MPLBACKEND=Agg
exec .venv/bin/python -m pytest -n 2 --dist loadfile -q "$@"
