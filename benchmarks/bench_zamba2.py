"""Zamba2 benchmark: ratios to Hugging Face measured in one run on this machine (bench_ssm.py's harness).

    OMP_NUM_THREADS=1 python benchmarks/bench_zamba2.py [--seq 256] [--rounds 5]

Glossary
    small config   ZAMBA2_SMALL below: d_model 512, 8 layers of which 3 hybrid (2 shared blocks
                   cycled, q/k/v adapters of rank 32, rotary), 16 SSM heads of 64, d_state 64,
                   8 attention heads of 128, d_mlp 2048, vocab 32000, chunk 256; float32, batch 1
    HF             transformers' Zamba2ForCausalLM, eager attention, torch SSM path (no mamba-ssm
                   kernels on CPU), use_cache=False, no grad
    ours           our Zamba2 loaded from the same random HF model with `from_hf`
    forward ratio  ours.forward / HF forward; target <= 1.0
    cache ratio    run_with_cache(every hook of the blocks) / forward of ours, on the blocks only
                   (start_at_layer=0, stop_at_layer=n, tokens= for the shared blocks' embedding)

Times are the minimum CPU time (time.process_time, 1 thread) over `--rounds` rounds, round-robin.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from bench_ssm import best_times

from loaders.load import from_hf

M, H = "mamba", "hybrid"
ZAMBA2_SMALL = dict(hidden_size=512, num_hidden_layers=8, layers_block_type=[M, M, H, M, M, H, M, H], n_mamba_heads=16,
                    mamba_d_state=64, mamba_ngroups=1, mamba_expand=2, num_attention_heads=8, intermediate_size=2048,
                    num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=32, use_mem_rope=True,
                    vocab_size=32000, chunk_size=256)


def build() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.Zamba2Config(**ZAMBA2_SMALL)
    config._attn_implementation = "eager"
    hf = transformers.Zamba2ForCausalLM(config).eval()
    return hf, from_hf(hf)


def forward_ratio(hf: torch.nn.Module, ours: torch.nn.Module, seq: int, rounds: int) -> None:
    tokens = torch.randint(0, ours.cfg.d_vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens, use_cache=False).logits
        diff = ((ours(tokens) - ref).abs().max() / ref.abs().max()).item()
        times = best_times({"hf": lambda: hf(tokens, use_cache=False), "ours": lambda: ours(tokens)}, rounds)
    print(f"zamba2  forward   HF {times['hf'] * 1e3:8.1f} ms   ours {times['ours'] * 1e3:8.1f} ms   "
          f"ratio {times['ours'] / times['hf']:5.2f}   (logits: max |diff| / max |HF| = {diff:.1e})")


def cache_ratio(ours: torch.nn.Module, seq: int, rounds: int) -> None:
    n = ours.cfg.n_layers
    tokens = torch.randint(0, ours.cfg.d_vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    resid = torch.randn(1, seq, ours.cfg.d_model, generator=torch.Generator().manual_seed(2))
    blocks = dict(start_at_layer=0, stop_at_layer=n, tokens=tokens)
    names = [name for name in ours.hook_dict if name.startswith("blocks.")]

    def cached() -> None:
        _, cache = ours.run_with_cache(resid, names_filter=names, **blocks)
        del cache

    with torch.no_grad():
        times = best_times({"forward": lambda: ours(resid, **blocks), "cache": cached}, rounds)
        _, cache = ours.run_with_cache(resid, names_filter=names, **blocks)
        size = sum(t.numel() * t.element_size() for t in cache.values()) / 2**20
        del cache
    print(f"zamba2  blocks    forward {times['forward'] * 1e3:8.1f} ms   run_with_cache(all {len(names)} hooks, "
          f"{size:.0f} MiB) {times['cache'] * 1e3:8.1f} ms   ratio {times['cache'] / times['forward']:5.2f}   "
          f"({n} layers)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread, seq {args.seq}, batch 1")
    hf, ours = build()
    forward_ratio(hf, ours, args.seq, args.rounds)
    cache_ratio(ours, args.seq, args.rounds)


if __name__ == "__main__":
    main()
