"""Generation speed with and without the incremental state, as ratios measured in one run.

    python benchmarks/bench_generate.py [--prompt 64] [--new 32] [--reps 3] [--models gpt2,llama,mamba,mamba2,zamba2]

For each architecture (small random models of one width, so the comparison is the decoding
strategy, not the weights): greedy tokens/s with `use_past_kv_cache=True` (one position per new
token) over `use_past_kv_cache=False` (the whole prefix every step), the median of `reps`
alternating runs. Also checks that both give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hooked.models.gpt2 import GPT2Config
from hooked.models.llama import LlamaConfig
from hooked.models.mamba import MambaConfig
from hooked.models.mamba2 import Mamba2Config
from hooked.models.zamba2 import Zamba2Config
from hooked.models.families import build

D, LAYERS, VOCAB = 256, 4, 1000
MODELS = {
    "gpt2": lambda: build(GPT2Config(n_layers=LAYERS, d_model=D, n_heads=8, d_mlp=4 * D, d_vocab=VOCAB, n_ctx=1024)),
    "llama": lambda: build(LlamaConfig(n_layers=LAYERS, d_model=D, n_heads=8, n_kv_heads=2, d_mlp=3 * D, d_vocab=VOCAB)),
    "mamba": lambda: build(MambaConfig(n_layers=LAYERS, d_model=D, d_vocab=VOCAB)),
    "mamba2": lambda: build(Mamba2Config(n_layers=LAYERS, d_model=D, n_heads=8, d_head=64, d_state=64,
                                                chunk_size=64, d_vocab=VOCAB)),
    "zamba2": lambda: build(Zamba2Config(n_layers=LAYERS, layer_types=("mamba", "hybrid", "mamba", "hybrid"),
                                                d_model=D, d_vocab=VOCAB, n_heads=8, d_state=64, chunk_size=64,
                                                n_attn_heads=8, d_mlp=3 * D)),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"prompt {args.prompt} tokens, {args.new} new tokens, median of {args.reps}")
    print(f"{'model':8} {'state tok/s':>12} {'recompute tok/s':>16} {'ratio':>7}  same tokens")
    for name in args.models.split(","):
        model = MODELS[name]().eval()
        prompt = torch.randint(0, VOCAB, (1, args.prompt))
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for _ in range(args.reps):
            for cached in (True, False):
                t0 = time.perf_counter()
                outs[cached] = model.generate(prompt, max_new_tokens=args.new, do_sample=False, stop_at_eos=False,
                                              use_past_kv_cache=cached)
                times[cached].append(time.perf_counter() - t0)
        fast, slow = (args.new / statistics.median(times[c]) for c in (True, False))
        print(f"{name:8} {fast:12.1f} {slow:16.1f} {fast / slow:7.2f}  {torch.equal(outs[True], outs[False])}")


if __name__ == "__main__":
    main()
