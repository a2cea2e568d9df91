#!/usr/bin/env bash
# Create .venv-triton: the interpreter tier's venv (issue 44), apart from .venv so that no other test sees
# triton / fla / mamba-ssm. torch stays the CPU build of scripts/constraints.txt; the Triton kernels run on
# the CPU under TRITON_INTERPRET=1 (tests/test_triton_interpret.py, tests/triton_shims.py).
#
#   bash scripts/setup_triton.sh    # exit 0: ready; non-zero: a step failed (its output says which)
#   VENV=/some/where bash scripts/setup_triton.sh
#
# mamba-ssm is built from source without its CUDA extension (MAMBA_SKIP_CUDA_BUILD) and without its
# dependencies: the Triton kernels need only torch, triton and einops; its declared tilelang, quack-kernels
# and nvidia-cutlass-dsl (about 0.5 GB, for its newest CUDA-only kernels) are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-triton}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
PINS=(-c scripts/constraints.txt "triton==3.7.1")
pip_install() {  # quiet; this machine's pip warns for every local index it cannot read
  "$PY" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_install --upgrade pip
pip_install "torch==2.13.0"  # the CPU build (an unpinned torch pulls a multi-GB CUDA build)
# the package and what the tier's tests import; not the main suite's transformer_lens / sae-lens
pip_install "${PINS[@]}" -e . pytest pytest-xdist beartype
pip_install "${PINS[@]}" "fla-core==0.6.0" "flash-linear-attention==0.6.0"
pip_install "${PINS[@]}" setuptools wheel packaging ninja  # mamba-ssm's build, without isolation
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
  pip_install --no-build-isolation --no-deps "mamba-ssm==2.3.2.post1"
"$PY" - <<'PY'
import importlib.metadata as md
print("setup_triton:", ", ".join(f"{p} {md.version(p)}" for p in
      ("torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "transformers")))
PY
