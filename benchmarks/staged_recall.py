"""Staged verification's recall and cost, from every unit's exact per-prompt scores (one exhaustive sweep).

    python benchmarks/staged_recall.py smollm2-135m --pairs 5 --rank-n 16 --cache out/staged_recall.pt --out recall.json

Runs (or loads from --cache) every unit's exact ablation on the ranking prompts (shared-prefix
scorer, prefix reuse) and runs the attribution pass of today's code (`--refine`), then replays
`rank_heads(method="screened")`'s candidate rule and the staged verification (`stage_n` prompts,
those answered right first, for every candidate, the `stage_keep` leaders by (accuracy drop, log-prob drop) on them verified on all prompts) for each
setting: units verified, cost in forward-equivalents of the ranking prompts (a unit of layer l
costs (n_layers - l) / n_layers with prefix reuse, times the share of prompts it runs on), and the
overlap of the resulting top 10 with the exhaustive top 10. No timing is asserted; costs are counted.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from analysis.ga.ranking import _exact, candidates, head_units
from analysis.ga.report import task_for
from analysis.ga.screening import estimate_effects
from analysis.tasks.scoring import ChoiceScorer
from loaders import from_pretrained


def sweep(model, scorer, units) -> dict:
    """Every unit's exact scores on the ranking prompts (the costly part, cached)."""
    bar = tqdm(total=len(units), desc="exact")
    exact = _exact(model, scorer, units, "zero", None, True, 1, bar)
    return {"base": scorer.scores(), "answers": scorer.answers(), "exact": exact,
            "layers": {u.label: u.layer for u in units}, "n_layers": model.cfg.n_layers}


def metrics(scores: torch.Tensor, answers: torch.Tensor, rows: list[int]) -> tuple[float, float]:
    s = scores[rows]
    a = answers[rows]
    correct = (s.argmax(-1) == a).double().mean().item()
    logprob = s.log_softmax(-1).gather(1, a[:, None]).mean().item()
    return correct, logprob


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--rank-n", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="torch file with the sweep (written when absent)")
    p.add_argument("--verify-top", default="20,30,45,60")
    p.add_argument("--refine", default="none", choices=["none", "scores", "qk"])
    p.add_argument("--stage-n", default="4,6,8")
    p.add_argument("--stage-keep", default="10,15,20")
    p.add_argument("--ranking", default=None, help="an exhaustive ranking.csv to compare this sweep's top 10 with")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = from_pretrained(args.model)
    scorer = ChoiceScorer(model, task_for(args.model)(args.pairs, args.rank_n, args.seed), 16)
    units = head_units(model)
    if args.cache and Path(args.cache).exists():
        data = torch.load(args.cache)
    else:
        data = sweep(model, scorer, units)
        if args.cache:
            torch.save({k: v for k, v in data.items() if k != "est"}, args.cache)
    est = estimate_effects(model, scorer, units, refine=args.refine)  # the screen of today's code, every run
    base, answers, exact, layers = data["base"], data["answers"], data["exact"], data["layers"]
    n, n_layers = len(answers), data["n_layers"]
    labels = list(exact)
    every = list(range(n))
    b_all = metrics(base, answers, every)

    def drops(u: str, rows: list[int]) -> tuple[float, float]:
        b, x = metrics(base, answers, rows), metrics(exact[u], answers, rows)
        return b[0] - x[0], b[1] - x[1]

    full = {u: drops(u, every) for u in labels}
    top10 = set(sorted(labels, key=lambda u: (-full[u][0], -full[u][1]))[:10])
    if args.ranking:
        with open(args.ranking) as f:
            saved = [r["unit"] for r in csv.DictReader(f)][:10]
        print(f"this sweep's top 10 vs {args.ranking}'s: {len(top10 & set(saved))}/10 shared; "
              f"{sorted(top10)} vs {sorted(saved)}", flush=True)
    cost = {u: (n_layers - layers[u]) / n_layers for u in labels}

    class U:  # what `candidates` reads
        def __init__(self, label: str) -> None:
            self.label = label

    units = [U(u) for u in labels]
    out = {"refine": args.refine, "baseline": b_all, "exhaustive_forwards": sum(cost.values()), "settings": []}
    for k, m, keep in itertools.product(*(map(int, s.split(",")) for s in (args.verify_top, args.stage_n,
                                                                             args.stage_keep))):
        chosen = [u.label for u in candidates(units, est, k)]
        right = (base.argmax(-1) == answers).tolist()  # rank_heads' rule: prompts answered right first
        sub = sorted(([i for i in every if right[i]] + [i for i in every if not right[i]])[:m])
        leaders = sorted(chosen, key=lambda u: (-drops(u, sub)[0], -drops(u, sub)[1]))[:keep]
        top = sorted(leaders, key=lambda u: (-full[u][0], -full[u][1]))[:10]
        spent = sum(cost[u] for u in chosen) * m / n + sum(cost[u] for u in leaders) * (n - m) / n
        row = {"verify_top": k, "stage_n": m, "stage_keep": keep, "candidates": len(chosen),
               "forwards": spent, "overlap_top10": len(top10 & set(top))}
        out["settings"].append(row)
        print(json.dumps(row), flush=True)
    for k in map(int, args.verify_top.split(",")):  # one stage: every candidate on every prompt
        chosen = [u.label for u in candidates(units, est, k)]
        top = sorted(chosen, key=lambda u: (-full[u][0], -full[u][1]))[:10]
        print(json.dumps({"verify_top": k, "single_stage_forwards": sum(cost[u] for u in chosen),
                          "overlap_top10": len(top10 & set(top))}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
