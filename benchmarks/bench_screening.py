"""Screened vs exhaustive head ranking, batched vs sequential ablations, and estimate quality, on the organisms.

    python benchmarks/bench_screening.py [--n 200] [--organisms llama-kv,gpt2-kv,mamba2-kv,zamba2-kv] [--out FILE]

For each organism, in one run (ratios, never absolute times, are the result):
    exhaustive / screened    wall-time ratio of rank_heads(method="exhaustive") over method="screened"
                             (verify_top=3, n_control=2; pairs off so only the ranking is timed), and over
                             screened with an exact prescreen on n/8 prompts (verify_top=4); whether each
                             finds the exhaustive top 3
    sequential / batched     rank_heads(method="exhaustive") with replicas=1 over replicas=8 (all units
                             of a layer ablated 8 per forward), and the max |difference| of their numbers;
                             and at 8 prompts per forward, replicas=1 over the CPU rule's choice
    estimate vs exact        Pearson r of the attribution estimate and the exact drop over all units
                             (answer log-prob drop; accuracy drop; estimated margin drop against the
                             exact log-prob drop), the top-3 recall of the screen, and
                             the units whose estimate is furthest from the exact effect (named)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from analysis.ga.ranking import head_units, rank_heads, replicas_for
from analysis.ga.screening import estimate_effects
from analysis.tasks import token_kv as kv_task
from analysis.tasks.scoring import ChoiceScorer
from loaders import from_pretrained
from loaders.organisms import accuracy as card


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def pearson(x: list[float], y: list[float]) -> float | None:
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    if a.std() == 0 or b.std() == 0:
        return None
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def bench(name: str, n: int, batch_size: int) -> dict:
    model = from_pretrained(f"organism/{name}")
    examples = kv_task.examples(8, n, seed=31, fmt=card(name)["fmt"])
    units = head_units(model)
    kw = dict(batch_size=batch_size, pairs_top_k=0, progress=False)
    rank_heads(model, examples[:8], units, **kw)  # warm-up
    exhaustive, t_ex = timed(lambda: rank_heads(model, examples, units, replicas=1, **kw))
    screened, t_sc = timed(lambda: rank_heads(model, examples, units, method="screened", verify_top=3, n_control=2,
                                              replicas=1, **kw))
    pre, t_pre = timed(lambda: rank_heads(model, examples, units, method="screened", verify_top=4, n_control=2,
                                          replicas=1, prescreen_n=n // 8, **kw))
    batched, t_b = timed(lambda: rank_heads(model, examples, units, replicas=8, **kw))
    small = dict(kw, batch_size=8)  # the regime the CPU rule tiles: small forwards, overhead-bound
    rule = replicas_for(model, ChoiceScorer(model, examples, 8))
    _, t_small_seq = timed(lambda: rank_heads(model, examples, units, replicas=1, **small))
    _, t_small_rule = timed(lambda: rank_heads(model, examples, units, **small))
    exact = {r["unit"]: r for r in exhaustive.rows}
    diff = max(abs(exact[r["unit"]][k] - r[k]) for r in batched.rows for k in ("accuracy", "logprob"))
    est = estimate_effects(model, ChoiceScorer(model, examples, batch_size), units)
    labels = [u.label for u in units]
    gap = sorted(labels, key=lambda u: -abs(est[u]["est_logprob_drop"] - exact[u]["logprob_drop"]))
    return {"organism": name, "units": len(units), "examples": n,
            "exhaustive_over_screened": t_ex / t_sc, "verified": screened.screen["n_verified"],
            "exhaustive_over_prescreened": t_ex / t_pre, "verified_prescreened": pre.screen["n_verified"],
            "top3_prescreened": pre.top(3),
            "sequential_over_batched": t_ex / t_b, "batched_max_abs_diff": diff,
            "small_batch_rule_replicas": rule, "small_batch_sequential_over_rule": t_small_seq / t_small_rule,
            "top3_exhaustive": exhaustive.top(3), "top3_screened": screened.top(3),
            "pearson_logprob_drop": pearson([est[u]["est_logprob_drop"] for u in labels],
                                            [exact[u]["logprob_drop"] for u in labels]),
            "pearson_drop": pearson([est[u]["est_drop"] for u in labels], [exact[u]["drop"] for u in labels]),
            "pearson_margin_vs_logprob_drop": pearson([est[u]["est_margin_drop"] for u in labels],
                                                      [exact[u]["logprob_drop"] for u in labels]),
            "worst": [{"unit": u, "estimate": est[u]["est_logprob_drop"], "exact": exact[u]["logprob_drop"]}
                      for u in gap[:3]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--organisms", default="llama-kv,gpt2-kv,mamba2-kv,zamba2-kv,mamba-kv")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for name in args.organisms.split(","):
        r = bench(name, args.n, args.batch_size)
        rows.append(r)
        print(f"{name:>10}: {r['units']} units, exhaustive/screened {r['exhaustive_over_screened']:.1f}x "
              f"({r['verified']} verified, top-3 {r['top3_screened'] == r['top3_exhaustive']}), with prescreen "
              f"{r['exhaustive_over_prescreened']:.1f}x ({r['verified_prescreened']} verified, top-3 "
              f"{r['top3_prescreened'] == r['top3_exhaustive']}), sequential/batched {r['sequential_over_batched']:.2f}x "
              f"(max diff {r['batched_max_abs_diff']:.1e}), at 8 rows the rule tiles {r['small_batch_rule_replicas']}: "
              f"{r['small_batch_sequential_over_rule']:.2f}x, "
              f"Pearson(est, exact) log-prob {r['pearson_logprob_drop']}, accuracy {r['pearson_drop']}, "
              f"margin vs log-prob {r['pearson_margin_vs_logprob_drop']}; "
              f"worst: {', '.join(w['unit'] for w in r['worst'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
