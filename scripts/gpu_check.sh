#!/usr/bin/env bash
# GPU check in one call, on a box that reaches no package registry and may hold nothing but torch (issue 29).
# The wheels include fla's (pure Python; its Triton kernels need the box's triton, which comes with CUDA torch).
#
#   bash scripts/gpu_check.sh --fetch [3.12 ...]   # HERE, with PyPI: the wheels of scripts/gpu_requirements.txt
#                                                  # into .whl/ (ignored by git) for those Pythons (default 3.12;
#                                                  # any of 3.10-3.13; about 47 MiB for one)
#   bash scripts/gpu_check.sh                      # THERE: install what the box lacks (or has older) from .whl/,
#                                                  # offline, into $SITE; run every gpu-marked test file; then
#                                                  # benchmarks/bench_gpu.py (ratios against HF as users run it)
#
# Environment: PY (python3), WHEELS (.whl), SITE (/tmp/site), BENCH_ARGS (extra bench_gpu.py arguments),
# SKIP_BENCH=1 (tests only). The requirement list is `python scripts/gpu_wheels.py freeze` of the tested
# environment; torch and its own dependencies are the box's.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}

if [ "${1:-}" = "--fetch" ]; then
  shift
  exec $PY scripts/gpu_wheels.py fetch --wheels "$WHEELS" "$@"
fi

$PY scripts/gpu_wheels.py install --wheels "$WHEELS" --target "$SITE" || {
  echo "could not install the missing wheels from $WHEELS: run 'bash scripts/gpu_check.sh --fetch' where pip" \
       "reaches PyPI (for this box's Python), and carry $WHEELS" >&2
  exit 2
}
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
$PY - <<'EOF'
import dataclasses, sys, torch, transformers, accelerate
from hooked.ops.fused import mamba_ssm_kernels
k = mamba_ssm_kernels()
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, transformers "
      f"{transformers.__version__}, accelerate {accelerate.__version__}; kernels (mamba-ssm, causal-conv1d, fla): "
      f"{[f.name for f in dataclasses.fields(k) if callable(getattr(k, f.name))] or 'none'}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible: the GPU tests would only skip")
print("device:", torch.cuda.get_device_name())
EOF

status=0
mapfile -t FILES < <(grep -lE '@pytest\.mark\.gpu|pytestmark *=.*gpu' tests/test_*.py)
echo "== GPU tests: every gpu-marked test of ${#FILES[@]} files"
$PY -m pytest -q -p no:cacheprovider -m gpu -rs "${FILES[@]}" || status=$?

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== forward speed: ours (exact path, fast path) / HF as users run it"
  # shellcheck disable=SC2086
  $PY benchmarks/bench_gpu.py ${BENCH_ARGS:-} || status=$?
fi
exit $status
