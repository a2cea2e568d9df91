"""`hooked ga MODEL`: the Gather-and-Aggregate experiment on KV-retrieval, written to a directory.

Glossary
    sizes        dictionary sizes n (`--pairs 10,20,30`): accuracy of the model at each, on `--n`
                 seeded KV-retrieval prompts (chance = 1/n); the ranking's prompts among them are read
                 from its baseline, not scored again (`reused` in accuracy.csv).
    ranking      `rank_heads` on the first size: accuracy and answer log-prob drop per unit, with
                 its gather and aggregate scores (`ga_scores`) and their percentile among all units;
                 pairs among the top `--top-k` units and the two best gather and aggregate scorers.
                 Screened by default (attribution estimate for every unit, exact ablation of the
                 `--verify-top` candidates and `--controls` random units; unverified rows hold
                 estimates only); staged by default (the candidates on `--stage-n` prompts first,
                 the `--stage-keep` best of them on all; `--one-stage`); `--exhaustive` ablates
                 every unit exactly. Choices are scored through the shared prefix everywhere
                 (analysis.tasks.shared_prefix).
    intervals    accuracy: Clopper-Pearson; drops: paired bootstrap over prompts (analysis.intervals);
                 `separability` in summary.json says which of the top 10 differ from the next.
    control      the top two units ablated together vs random pairs of other units of the same head
                 modules (`n_random` seeded draws: their mean, min and max), beside the unablated accuracy.
    task         how prompts are made: `kv_retrieval` (the text task of METHODS.md A) for language
                 models; an organism ("organism/<name>") gets its own token-level KV prompts
                 (`analysis.tasks.token_kv.examples` in the format of its card).
    agreement    Spearman rank correlation, over all units, between each score (gather, aggregate,
                 their maximum) and the ablation drops (accuracy, answer log-prob): does a unit that
                 looks like a G&A head by its pattern/kernel matter when removed?
    files        accuracy.csv, ranking.csv/.json, pairs.csv, summary.json, timing.json, drop_heatmap.png,
                 est_logprob_drop_heatmap.png (screened),
                 logprob_drop_heatmap.png, top1_<unit>.png, top2_<unit>.png (pattern or min-max
                 normalised kernel on the first prompt), scores_vs_drop.png.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from analysis.interventions.ablation import ablate_units
from analysis.ga.ranking import HeadRanking, Unit, rank_units, ranking_scorer
from analysis.tasks.scoring import ChoiceScorer, accuracy, answer_logprob, per_example
from analysis.ga.scores import unit_scores
from hooked.models.model_map import model_map
from analysis.intervals import clopper_pearson, paired_interval
from analysis.plots import heatmap, plot_pattern, save_table, scatter_plot
from analysis.tasks.text import Example, kv_retrieval
from analysis.validate import writable_dir
from analysis.ga.settings import REPORT, Laps, RankSettings, settings_of
from hooked.validate import Integer, Seq, check, checked

Task = Callable[[int, int, int], list[Example]]  # (pairs, n_samples, seed) -> examples


def task_for(model_name: str) -> Task:
    """The KV prompts for a model: the organism's own token-level task, else the text task."""
    from loaders.organisms import accuracy, available_for, is_organism, task

    if is_organism(model_name):
        from analysis.tasks import token_kv as kv_task

        if task(model_name) != "kv":
            raise ValueError(f"{model_name} is a {task(model_name)!r} organism; KV retrieval needs one of "
                             f"{', '.join('organism/' + n for n in available_for('kv'))}")
        fmt = accuracy(model_name)["fmt"]
        return lambda pairs, n, seed: kv_task.examples(pairs, n, seed, fmt=fmt)
    return kv_retrieval


def accuracy_by_size(model: Any, sizes: list[int], n: int, seed: int = 0, batch_size: int = 16,
                     task: Task = kv_retrieval, known: tuple[Sequence[Example], Tensor] | None = None) -> list[dict]:
    """Per size: accuracy with its Clopper-Pearson interval, answer log-prob with a bootstrap interval.

    known: (examples, their unablated scores [example choice]) already computed (the ranking's baseline:
    its prompts are the first of its size's), read instead of scored again."""
    have = {} if known is None else {_key(e): row for e, row in zip(*known, strict=True)}
    rows = []
    for size in sizes:
        examples = task(size, n, seed)
        todo = [e for e in examples if _key(e) not in have]
        fresh = iter(ChoiceScorer(model, todo, batch_size).scores() if todo else [])
        width = max(len(e.choices) for e in examples)
        scores = torch.full((len(examples), width), -math.inf, dtype=torch.float64)
        for i, e in enumerate(examples):
            row = have[_key(e)] if _key(e) in have else next(fresh)
            scores[i, : len(e.choices)] = row[: len(e.choices)]
        ex = per_example(scores, examples)
        lo, hi = clopper_pearson(int(ex["correct"].sum()), len(ex["correct"]))
        lp_lo, lp_hi = paired_interval(ex["logprob"])
        rows.append({"pairs": size, "n": n, "accuracy": accuracy(scores, examples),
                     "logprob": answer_logprob(scores, examples), "accuracy_lo": lo, "accuracy_hi": hi,
                     "logprob_lo": lp_lo, "logprob_hi": lp_hi, "chance": 1 / size, "reused": len(examples) - len(todo)})
    return rows


def _key(e: Example) -> tuple:
    return e.prompt, tuple(e.choices), e.answer


def percentile(value: float, values: list[float]) -> float:
    """Share of `values` strictly below `value` (0 = lowest, 1 = above all others)."""
    return sum(v < value for v in values) / max(len(values) - 1, 1)


def control(model: Any, examples: list[Example], ranking: HeadRanking, units: list[Unit], seed: int = 0,
            batch_size: int = 16, n_random: int = 5, reuse_pairs: bool = False,
            scorer: ChoiceScorer | None = None) -> dict[str, Any]:
    """Accuracy with the top two units ablated vs `n_random` seeded draws of two other units, each
    drawn from the same head module as the top unit it stands for (so the same layers).

    reuse_pairs: `examples` are the ranking's, so the top two ablated together are read from
    `ranking.pairs` when it holds them (the same forward, not run twice). scorer: the ranking's
    (`ranking_scorer`, its kept clean run) over `examples`."""
    check(n_random, "control: n_random", Integer(ge=1))
    by_label = {u.label: u for u in units}
    top = [by_label[label] for label in ranking.top(2)]
    rng = random.Random(seed)
    if scorer is None:
        scorer = ChoiceScorer(model, examples, batch_size)
    elif scorer.examples != list(examples):
        raise ValueError("control: scorer must score the same examples")
    start = min(u.layer for u in top)  # every draw ablates units of the top units' modules: start there
    _, resids = next(scorer.prefixes([start]))

    def ablated(chosen: list[Unit]) -> dict[str, Any]:
        with ablate_units(model, chosen):
            return {"units": [u.label for u in chosen], **scorer.metrics(scorer.scores(start, resids))}

    draws = []
    for _ in range(n_random):
        chosen: list[Unit] = []
        for t in top:
            pool = [u for u in units if u.module == t.module and u.label not in ranking.top(2) and u not in chosen]
            chosen.append(rng.choice(pool or [t]))
        draws.append(ablated(chosen))
    accs = [d["accuracy"] for d in draws]
    labels = [u.label for u in top]
    names = {"+".join(labels), "+".join(labels[::-1])}
    pair = next((p for p in ranking.pairs if p["pair"] in names), None) if reuse_pairs else None
    top2 = {"units": labels, "accuracy": pair["accuracy"], "logprob": pair["logprob"]} if pair else ablated(top)
    return {"baseline": ranking.baseline["accuracy"], "top2": top2,
            "random2": {"mean_accuracy": sum(accs) / len(accs), "min_accuracy": min(accs),
                        "max_accuracy": max(accs), "draws": draws}}


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    def ranks(v: list[float]) -> torch.Tensor:
        t = torch.tensor(v, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in t.unique():  # ties share their mean rank
            tie = t == value
            r[tie] = r[tie].mean()
        return r

    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two equal-length lists of at least 2 values, got {len(x)} and {len(y)}")
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = float((rx.square().sum() * ry.square().sum()).sqrt())
    return float((rx * ry).sum()) / denom if denom > 0 else float("nan")


def agreement(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Spearman correlation of each G&A score with each ablation drop over the ranking's rows that have it
    (screened rankings: exact drops over the verified units, the estimated log-prob drop over all)."""
    out = {}
    drops = ["drop", "logprob_drop"] + (["est_logprob_drop"] if rows and "est_logprob_drop" in rows[0] else [])
    for score in ("gather", "aggregate", "ga_max"):
        for drop in drops:
            have = [r for r in rows if not math.isnan(r[drop])]
            xs = [max(r["gather"], r["aggregate"]) if score == "ga_max" else r[score] for r in have]
            rho = spearman(xs, [r[drop] for r in have]) if len(have) > 1 else math.nan
            out[f"{score}~{drop}"] = None if math.isnan(rho) else rho
    return out


def plot_agreement(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Answer log-prob drop against max(gather, aggregate) score, one point per unit (top 5 labelled)."""
    corr = agreement(rows)["ga_max~logprob_drop"]
    rows = [r for r in rows if not math.isnan(r["logprob_drop"])]  # screened: the verified units
    return scatter_plot([max(r["gather"], r["aggregate"]) for r in rows], [r["logprob_drop"] for r in rows], path,
                        f"{title} (Spearman {'n/a' if corr is None else f'{corr:+.2f}'})", "max(gather, aggregate) score",
                        "answer log-prob drop when ablated", [r["unit"] for r in rows], n_labels=5)


def unit_weights(model: Any, unit: Unit, example: Example) -> tuple[torch.Tensor, list[str], bool]:
    """[q k] pattern (attention) or kernel magnitude averaged over the unit's heads, the tokens, is_kernel."""
    mixing = unit.placed().mixing()
    name = mixing.matrix.name
    tokens, mask = model.tokenize(example.prompt)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, mask, names_filter=[name])
    w = cache[name][0, list(unit.heads)].float()
    w = w.abs().mean(0) if mixing.signed else w.mean(0)
    return w, model.to_str_tokens(tokens[0]), mixing.signed


@checked(sizes=Seq(Integer(ge=1)), n=Integer(ge=1), rank_n=Integer(ge=1, none=True), n_random=Integer(ge=1))
def ga_report(model: Any, out: str | Path, sizes: list[int], n: int = 50, rank_n: int | None = None,
              task: Task = kv_retrieval, n_random: int = 5, settings: RankSettings | None = None,
              **loose: Any) -> dict[str, Any]:
    """The G&A report in `out` (files: see the module glossary); timing.json has each stage's wall and CPU seconds.

    settings: how the heads are ranked, a RankSettings (default settings.REPORT: screened, staged); the old
    loose keywords (`ga_report(model, out, sizes, batch_size=8, method="exhaustive")`) replace its fields.
    Its seed also draws the prompts and the control, its batch_size and channel_group serve the report too."""
    settings = settings_of(settings, loose, REPORT, "ga_report")
    seed, batch_size = settings.seed, settings.batch_size
    laps = Laps()
    timing = laps.laps
    out = writable_dir(out, "out")
    examples = task(sizes[0], rank_n or n, seed)
    mp = model_map(model)  # the one map of this report: its units carry their sites down
    units, sites = mp.units(settings.channel_group), mp.mixers()
    scores = unit_scores(model, examples, units)
    laps.lap("ga_scores")
    best = {kind: sorted(units, key=lambda u: -scores[u.label][kind])[:2] for kind in ("gather", "aggregate")}
    scorer = ranking_scorer(model, examples, batch_size)  # its clean run serves the ranking, the table, the control
    ranking = rank_units(model, examples, units, settings, sites, pair_with=best["aggregate"] + best["gather"],
                         scorer=scorer)
    laps.lap("rank_heads")
    timing["rank_heads"]["steps"] = ranking.timing
    gathers = [s["gather"] for s in scores.values()]
    aggregates = [s["aggregate"] for s in scores.values()]
    for row in ranking.rows:
        s = scores[row["unit"]]
        row.update(gather=s["gather"], aggregate=s["aggregate"], gather_pct=percentile(s["gather"], gathers),
                   aggregate_pct=percentile(s["aggregate"], aggregates))
    acc = accuracy_by_size(model, sizes, n, seed, batch_size, task, known=(examples, scorer.clean_scores()))
    laps.lap("accuracy_by_size")
    by_label = {u.label: u for u in units}
    tops = [(rank, label, *unit_weights(model, by_label[label], examples[0]))
            for rank, label in enumerate(ranking.top(2), 1)]
    summary = {"sizes": acc, "baseline": ranking.baseline, "method": settings.method, "top": ranking.rows[:10],
               "pairs": ranking.pairs,
               "control": control(model, examples, ranking, units, seed, batch_size, n_random, reuse_pairs=True,
                                  scorer=scorer),
               "agreement": agreement(ranking.rows), "n_units": len(units), "rank_examples": len(examples),
               "screen": ranking.screen, "separability": ranking.separability,
               "separability_statement": separability_statement(ranking)}
    plot_agreement(ranking.rows, out / "scores_vs_drop.png", f"G&A scores vs ablation, n={sizes[0]}")
    drops = ["drop", "logprob_drop"] + (["est_logprob_drop"] if ranking.method == "screened" else [])  # a screen of
    matrices = {key: ranking.matrix(key, model.cfg.n_layers) for key in drops}  # few units ranks exhaustively
    ranking.to_csv(out / "ranking.csv")
    ranking.to_json(out / "ranking.json")
    save_table(ranking.pairs or [{"pair": None}], out / "pairs.csv")
    save_table(acc, out / "accuracy.csv")
    heatmap(matrices["drop"], out / "drop_heatmap.png", f"accuracy drop, n={sizes[0]}",
            "head (Mamba-1: channel group)", "layer", centered=True, colorbar_label="accuracy drop")
    heatmap(matrices["logprob_drop"], out / "logprob_drop_heatmap.png",
            f"answer log-prob drop, n={sizes[0]}", "head (Mamba-1: channel group)", "layer", centered=True)
    if "est_logprob_drop" in matrices:
        heatmap(matrices["est_logprob_drop"], out / "est_logprob_drop_heatmap.png",
                f"estimated answer log-prob drop (attribution), n={sizes[0]}", "head (Mamba-1: channel group)",
                "layer", centered=True)
    for rank, label, w, toks, is_kernel in tops:
        plot_pattern(w, out / f"top{rank}_{label}.png", toks, f"{label} ({'kernel, min-max' if is_kernel else 'pattern'})",
                     normalise=is_kernel)
    laps.lap("plots_and_control")
    timing["total"] = laps.total()
    summary["timing"] = timing
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "timing.json").write_text(json.dumps(timing, indent=1))
    return summary


def separability_statement(ranking: HeadRanking, k: int = 10) -> str:
    """Which of the top k units are separable from the next (paired bootstrap, both metrics), in words."""
    if not ranking.separability:
        return "no separability: fewer than two verified units"
    acc = [s["unit"] for s in ranking.separability[:k] if s["drop_separable"]]
    lp = [s["unit"] for s in ranking.separability[:k] if s["logprob_drop_separable"]]
    n = len(ranking.separability[:k])
    return (f"Of the top {n} units, {len(acc)} differ from the next in accuracy drop ({', '.join(acc) or 'none'}) "
            f"and {len(lp)} in answer log-prob drop ({', '.join(lp) or 'none'}), by 95% paired bootstrap intervals "
            f"over {ranking.n_examples} prompts; the rest of the order is within noise.")
