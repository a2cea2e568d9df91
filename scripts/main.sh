#!/usr/bin/env bash
# README command 1: set up and run the main job (knockout information flow on SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MPLBACKEND=Agg
exec .venv/bin/hooked knockout smollm2-135m --n 100 --out out/knockout "$@"
