#!/usr/bin/env bash
# GPU check in one call, on a machine that reaches no package registry (issue 16).
#
#   bash scripts/gpu_check.sh --fetch   # HERE, with network: download the wheels into .whl/ (ignored by git)
#   bash scripts/gpu_check.sh           # THERE, on the GPU machine: install .whl/ offline into /tmp/site,
#                                       # run the GPU tests, print ours/HF forward speed ratios
#
# The GPU machine is expected to have python3 with a CUDA torch (and numpy, einops, jaxtyping,
# safetensors, pytest); the wheels bring the versions this project pins, or what that image lacks.
# Nothing is installed from the network there: pip runs with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
# What the image lacks or has in another version: transformers is pinned by this project, and needs
# tokenizers 0.23; the image's huggingface_hub (1.33, within transformers' ">=1.31") is kept.
PINS=(transformers==5.24.0 tokenizers==0.23.3 accelerate==1.16.0 beartype==0.23.1 gguf==0.19.0)

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$WHEELS"
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${PINS[@]}"
  ls -la "$WHEELS"
  exit 0
fi

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $WHEELS: run 'bash scripts/gpu_check.sh --fetch' where pip reaches PyPI first" >&2
  exit 2
fi
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
$PY - <<'EOF'
import torch, transformers, accelerate
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible: the GPU tests would only skip")
print("device:", torch.cuda.get_device_name())
EOF

status=0
echo "== GPU tests (parity on cuda, bf16 and float32; device_map across cuda:0 and cpu)"
$PY -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_dispatch.py tests/test_parity_gpt2.py \
  tests/test_parity_llama.py tests/test_parity_mamba.py tests/test_parity_mamba2.py tests/test_parity_zamba2.py \
  || status=$?

echo "== forward speed, ours / HF, per architecture (bf16 and float32)"
$PY benchmarks/bench_gpu.py || status=$?
exit $status
