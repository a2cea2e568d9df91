"""Cost of editing recurrent states (hook_h), as ratios to a clean forward that caches hook_h (one run).

    python benchmarks/bench_state_edits.py [--seq 256] [--reps 5] [--family mamba mamba2 qwen3_next]

For each family (a random model of a few layers, float32): the clean forward with every hook_h cached,
then the same forward where a hook on every hook_h returns (a) another prompt's whole trajectory (every
position set: the standard activation patch of a state), (b) the received states with two positions
zeroed (two segments continued). Timings alternate between the contenders and take the median of `reps`.
The issue's bound: (a) at most 1.5x the cached forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from loaders.load import from_hf

CONFIGS = {
    "mamba": lambda: transformers.MambaConfig(vocab_size=512, hidden_size=256, state_size=16, num_hidden_layers=4,
                                              expand=2),
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=512, hidden_size=256, num_heads=8, head_dim=64,
                                                state_size=64, n_groups=1, num_hidden_layers=4, chunk_size=64),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, layer_types=["linear_attention"] * 4,
        num_experts=0, mlp_only_layers=[0, 1, 2, 3]),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--family", nargs="*", default=list(CONFIGS))
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    for family in args.family:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
        model = from_hf(hf).eval()
        names = [n for n in model.hook_dict if n.endswith("mixer.hook_h")]
        tokens, other = (torch.randint(0, 512, (1, args.seq)) for _ in range(2))
        _, donor = model.run_with_cache(other, names_filter=names)

        def zero_two(h, hook):
            h = h.clone()
            h[:, [args.seq // 3, 2 * args.seq // 3]] = 0
            return h
        contenders = {
            "cache_h": lambda: model.run_with_cache(tokens, names_filter=names),
            "patch_every_position": lambda: model.run_with_hooks(
                tokens, fwd_hooks=[(n, lambda h, hook: donor[hook.name]) for n in names]),
            "zero_two_positions": lambda: model.run_with_hooks(tokens, fwd_hooks=[(n, zero_two) for n in names]),
        }
        for fn in contenders.values():  # warm up
            fn()
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(args.reps):
            for name, fn in contenders.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["cache_h"])
        ratios = ", ".join(f"{k} {statistics.median(v) / base:.2f}x" for k, v in times.items() if k != "cache_h")
        print(f"{family} (seq {args.seq}, {len(names)} state hooks): {ratios} the forward with hook_h cached")


if __name__ == "__main__":
    main()
