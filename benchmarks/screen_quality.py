"""Estimate quality of attribution screening on the organisms: estimate vs exact ablation effect per unit.

    python benchmarks/screen_quality.py [--n 200] [--organisms llama-kv,...] [--refine none,qk] [--out FILE]

For each organism: every unit zero-ablated exactly (`rank_heads(method="exhaustive")`, n prompts at 8
pairs, the prompts of benchmarks/bench_screening.py), then one attribution pass per estimate
(`estimate_effects(..., refine=...)`; "none" is the plain first-order estimate). Reported: Pearson r
of the estimate and the exact effect over all units (answer log-prob drop; accuracy drop; estimated
margin drop against the exact log-prob drop), how many of the exhaustive top 3 the screen's
candidates hold at verify_top 1, 2, 3, and the three units whose estimate is furthest from the exact
effect (named). Run it with another checkout's PYTHONPATH (refine "none" only) to compare versions.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

from analysis.ga.ranking import candidates, head_units, rank_heads
from analysis.ga.screening import estimate_effects
from analysis.tasks import token_kv as kv_task
from analysis.tasks.scoring import ChoiceScorer
from loaders import from_pretrained
from loaders.organisms import accuracy as card


def pearson(x: list[float], y: list[float]) -> float | None:
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    if len(x) < 3 or a.std() == 0 or b.std() == 0:
        return None
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def quality(units, est: dict, exact: dict, top3: list[str]) -> dict:
    labels = [u.label for u in units]
    gap = sorted(labels, key=lambda u: -abs(est[u]["est_logprob_drop"] - exact[u]["logprob_drop"]))
    return {"pearson_logprob_drop": pearson([est[u]["est_logprob_drop"] for u in labels],
                                            [exact[u]["logprob_drop"] for u in labels]),
            "pearson_drop": pearson([est[u]["est_drop"] for u in labels], [exact[u]["drop"] for u in labels]),
            "pearson_margin_vs_logprob_drop": pearson([est[u]["est_margin_drop"] for u in labels],
                                                      [exact[u]["logprob_drop"] for u in labels]),
            "top3_found": {k: len(set(top3) & {u.label for u in candidates(units, est, k)}) for k in (1, 2, 3)},
            "worst": [{"unit": u, "estimate": est[u]["est_logprob_drop"], "exact": exact[u]["logprob_drop"]}
                      for u in gap[:3]]}


def bench(name: str, n: int, batch_size: int, refines: list[str]) -> dict:
    model = from_pretrained(f"organism/{name}")
    examples = kv_task.examples(8, n, seed=31, fmt=card(name)["fmt"])
    units = head_units(model)
    exhaustive = rank_heads(model, examples, units, batch_size=batch_size, pairs_top_k=0, progress=False)
    exact = {r["unit"]: r for r in exhaustive.rows}
    scorer = ChoiceScorer(model, examples, batch_size)
    out = {"organism": name, "units": len(units), "examples": n, "top3_exhaustive": exhaustive.top(3)}
    can_refine = "refine" in inspect.signature(estimate_effects).parameters
    for refine in refines:
        t = time.perf_counter()
        est = estimate_effects(model, scorer, units, refine=refine) if can_refine else estimate_effects(model, scorer,
                                                                                                       units)
        out[refine] = {**quality(units, est, exact, exhaustive.top(3)), "wall_s": time.perf_counter() - t}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--organisms", default="llama-kv,gpt2-kv,mamba2-kv,zamba2-kv,mamba-kv")
    p.add_argument("--refine", default="none")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for name in args.organisms.split(","):
        r = bench(name, args.n, args.batch_size, args.refine.split(","))
        rows.append(r)
        for refine in args.refine.split(","):
            q = r[refine]
            print(f"{name:>10} [{refine}]: r(log-prob) {q['pearson_logprob_drop']}, r(accuracy) {q['pearson_drop']}, "
                  f"r(margin vs log-prob) {q['pearson_margin_vs_logprob_drop']}; exhaustive top 3 {r['top3_exhaustive']} "
                  f"found at verify_top 1/2/3: {list(q['top3_found'].values())}; worst "
                  f"{[(w['unit'], round(w['estimate'], 3), round(w['exact'], 3)) for w in q['worst']]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
