"""Big checkpoints: peak memory and load time of a ~3B Llama and a ~1.3B Mamba-2 in bf16, and disk offload.

Glossary
    checkpoint  random weights (seeded) in HF's layout, bf16, written shard by shard (~1 GB each) with
                a model.safetensors.index.json into a temporary directory, deleted at the end; never
                committed. Llama: hidden 3072, 28 layers, 24 heads (8 kv), MLP 8192, vocab 32,000, untied
                (3.0B parameters, 6.0 GB). Mamba-2: d_model 2048, 48 layers, 64 heads of 64, d_state 128,
                vocab 50,288, tied (1.3B, 2.7 GB)
    peak        VmHWM minus VmRSS just before the load (imports done), the peak reset through
                /proc/self/clear_refs; every measurement in its own process, under an address-space
                limit (RLIMIT_AS, --limit-gb) so that a runaway load fails instead of swapping the machine
    ours        loaders.from_pretrained(dir): every tensor read once into its parameter
    ours-mmap   loaders.from_pretrained(dir, mmap=True): parameters are private memory maps of the
                files (nothing read at load; pages come in at the first forward), like HF's
    HF          transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16), same run, same
                directory, after ours (so both see the same page cache). Its parameters may stay backed by
                the memory-mapped files, whose pages count only once touched: its peak and time can be
                below a full read's
    offload     from_pretrained(dir, device_map="auto", max_memory={"cpu": --offload-gb}, offload_folder=):
                what does not fit stays on disk (read from the checkpoint's own files by accelerate at
                each forward); then one forward of 8 tokens, compared with ours fully loaded (bit-identical
                expected)

Targets: ours peak / checkpoint size <= 1.1, ours time / HF time <= 1, offload loads and answers.
Load time alone flatters the mapped loads (theirs and ours-mmap read at the first forward), so load +
first forward is printed too, for each of ours and ours-mmap against HF.

    python benchmarks/bench_big_checkpoint.py [--models llama mamba2] [--limit-gb 18] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_BYTES = 1 << 30
CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=3072,
                  intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                  tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "mamba2": dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], vocab_size=50288, hidden_size=2048,
                   num_hidden_layers=48, num_heads=64, head_dim=64, expand=2, state_size=128, n_groups=1,
                   chunk_size=256, tie_word_embeddings=True),
}
TOKENS = [[1, 415, 2936, 9060, 285, 1142, 754, 349]]


# ------------------------------------------------------------------------------------ checkpoint
def write_checkpoint(name: str, directory: Path, seed: int = 0, layers: int | None = None) -> int:
    """Random bf16 weights for CONFIGS[name] in HF's layout, written shard by shard; returns the bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(CONFIGS[name], dtype="bfloat16")
    if layers is not None:
        raw["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    weight_map = {}

    def flush() -> None:
        nonlocal size
        i = len(shards)
        file = f"model-{i:05d}.safetensors"
        save_file(shards[-1], str(directory / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shards[-1]})
        shards[-1] = {}
        shards.append({})
        size = 0

    for key, shape in shapes.items():
        if key.endswith("norm.weight") or key.endswith(".D"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shards[-1][key] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shards[-1]:
        flush()
    n = len(shards) - 1  # rename to HF's "-of-" names
    for i in range(1, n + 1):
        os.rename(directory / f"model-{i:05d}.safetensors", directory / f"model-{i:05d}-of-{n:05d}.safetensors")
    weight_map = {k: v.replace(".safetensors", f"-of-{n:05d}.safetensors") for k, v in weight_map.items()}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    return total


# ------------------------------------------------------------------------------- measured process
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def child(kind: str, path: str, out_dir: str, offload_gb: float) -> dict:
    """Runs in the measured process: imports, reset the peak, load (and for offload a forward)."""
    import gc

    import torch

    from loaders import from_pretrained
    from transformers import AutoModelForCausalLM

    import accelerate  # noqa: F401  imports are not the load's cost
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[json.loads((Path(path) / "config.json").read_text())["model_type"]]  # nor is its config class's

    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    if kind == "ours":
        model = from_pretrained(path)
    elif kind == "ours-mmap":
        model = from_pretrained(path, mmap=True)
    elif kind == "hf":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        folder = tempfile.mkdtemp(dir=out_dir)
        model = from_pretrained(path, device_map="auto", max_memory={"cpu": int(offload_gb * 2**30)},
                                offload_folder=folder)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - base
    result = {"kind": kind, "seconds": seconds, "peak": peak,
              "params": sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)}
    tokens = torch.tensor(TOKENS)
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(tokens)
    logits = logits if torch.is_tensor(logits) else logits.logits
    result["forward_seconds"] = time.perf_counter() - start  # the first forward: HF pages its weights in here
    result["peak_with_forward"] = _status("VmHWM") - base
    result["finite"] = bool(torch.isfinite(logits).all())
    torch.save(logits, Path(out_dir) / f"{kind}.pt")
    if kind == "offload":
        devices = model.hf_device_map
        result["disk_entries"] = sum(v == "disk" for v in devices.values())
        result["cpu_entries"] = sum(v == "cpu" for v in devices.values())
        result["offload_file_bytes"] = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    return result


def measure(kind: str, path: Path, out_dir: Path, limit_gb: float, offload_gb: float) -> dict:
    """One measurement in a fresh process under an address-space limit."""

    def limit() -> None:
        cap = int(limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path), str(out_dir), str(offload_gb)],
                         capture_output=True, text=True, preexec_fn=limit, env=env)
    if out.returncode:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"
        return {"kind": kind, "error": last}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(CONFIGS))
    ap.add_argument("--limit-gb", type=float, default=18.0, help="RLIMIT_AS of each measured process")
    ap.add_argument("--offload-gb", type=float, nargs="+", default=[1.5, 0.75], help="max_memory cpu per model")
    ap.add_argument("--keep", type=Path, default=None, help="reuse / keep checkpoints in this directory")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check of the script)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path, out_dir, offload_gb = args.child
        print(json.dumps(child(kind, path, out_dir, float(offload_gb))))
        return
    import torch

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_big_"))
    try:
        for name, offload_gb in zip(args.models, args.offload_gb * len(args.models)):
            d = root / name
            if not (d / "model.safetensors.index.json").is_file():
                d.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                size = write_checkpoint(name, d, layers=args.layers)
                print(f"{name}: wrote {size / 1e9:.2f} GB in {len(list(d.glob('*.safetensors')))} shards "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
            out_dir = Path(tempfile.mkdtemp(dir=root))
            rows = {k: measure(k, d, out_dir, args.limit_gb, offload_gb)
                    for k in ("ours", "ours-mmap", "hf", "offload")}
            for k, r in rows.items():
                if "error" in r:
                    print(f"  {k:9s} FAILED: {r['error']}", flush=True)
                    continue
                extra = ""
                if "forward_seconds" in r:
                    extra = (f", forward of 8 tokens {r['forward_seconds']:.1f} s (peak then "
                             f"{r['peak_with_forward'] / 1e9:.2f} GB, finite {r['finite']})")
                if k == "offload":
                    extra += (f"; {r['disk_entries']} modules on disk, {r['cpu_entries']} on cpu, offload file "
                              f"{r['offload_file_bytes'] / 1e9:.2f} GB, resident {r['params'] / 1e9:.2f} GB")
                print(f"  {name} {k:9s} load {r['seconds']:6.1f} s, peak {r['peak'] / 1e9:6.2f} GB = "
                      f"{r['peak'] / size:.3f} x checkpoint ({size / 1e9:.2f} GB){extra}", flush=True)
            ours, hf, off = rows["ours"], rows["hf"], rows["offload"]
            for k in ("ours", "ours-mmap"):
                if "error" not in rows[k] and "error" not in hf:
                    r = rows[k]
                    ready = (r["seconds"] + r["forward_seconds"]) / (hf["seconds"] + hf["forward_seconds"])
                    print(f"  {name}: {k}/HF load time {r['seconds'] / hf['seconds']:.2f}, load + first forward "
                          f"{ready:.2f}; {k} peak/checkpoint {r['peak'] / size:.3f} (with the forward "
                          f"{r['peak_with_forward'] / size:.3f})", flush=True)
            if "error" not in ours and "error" not in rows["ours-mmap"]:
                same = torch.equal(torch.load(out_dir / "ours.pt"), torch.load(out_dir / "ours-mmap.pt"))
                print(f"  {name}: mmap=True logits bit-identical to the copying load's: {same}", flush=True)
            if "error" not in ours and "error" not in off:
                same = torch.equal(torch.load(out_dir / "ours.pt"), torch.load(out_dir / "offload.pt"))
                print(f"  {name}: offloaded logits bit-identical to the fully loaded model's: {same}", flush=True)
            shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
