"""The delta-rule ops at one Qwen3-Next layer's width: ratios measured in one run (1 thread, CPU time).

    OMP_NUM_THREADS=1 python benchmarks/bench_delta_rule.py [--pos 2048 4096 8192] [--rounds 2]

Glossary
    layer       one Gated DeltaNet layer of Qwen3-Next-80B's width: 16 q/k heads, 32 value heads,
                d_k = d_v = 128, batch 1, float32, random normalised q, k and decays in [0.5, 1)
    chunked     ops.delta_rule_chunked (the WY form, chunk 64): o and the final state
    hf          HF's torch_chunk_gated_delta_rule on the same inputs (q, k L2-normalised inside)
    sequential  ops.delta_rule_sequential (the loop), at the first pos only
    rows / cols ops.delta_rule_kernel_rows / _cols for the last 8 targets / first 8 sources;
                peak = glibc heap in use above the start, sampled after every aten op
                (bench_scan.peak_bytes), against the answer's own size (rows x pos x heads floats)
    kernel      the whole kernel would be 32 x pos^2 floats (8 GiB at pos 8192): not built here
Times are minimum CPU times over --rounds rounds, run round-robin.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.bench_scan import peak_bytes
from hooked.ops import delta_rule_chunked, delta_rule_kernel_cols, delta_rule_kernel_rows, delta_rule_sequential, l2norm

N_K, N_V, D_K, D_V, N_ROWS = 16, 32, 128, 128, 8


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


def inputs(seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    q, k = (torch.randn(1, seq_len, N_K, D_K, generator=g) for _ in range(2))
    return dict(q=q, k=k, v=torch.randn(1, seq_len, N_V, D_V, generator=g),
                beta=torch.rand(1, seq_len, N_V, generator=g), alpha=0.5 + 0.5 * torch.rand(1, seq_len, N_V, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pos", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    import inspect

    hf_rule = inspect.unwrap(torch_chunk_gated_delta_rule)
    print(f"== one Gated DeltaNet layer: {N_K} q/k heads, {N_V} value heads, d_k {D_K}, d_v {D_V}, float32 ==")
    print(f"{'pos':>6} {'chunked s':>10} {'hf / ours':>10} {'rows s':>8} {'rows/chunked':>13} {'cols s':>8} "
          f"{'rows MiB':>9} {'answer MiB':>11} {'kernel GiB':>11}")
    for n, seq_len in enumerate(args.pos):
        x = inputs(seq_len)
        q, k = l2norm(x["q"]) * D_K**-0.5, l2norm(x["k"])
        g = torch.log(x["alpha"])
        rows = torch.arange(seq_len - N_ROWS, seq_len)
        cols = torch.arange(N_ROWS)
        fns = {
            "chunked": lambda: delta_rule_chunked(q, k, x["v"], x["beta"], x["alpha"]),
            "hf": lambda: hf_rule(x["q"], x["k"], x["v"], g, x["beta"], use_qk_l2norm_in_kernel=True),
            "rows": lambda: delta_rule_kernel_rows(q, k, x["beta"], x["alpha"], rows),
            "cols": lambda: delta_rule_kernel_cols(q, k, x["beta"], x["alpha"], cols),
        }
        with torch.no_grad():
            t = best_times(fns, args.rounds)
            peak = peak_bytes(fns["rows"])
        print(f"{seq_len:6d} {t['chunked']:10.2f} {t['hf'] / t['chunked']:10.2f} {t['rows']:8.2f} "
              f"{t['rows'] / t['chunked']:13.2f} {t['cols']:8.2f} {peak / 2**20:9.1f} "
              f"{N_V * N_ROWS * seq_len * 4 / 2**20:11.1f} {N_V * seq_len**2 * 4 / 2**30:11.1f}")
        if n == 0:
            with torch.no_grad():
                seq = best_times({"sequential": lambda: delta_rule_sequential(q, k, x["v"], x["beta"], x["alpha"])}, 1)
            print(f"       sequential loop {seq['sequential']:.2f} s = {seq['sequential'] / t['chunked']:.1f} x chunked")


if __name__ == "__main__":
    main()
