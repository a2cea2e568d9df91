"""rank_heads with prefix reuse vs without, as a ratio measured in one run (target >= 1.5x).

    python benchmarks/bench_rank_heads.py [--arch llama|mamba2] [--layers 8] [--d-model 128] [--reps 3]
                                          [--model smollm2-135m --units 18]

Prefix reuse: ablating a unit of layer l cannot change the residual entering layer l, so it is
computed once per layer and every ablated scoring pass runs blocks l..n-1 only. Without reuse,
every pass runs the whole model. With units spread evenly over the layers the ideal ratio is about
2n / (n + 1) of the block cost; embedding and unembedding (done only at scored positions) dilute it
little. The two contenders alternate and the median of `reps` is taken, so machine noise hits both.
Both must give identical rankings (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def tiny_model(arch: str, layers: int, d_model: int):
    import transformers

    from analysis.tasks.text import char_tokenizer
    from loaders import from_hf

    tok = char_tokenizer()
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=d_model, intermediate_size=4 * d_model,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.Mamba2Config(vocab_size=128, hidden_size=d_model, num_hidden_layers=layers,
                                           state_size=16, expand=2, head_dim=d_model // 2, num_heads=4,
                                           n_groups=1, chunk_size=64)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = from_hf(hf)
    model.tokenizer = tok
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "mamba2"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--model", default=None, help="a real model instead (e.g. smollm2-135m)")
    parser.add_argument("--units", type=int, default=None, help="rank only every k-th unit so that N remain")
    parser.add_argument("--pairs", type=int, default=5, help="dictionary size")
    parser.add_argument("--n", type=int, default=6, help="prompts")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    from analysis.ga.ranking import head_units, rank_heads
    from analysis.tasks.text import kv_retrieval

    torch.set_grad_enabled(False)
    if args.model:
        from loaders import from_pretrained

        model = from_pretrained(args.model)
    else:
        model = tiny_model(args.arch, args.layers, args.d_model)
    examples = kv_retrieval(args.pairs, args.n, seed=0)
    units = head_units(model)
    if args.units:
        units = units[:: max(1, len(units) // args.units)]
    times: dict[bool, list[float]] = {True: [], False: []}
    rows: dict[bool, list] = {}
    for _ in range(args.reps):
        for reuse in (True, False):
            t0 = time.perf_counter()
            ranking = rank_heads(model, examples, units, reuse_prefix=reuse, pairs_top_k=0, progress=False)
            times[reuse].append(time.perf_counter() - t0)
            rows[reuse] = ranking.rows
    assert rows[True] == rows[False], "prefix reuse changed the ranking"
    with_reuse, without = statistics.median(times[True]), statistics.median(times[False])
    name = args.model or f"{args.arch} {args.layers} layers d_model {args.d_model}"
    print(f"rank_heads on {name}: {len(units)} units, {len(examples)} prompts of {args.pairs} pairs")
    print(f"  without reuse / with reuse = {without / with_reuse:.2f}x  (target >= 1.5x)")


if __name__ == "__main__":
    main()
