"""Forward speed against what users run: ratios only, per family, batch 1 and 8, 512 and 2,048 tokens.

Glossary
    HF       the same random model in Hugging Face transformers as users get it: SDPA attention (its
             default), and for the SSM families mamba-ssm / causal-conv1d's kernels whenever they are
             importable (column "HF path": "kernels", else "torch", HF's own torch fallback)
    exact    our forward on the exact path (the sequential scans, eager attention: every hook available),
             `hooked.backends.use(scan="loop", attention="eager")`
    fast     our forward on the fast path, `hooked.backends.use(scan=<fused where mamba-ssm is importable,
             else chunked>, attention="sdpa")` (what a hook-free forward picks on CUDA)
    ratio    median of one model's times / median of another's, `--reps` runs each after a warm-up,
             interleaved (HF, exact, fast, HF, ...), each timed between device synchronisations; <1: faster
    rel err  max |fast - exact| / max |exact| over the logits (the same run; "-" without a fast path)

    python benchmarks/bench_gpu.py [--archs llama mamba ...] [--batches 1 8] [--seqs 512 2048] [--dtype bf16]
    python benchmarks/bench_gpu.py --tiny --device cpu --batches 1 --seqs 16   # smoke test, anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def configs(tiny: bool) -> dict:
    """About 100M-parameter models of each family (tiny: a few layers of width 32)."""
    import transformers as t

    w = 32 if tiny else 768
    n = 2 if tiny else 24
    return {
        "llama": t.LlamaConfig(vocab_size=256 if tiny else 32000, hidden_size=w if tiny else 1024,
                               intermediate_size=2 * w if tiny else 2816, num_hidden_layers=n if tiny else 16,
                               num_attention_heads=4 if tiny else 16, num_key_value_heads=2 if tiny else 4),
        "mamba": t.MambaConfig(vocab_size=256 if tiny else 50280, hidden_size=w, state_size=16, num_hidden_layers=n,
                               expand=2),
        "falcon_mamba": t.FalconMambaConfig(vocab_size=256 if tiny else 65024, hidden_size=w, state_size=16,
                                            num_hidden_layers=n, expand=2),
        "mamba2": t.Mamba2Config(vocab_size=256 if tiny else 50288, hidden_size=w, state_size=16 if tiny else 128,
                                 num_hidden_layers=n, expand=2, head_dim=16 if tiny else 64, num_heads=4 if tiny else 24,
                                 n_groups=1, chunk_size=16 if tiny else 256),
        "zamba2": t.Zamba2Config(vocab_size=256 if tiny else 32000, hidden_size=w, num_hidden_layers=3 if tiny else 12,
                                 layers_block_type=(["mamba", "hybrid", "mamba"] if tiny else
                                                    ["mamba"] * 5 + ["hybrid"] + ["mamba"] * 5 + ["hybrid"]),
                                 mamba_d_state=16 if tiny else 64, n_mamba_heads=4 if tiny else 24,
                                 mamba_headdim=16 if tiny else 64, num_attention_heads=4 if tiny else 12,
                                 intermediate_size=2 * w if tiny else 3072, chunk_size=16 if tiny else 256,
                                 max_position_embeddings=4096),
    }


def hf_model(cfg, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    try:  # what users get: SDPA where the family has it (a failed try marks the config: copies)
        hf = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    except (ValueError, ImportError):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    return hf.to(device, dtype).eval()


def paths(device: torch.device) -> tuple[Callable, Callable | None]:
    """(exact context, fast context or None) on `device`."""
    from hooked.ops.fused import fused_available

    try:
        from hooked import backends
    except ImportError:
        return contextlib.nullcontext, None
    exact = lambda: backends.use(scan="loop", attention="eager")  # noqa: E731
    fast = lambda: backends.use(scan="fused" if fused_available(device) else "chunked", attention="sdpa")  # noqa: E731
    return exact, fast


def hf_path(hf, device: torch.device) -> str:
    """How HF runs it: its attention implementation, and for SSM layers mamba-ssm's kernels or its torch path."""
    from hooked.ops.fused import fused_available

    parts = []
    if getattr(hf.config, "num_attention_heads", None) and hf.config.model_type not in ("mamba", "falcon_mamba"):
        parts.append(hf.config._attn_implementation)
    if hf.config.model_type in ("mamba", "falcon_mamba", "mamba2", "zamba2", "jamba", "bamba"):
        parts.append("kernels" if fused_available(device) else "torch")
    return "+".join(parts)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(runs: dict[str, Callable[[], object]], reps: int, device: torch.device) -> dict[str, float]:
    for run in runs.values():  # warm-up (kernels compiled, allocator filled)
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def row(arch: str, cfg, dtype: torch.dtype, batch: int, seq: int, reps: int, device: torch.device) -> str:
    from loaders import from_hf

    hf = hf_model(cfg, device, dtype)
    ours = from_hf(hf)
    exact, fast = paths(device)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def under(ctx):
        def run():
            with ctx():
                return ours(tokens)
        return run

    runs = {"hf": lambda: hf(tokens).logits, "exact": under(exact)}
    if fast is not None:
        runs["fast"] = under(fast)
    t = interleaved_medians(runs, reps, device)
    err = "-"
    if fast is not None:
        a, b = runs["fast"]().float(), runs["exact"]().float()
        err = f"{((a - b).abs().max() / b.abs().max()).item():.1e}"
    fast_hf = f"{t['fast'] / t['hf']:8.2f}" if fast is not None else f"{'-':>8s}"
    exact_fast = f"{t['exact'] / t['fast']:10.2f}" if fast is not None else f"{'-':>10s}"
    return (f"{arch:13s} {str(dtype)[6:]:9s} {batch:5d} {seq:6d}  {hf_path(hf, device):13s} {t['exact'] / t['hf']:8.2f} "
            f"{fast_hf} {exact_fast} {err:>8s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=None)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--seqs", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bf16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a smoke test of the script)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs CUDA (or --device cpu --tiny for a smoke test)")
    torch.set_grad_enabled(False)
    cfgs = configs(args.tiny)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; ratios of medians over {args.reps} interleaved runs (<1: faster)")
    print(f"{'family':13s} {'dtype':9s} {'batch':>5s} {'tokens':>6s}  {'HF path':13s} {'exact/HF':>8s} {'fast/HF':>8s} "
          f"{'exact/fast':>10s} {'rel err':>8s}")
    for arch in args.archs or list(cfgs):
        for dtype in (DTYPES[d] for d in args.dtype):
            for batch in args.batches:
                for seq in args.seqs:
                    try:
                        print(row(arch, cfgs[arch], dtype, batch, seq, args.reps, device), flush=True)
                    except torch.OutOfMemoryError:
                        print(f"{arch:13s} {str(dtype)[6:]:9s} {batch:5d} {seq:6d}  out of memory", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
