"""Recall of attribution screening against a saved exhaustive ranking, for every verification budget.

    python benchmarks/screen_recall.py smollm2-135m docs/results/ga_smollm2/ranking.csv --pairs 5 --rank-n 16 \
        [--refine none,scores,qk]

A screened ranking's verified units carry exactly the exhaustive numbers (same ablation, same code
path; tests/test_screening.py), so its top 10 for a given `verify_top` follows from the saved
exhaustive ranking and one attribution pass: this script runs that pass (one forward + backward)
and reports, per `verify_top`, the verified units, their cost in forward-equivalents (a unit of
layer l costs (n_layers - l) / n_layers of a forward with prefix reuse) against the exhaustive
cost, and the overlap of the screened top 10 with the exhaustive top 10 (without the random
controls, which can only add). Also the Pearson r of estimate and exact effect, by layer thirds.
With several `--refine` values (`estimate_effects(refine=...)`), all of this for each, in one run.
"""

from __future__ import annotations

import argparse
import csv
import json
import time

import torch

from analysis.ga.ranking import candidates, head_units
from analysis.ga.report import task_for
from analysis.ga.screening import estimate_effects
from analysis.tasks.scoring import ChoiceScorer
from loaders import from_pretrained

KEYS = ("est_drop", "est_logprob_drop", "est_margin_drop")


def pearson(x: list[float], y: list[float]) -> float | None:
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item() if len(x) > 2 and a.std() > 0 and b.std() > 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("ranking", help="ranking.csv of an exhaustive run")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--rank-n", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="3,5,10,15,20,30,45,60,90")
    p.add_argument("--refine", default="none", help="comma-separated estimate refinements: none, scores, qk")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = from_pretrained(args.model)
    rows = list(csv.DictReader(open(args.ranking)))
    exact = {r["unit"]: {"drop": float(r["drop"]), "logprob_drop": float(r["logprob_drop"]), "layer": int(r["layer"])}
             for r in rows}
    units = head_units(model)
    scorer = ChoiceScorer(model, task_for(args.model)(args.pairs, args.rank_n, args.seed), 16)
    n_layers = model.cfg.n_layers
    order = [r["unit"] for r in rows]  # the exhaustive order (drop, then log-prob drop)
    top10 = set(order[:10])
    cost = {u.label: (n_layers - u.layer) / n_layers for u in units}
    full = sum(cost.values())
    out = {"exhaustive_forwards": full}
    for refine in args.refine.split(","):
        t = time.perf_counter()
        est = estimate_effects(model, scorer, units, refine=refine) if refine != "none" else \
            estimate_effects(model, scorer, units)
        res = out[refine] = {"estimate_wall_s": time.perf_counter() - t, "budgets": []}
        print(f"[{refine}] estimate in {res['estimate_wall_s']:.0f} s", flush=True)
        for k in [int(b) for b in args.budgets.split(",")]:
            chosen = {u.label for u in candidates(units, est, k)}  # the rule rank_heads(method="screened") uses
            top = sorted(chosen, key=lambda u: (-exact[u]["drop"], -exact[u]["logprob_drop"]))[:10]
            res["budgets"].append({"verify_top": k, "verified": len(chosen),
                                   "forwards": sum(cost[u] for u in chosen), "overlap_top10": len(top10 & set(top))})
            b = res["budgets"][-1]
            print(f"[{refine}] verify_top {k:>3}: {b['verified']:>3} units, {b['forwards']:.1f} of {full:.1f} forwards, "
                  f"top-10 overlap {b['overlap_top10']}/10", flush=True)
        thirds = [range(i * n_layers // 3, (i + 1) * n_layers // 3) for i in range(3)]
        for key, exact_key in (("est_logprob_drop", "logprob_drop"), ("est_drop", "drop"),
                               ("est_margin_drop", "logprob_drop")):
            r_all = pearson([est[u][key] for u in order], [exact[u][exact_key] for u in order])
            by = [pearson([est[u][key] for u in order if exact[u]["layer"] in th],
                          [exact[u][exact_key] for u in order if exact[u]["layer"] in th]) for th in thirds]
            res[f"pearson_{key}_vs_{exact_key}"] = {"all": r_all, "layer_thirds": by}
            print(f"[{refine}] Pearson({key}, exact {exact_key}): all {r_all}, by layer thirds {by}", flush=True)
        res["top10_ranks_by_estimate"] = {u: {key: sorted(est, key=lambda v: -est[v][key]).index(u) for key in KEYS}
                                          for u in order[:10]}
        res["top2"] = {u: {**est[u], "exact_drop": exact[u]["drop"], "exact_logprob_drop": exact[u]["logprob_drop"]}
                       for u in order[:2]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
