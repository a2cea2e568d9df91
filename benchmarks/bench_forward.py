"""Forward cost against Hugging Face, as ratios measured in one run (never absolute times).

    python benchmarks/bench_forward.py [--model smollm2-135m] [--seq 128] [--reps 5]

Prints: our forward / HF eager forward; run_with_cache(all hooks) / our forward;
run_with_cache(resid_post only) / our forward. Timings alternate between the contenders and take the
median of `reps`, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)

    from transformers import AutoModelForCausalLM

    from loaders import from_pretrained
    from loaders.smollm2 import smollm2_path

    ours = from_pretrained(args.model)
    if args.model == "smollm2-135m":
        path = smollm2_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (1, args.seq))

    contenders = {
        "hf": lambda: hf(tokens).logits,
        "ours": lambda: ours(tokens),
        "cache_all": lambda: ours.run_with_cache(tokens),
        "cache_resid": lambda: ours.run_with_cache(tokens, names_filter=lambda n: n.endswith("resid_post")),
    }
    for fn in contenders.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.reps):
        for name, fn in contenders.items():
            times[name] += timed(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model}, seq {args.seq}, {args.reps} alternating reps, torch threads {torch.get_num_threads()}")
    print(f"ours / HF eager forward          : {med['ours'] / med['hf']:.2f}  (target <= 1.1)")
    print(f"run_with_cache(all) / our forward: {med['cache_all'] / med['ours']:.2f}  (target <= 2.0)")
    print(f"run_with_cache(resid) / forward  : {med['cache_resid'] / med['ours']:.2f}")


if __name__ == "__main__":
    main()
