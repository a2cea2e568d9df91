"""info_flow throughput (facts x windows per second) against the naive loop, measured in one run.

Glossary
    unit        one (fact, window start): every source set knocked out in that window, i.e. one cell
                of the paper's figure for one fact (4 forwards in the naive loop)
    naive loop  one prompt per forward, the full model from the embedding, logits at every position,
                list positions and no padding (what a first implementation does)
    info_flow   rows of `batch_size` facts x source sets per forward, left padding with bool masks,
                each window started from the cached clean residual at its first layer, logits at the
                last position only, no_grad; one window per forward (replicas=1)
    windows batched  the same with `--replicas` windows per forward, one per block of tiled rows (each
                layer's knockout cuts only the rows whose window holds it)
Both compute the same numbers (tests/test_info_flow.py checks this); facts are taken as they come
(require_correct=False) so that both sides see the same prompts.

    python benchmarks/bench_info_flow.py [--model smollm2-135m] [--facts 32] [--naive-facts 4] [--replicas 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from analysis.tasks.known_facts import SOURCE_SETS, load_facts, prepare_facts
from analysis.info_flow import info_flow
from analysis.interventions.knockout import knockout


def naive_units(model, prompts, window: int) -> int:
    """The naive loop over facts, window starts and source sets; returns the units done."""
    n = model.cfg.n_layers
    for fp in prompts:
        ids = torch.tensor([fp.ids])
        p = torch.softmax(model(ids)[0, -1].float(), -1)[fp.answer]
        for start in range(n):
            for name in SOURCE_SETS:
                with knockout(model, fp.source_positions(name), [-1], range(start, min(start + window, n))):
                    q = torch.softmax(model(ids)[0, -1].float(), -1)[fp.answer]
                _ = float(100 * (q - p) / p)
    return len(prompts) * n


def load_model(name: str):
    from loaders import from_pretrained

    return from_pretrained(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--facts", type=int, default=32, help="facts for info_flow")
    ap.add_argument("--naive-facts", type=int, default=4, help="facts for the naive loop (it is slow)")
    ap.add_argument("--window", type=int, default=9)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a busy machine)")
    ap.add_argument("--replicas", type=int, default=4, help="windows per forward for the batched-windows row")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    facts = load_facts(None, max(args.facts, args.naive_facts))
    n = model.cfg.n_layers
    print(f"model {args.model}: {n} layers, window {args.window}, {len(SOURCE_SETS)} source sets, "
          f"{torch.get_num_threads()} threads")

    with torch.no_grad():
        prompts, _ = prepare_facts(model.tokenizer, facts[: args.naive_facts])
        model(torch.tensor([prompts[0].ids]))  # warm up
        t0 = time.perf_counter()
        units = naive_units(model, prompts, args.window)
        naive = units / (time.perf_counter() - t0)
    rows = [("naive loop (1 prompt per forward)", naive)]
    for label, reuse, r in [("info_flow, batched, no prefix reuse", False, 1),
                            ("info_flow (batched + prefix reuse)", True, 1),
                            (f"  + {args.replicas} windows per forward", True, args.replicas)]:
        t0 = time.perf_counter()
        result = info_flow(model, facts[: args.facts], window=args.window, batch_size=args.batch_size,
                           require_correct=False, reuse_prefix=reuse, progress=False, replicas=r)
        rows.append((label, len(result.facts) * n / (time.perf_counter() - t0)))
    print(f"{'':40s} {'units/s':>9s} {'vs naive':>9s}")
    for label, rate in rows:
        print(f"{label:40s} {rate:9.2f} {rate / naive:8.1f}x")
    print(f"(a unit is one fact x one window start, all {len(SOURCE_SETS)} source sets; "
          f"the real experiment on {args.facts} facts would take {args.facts * n / rows[-2][1]:.0f} s; windows batched "
          f"over one window per forward: {rows[-1][1] / rows[-2][1]:.2f}x)")


if __name__ == "__main__":
    main()
