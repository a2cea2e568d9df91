"""Whole-model SSM benchmarks: ratios to Hugging Face measured in one run on this machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_ssm.py [--seq 256] [--rounds 5] [--cache-layers 2]

Glossary
    HF slow path   transformers' torch implementation (what runs without mamba-ssm / causal-conv1d
                   kernels, i.e. always on CPU), forward with use_cache=False, float32, no grad
    ours           the hooked model loaded from the same random HF model with `from_hf`
    forward ratio  ours.forward / HF forward, both at the 130M size (24 layers, d_model 768,
                   vocab ~50k), batch 1, seq 256; target <= 1.0
    cache ratio    run_with_cache(every hook) / forward of ours, measured on the blocks only
                   (start_at_layer=0, stop_at_layer=n) of a model of the same width and
                   `--cache-layers` layers: caching every hook of all 24 layers does not fit in
                   memory (Mamba-1 hook_head_out is b*l*d_inner*d_model floats, 1.2 GB per layer
                   at seq 256; its kernel 0.4 GB), and the per-layer ratio is what the depth repeats

Times are the minimum CPU time (time.process_time, 1 thread) over `--rounds` rounds, the models
timed round-robin so that load from other processes falls on all of them alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers

from loaders.load import from_hf

MAMBA1_130M = dict(hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4, vocab_size=50280)
MAMBA2_130M = dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, expand=2, state_size=128,
                   n_groups=1, conv_kernel=4, chunk_size=256, vocab_size=50288)


def best_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Min CPU time of each function, round-robin (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def build(kind: str, **overrides) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(HF model, our model) with the same random weights; None if ours is not there."""
    torch.manual_seed(0)
    if kind == "mamba1":
        hf_cfg = transformers.MambaConfig(**{**MAMBA1_130M, **overrides})
        hf = transformers.MambaForCausalLM(hf_cfg).eval()
    else:
        hf_cfg = transformers.Mamba2Config(**{**MAMBA2_130M, **overrides})
        hf = transformers.Mamba2ForCausalLM(hf_cfg).eval()
    try:
        return hf, from_hf(hf)
    except (ImportError, ValueError) as e:  # an architecture not written yet
        print(f"({kind}: no hooked model: {e})")
        return None


def forward_ratio(kind: str, seq: int, rounds: int) -> None:
    models = build(kind)
    if models is None:
        return
    hf, ours = models
    tokens = torch.randint(0, ours.cfg.d_vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens, use_cache=False).logits
        diff = ((ours(tokens) - ref).abs().max() / ref.abs().max()).item()
        times = best_times({"hf": lambda: hf(tokens, use_cache=False), "ours": lambda: ours(tokens)}, rounds)
    print(f"{kind:7s} forward   HF {times['hf'] * 1e3:8.1f} ms   ours {times['ours'] * 1e3:8.1f} ms   "
          f"ratio {times['ours'] / times['hf']:5.2f}   (logits: max |diff| / max |HF| = {diff:.1e})")
    del hf, ours


def cache_ratio(kind: str, seq: int, rounds: int, layers: int) -> None:
    models = build(kind, num_hidden_layers=layers)
    if models is None:
        return
    _, ours = models
    resid = torch.randn(1, seq, ours.cfg.d_model, generator=torch.Generator().manual_seed(2))
    blocks = dict(start_at_layer=0, stop_at_layer=layers)
    names = [n for n in ours.hook_dict if n.startswith("blocks.")]

    def cached() -> None:
        _, cache = ours.run_with_cache(resid, names_filter=names, **blocks)
        del cache

    with torch.no_grad():
        times = best_times({"forward": lambda: ours(resid, **blocks), "cache": cached}, rounds)
        _, cache = ours.run_with_cache(resid, names_filter=names, **blocks)
        size = sum(t.numel() * t.element_size() for t in cache.values()) / 2**20
        del cache
    print(f"{kind:7s} blocks    forward {times['forward'] * 1e3:8.1f} ms   run_with_cache(all {len(names)} hooks, "
          f"{size:.0f} MiB) {times['cache'] * 1e3:8.1f} ms   ratio {times['cache'] / times['forward']:5.2f}   "
          f"({layers} layers)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread, seq {args.seq}, batch 1")
    for kind in ("mamba1", "mamba2"):
        forward_ratio(kind, args.seq, args.rounds)
    for kind in ("mamba1", "mamba2"):
        cache_ratio(kind, args.seq, args.rounds, args.cache_layers)


if __name__ == "__main__":
    main()
