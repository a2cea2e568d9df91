"""Gather-and-Aggregate: head ranking by ablation (Bick, Xing, Gu 2025).

Choices are scored by `analysis.tasks.scoring` (summed log-probability of each choice's tokens).

Glossary
    unit            what `rank_heads` ablates at once: an attention head, a Zamba2 shared head of
                    one invocation ("L5SH3"), a Mamba-2 head ("L0M3" where the layer also has
                    attention, Falcon-H1), or a group of Mamba-1 channels
                    ("L2C0-63"): single channels are too many and too redundant to rank one by one;
                    or a mixture-of-experts expert ("L3E5", `expert_units`, zero-ablated by
                    `ablate_experts`: pass `head_units(model) + expert_units(model)` as units).
    prefix reuse    ablating a unit of layer l cannot change the residual entering layer l: it is
                    computed once per layer (`stop_at_layer`) and every ablated run starts there. The
                    ranking's scorer keeps its clean run (every layer's residual and the baseline scores,
                    `ChoiceScorer(keep_clean=True)`) when it fits in KEEP_CLEAN_BYTES: the verified units,
                    the pairs and the report's control all start from it (`ranking_scorer`).
    pair ablation   redundant heads hide from single-unit ranking (ablating one, its twin takes
                    over), so the top-k units are also ablated two at a time. Pairs that share their
                    first unit a (the lower layer) run once with a ablated up to the last partner's layer,
                    then each pair from its second unit's layer, when that runs fewer layers than starting
                    every pair at a's layer (`pair_trees`).
    method          "exhaustive": every unit ablated exactly. "screened": every unit's effect
                    estimated by attribution (`analysis.ga.screening`, one forward + backward),
                    then the `verify_top` best by estimated (accuracy drop, log-prob drop), by
                    estimated log-prob drop and by estimated margin drop, the `pair_with` units and
                    `n_control` random others ablated exactly (experts too: their estimate is
                    through their routing weights); rows say `verified` (exact) or not
                    (estimates only, drop = NaN), and `control` marks the random draws.
    prescreen       (prescreen_n) every unit ablated exactly on a few prompts: a candidate source that
                    sees nonlinear effects first-order estimates miss (saturated attention).
    staged          (stage_n, stage_keep; screened) the screen's candidates and the random controls
                    are ablated exactly on `stage_n` prompts only (the first ones the unablated model
                    answers right, then the others: an accuracy drop is a right answer turned wrong, so
                    those prompts carry it); the `stage_keep` best candidates there (by accuracy drop,
                    then log-prob drop) and every control ranked above the last of them there go
                    on to the other prompts (their stage-1 scores are kept: each prompt is ablated
                    once), the `pair_with` units straight to every prompt. Rows say which stage each
                    unit reached (`stage`: "full": exact on every prompt, the exhaustive numbers;
                    "subset": exact on the first stage_n prompts, `stage_drop` / `stage_logprob_drop`;
                    "estimate": attribution only).
    screen recall   the control units that beat the screen's own 10th unit (a miss of the screen,
                    caught by chance): `HeadRanking.screen["control_misses"]`; their share of the
                    controls estimates the share of unverified units the screen missed. Staged: a
                    control left at stage 1 was below every candidate kept there.
    replicas        batched interventions: r units of one layer ablated in one forward of r tiled
                    copies of the batch (`ablate_heads_rows`); `replicas_for` is the rule.
    intervals       per verified unit: Clopper-Pearson interval of its accuracy, paired bootstrap
                    intervals of its accuracy drop and log-prob drop; `separability` says, for each
                    of the top 10, whether its effect differs from the next unit's (paired bootstrap
                    interval of the difference excludes 0), for both metrics.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from analysis.interventions.ablation import ablate_units, ablate_units_rows
from analysis.interventions.batching import tiles_for
from analysis.interventions.experts import ablate_expert_units
from analysis.intervals import clopper_pearson, paired_interval, separable
from analysis.plots import save_table
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example
from analysis.ga.settings import Laps, RankSettings, settings_of
from hooked.validate import Integer, Seq, check, checked
from hooked.models.decode_state import StateRefused
from hooked.models.model_map import Site, Unit, model_map


# The clean run a ranking keeps (`ChoiceScorer.clean_bytes`: every layer's residual, keys and values):
# SmolLM2-135M with the report's 16 prompts of 5 pairs, 167 MiB; a bf16 8B model (32 layers, d_model
# 4096), ~1,300 prompt tokens. Above this budget every resume recomputes the clean prefix (memory, not time).
KEEP_CLEAN_BYTES = 2**30


def ranking_scorer(model: Any, examples: Sequence[Example], batch_size: int = 16) -> ChoiceScorer:
    """The scorer `rank_heads` builds: it keeps its clean run when that fits in KEEP_CLEAN_BYTES. Pass it to
    `rank_heads(scorer=...)` and to later runs on the same prompts (the report's control) to reuse it."""
    scorer = ChoiceScorer(model, examples, batch_size)
    scorer.keep_clean = scorer.clean_bytes() <= KEEP_CLEAN_BYTES
    return scorer


# ------------------------------------------------------------------------------- ranking
@contextlib.contextmanager
def ablated(model: Any, units: Sequence[Unit], mode: str = "zero", mean_cache: Any = None):
    """Ablate every unit at once (the map's units: they carry their sites): heads as ablate_heads, experts as
    ablate_experts (zero only)."""
    heads = [u for u in units if u.kind == "head"]
    experts = [u for u in units if u.kind == "expert"]
    if experts and mode != "zero":
        raise ValueError(f"expert units are zero-ablated only, got mode={mode!r}")
    with contextlib.ExitStack() as stack:
        if heads:
            stack.enter_context(ablate_units(model, heads, mode=mode, mean_cache=mean_cache))
        if experts:
            stack.enter_context(ablate_expert_units(model, experts))
        yield model


def expert_units(model: Any) -> list[Unit]:
    """One unit per expert of every mixture-of-experts MLP ("L3E5": layer 3, expert 5): the model map's."""
    return model_map(model).experts()


def head_units(model: Any, channel_group: int | None = None) -> list[Unit]:
    """Every head of every layer; Mamba-1 channels in groups of `channel_group` (default d_inner/16)."""
    if channel_group is not None:  # 0 would otherwise read as the default
        channel_group = check(channel_group, "head_units: channel_group", Integer(ge=1))
    return model_map(model).units(channel_group)  # labels and groups: hooked.models.model_map


@dataclass
class HeadRanking:
    baseline: dict[str, float]
    rows: list[dict[str, Any]]  # one per unit, sorted by accuracy drop then log-prob drop (verified first)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    n_examples: int = 0
    method: str = "exhaustive"
    screen: dict[str, Any] = field(default_factory=dict)  # screened: counts, control units, misses
    separability: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, dict[str, float]] = field(default_factory=dict)  # per step: wall and CPU seconds

    def top(self, k: int = 2) -> list[str]:
        return [r["unit"] for r in self.rows[:k]]

    def verified(self) -> list[str]:
        return [r["unit"] for r in self.rows if r["verified"]]

    def matrix(self, key: str = "drop", n_layers: int | None = None) -> Tensor:
        """[layer, head] of `key` for the layers' own heads (NaN elsewhere; Zamba2 shared heads, Falcon-H1's
        parallel SSM heads ("L0M3") and experts left out)."""
        own = [r for r in self.rows if "SH" not in r["unit"] and "M" not in r["unit"] and r.get("kind", "head") == "head"]
        layers = n_layers or (max(r["layer"] for r in own) + 1)
        width = max(r["index"] for r in own) + 1
        out = torch.full((layers, width), float("nan"))
        for r in own:
            out[r["layer"], r["index"]] = r[key]
        return out

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    def to_csv(self, path: str | Path) -> None:
        save_table(self.rows, path)


def replicas_for(model: Any, scorer: ChoiceScorer, limit: int | None = None) -> int:
    """How many units one forward ablates (rows tiled per unit), the batching rule.

    On an accelerator: as many as keep a forward under 512 rows (its throughput grows with the
    batch). On CPU a forward of a few hundred thousand activation elements per layer
    (rows x positions x d_model) is already compute-bound, and tiling only saves the per-forward
    overhead (hooks, small kernels): units are batched while one forward stays under 2**17 elements
    (benchmarks/bench_screening.py measures both). `limit` caps the answer.
    """
    rows = max(len(b.tokens) for b in scorer.batches)
    width = max(b.tokens.shape[1] for b in scorer.batches)
    return tiles_for(model, rows, width, limit)


def _exact(model: Any, scorer: ChoiceScorer, units: Sequence[Unit], mode: str, mean_cache: Any,
           reuse_prefix: bool, replicas: int, bar: Any) -> dict[str, Tensor]:
    """Scores [example choice] with each unit ablated alone; units of a layer `replicas` per forward."""
    out: dict[str, Tensor] = {}

    def run(chunk: list[Unit], start: int | None, resids: list[Tensor] | None) -> None:
        alone = len(chunk) == 1 and chunk[0].kind != "head"  # experts: one ablation per forward
        with (ablated(model, chunk, mode, mean_cache) if alone
              else ablate_units_rows(model, [[u] for u in chunk], mode=mode, mean_cache=mean_cache)):
            scores = scorer.scores(start, resids, replicas=len(chunk))
        for u, sc in zip(chunk, scores if len(chunk) > 1 else [scores]):
            out[u.label] = sc
        bar.update(len(chunk))

    def chunks(layer_units: list[Unit]) -> list[list[Unit]]:
        heads = [u for u in layer_units if u.kind == "head"]
        return [heads[i:i + replicas] for i in range(0, len(heads), replicas)] + [[u] for u in layer_units
                                                                                 if u.kind != "head"]

    layers = sorted({u.layer for u in units})
    if reuse_prefix:
        for layer, resids in scorer.prefixes(layers):
            for chunk in chunks([u for u in units if u.layer == layer]):
                run(chunk, layer, resids)
    else:
        for chunk in chunks(list(units)):
            run(chunk, None, None)
    return out


def _row(unit: Unit, scores: Tensor, scorer: ChoiceScorer, base_ex: dict[str, Tensor], confidence: float,
         seed: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
    ex = scorer.per_example(scores)
    n = len(ex["correct"])
    acc_lo, acc_hi = clopper_pearson(int(ex["correct"].sum()), n, confidence)
    d_lo, d_hi = paired_interval(base_ex["correct"] - ex["correct"], confidence, seed=seed)
    l_lo, l_hi = paired_interval(base_ex["logprob"] - ex["logprob"], confidence, seed=seed)
    m = scorer.metrics(scores)
    base = {k: v.mean().item() for k, v in base_ex.items()}
    return ({"unit": unit.label, "layer": unit.layer, "module": unit.module, "kind": unit.kind, "index": _index(unit),
             "heads": " ".join(map(str, unit.heads)), **m, "accuracy_lo": acc_lo, "accuracy_hi": acc_hi,
             "drop": base["correct"] - m["accuracy"], "drop_lo": d_lo, "drop_hi": d_hi,
             "logprob_drop": base["logprob"] - m["logprob"], "logprob_drop_lo": l_lo, "logprob_drop_hi": l_hi},
            ex)


@checked(examples=Seq())
def rank_heads(model: Any, examples: Sequence[Example], units: Sequence[Unit] | None = None,
               settings: RankSettings | None = None, *, mean_cache: Any = None, pair_with: Sequence[Unit | str] = (),
               scorer: ChoiceScorer | None = None, **loose: Any) -> HeadRanking:
    """Accuracy (and answer log-prob) drop when each unit is ablated, with intervals; then pairs.

    settings: a RankSettings (settings.py; default RankSettings()); the old loose keywords
    (`rank_heads(model, examples, batch_size=8, method="screened")`) replace its fields.

    method: "exhaustive" (every unit exact) or "screened" (see the glossary; with verify_top >= the
    number of units it ranks exhaustively, the screen's estimates being no saving, and says so in
    `ranking.screen["exhaustive"]`; `ranking.method` is then "exhaustive"). replicas: units per
    forward (None: `replicas_for`'s rule; 1: one ablation per forward). prescreen_n (screened): also
    ablate every unit exactly on the first `prescreen_n` prompts and verify its `verify_top` best.
    refine (screened): the estimate's refinement, "none", "scores" or "qk" (`estimate_effects`).
    stage_n (screened): staged verification (glossary); None or >= the prompts: one stage.
    Pairs: every pair among the top `pairs_top_k` units by single-unit drop plus the units in
    `pair_with` (Units or labels; e.g. the best aggregate scorers): redundant heads each cost little
    alone, so single-unit ranking alone would never pair them.
    scorer: a `ranking_scorer` over `examples` to reuse (default: a new one).
    """
    s = settings_of(settings, loose, RankSettings(), "rank_heads")
    mp = model_map(model)  # asked once: the units (default every head) and the sites they are ranked among
    units = mp.units(s.channel_group) if units is None else mp.placed(units)
    return rank_units(model, examples, units, s, mp.mixers(), mean_cache=mean_cache, pair_with=pair_with,
                      scorer=scorer)


def rank_units(model: Any, examples: Sequence[Example], units: Sequence[Unit], s: RankSettings,
               sites: Sequence[Site], *, mean_cache: Any = None, pair_with: Sequence[Unit | str] = (),
               scorer: ChoiceScorer | None = None) -> HeadRanking:
    """`rank_heads` on the model map's `units` (they carry their sites) with settings `s`; `sites`: the map's token
    mixers (the QK fix's attention among them). The entry points (rank_heads, ga_report) build the map once."""
    method, batch_size, reuse_prefix, pairs_top_k, mode = s.method, s.batch_size, s.reuse_prefix, s.pairs_top_k, s.mode
    progress, verify_top, n_control, seed = s.progress, s.verify_top, s.n_control, s.seed
    replicas, confidence, prescreen_n, refine, stage_n = s.replicas, s.confidence, s.prescreen_n, s.refine, s.stage_n
    stage_keep = s.stage_keep
    if scorer is None:
        scorer = ranking_scorer(model, examples, batch_size)
    elif scorer.model is not model or scorer.examples != list(examples):
        raise ValueError("scorer must be a ChoiceScorer of this model over the same examples")
    units = list(units)
    # a screen that would verify every unit anyway costs its estimates on top: rank exhaustively
    exhaustive_instead = method == "screened" and verify_top >= len(units)
    if exhaustive_instead:
        method = "exhaustive"
    by_label = {u.label: u for u in units}
    extra = []
    for e in pair_with:
        unit = by_label.get(e if isinstance(e, str) else e.label)
        if unit is None:
            raise KeyError(f"pair_with: {e!r} is not one of the ranked units")
        extra.append(unit)
    clock = Laps()
    base_scores = scorer.clean_scores()
    base, base_ex = scorer.metrics(base_scores), scorer.per_example(base_scores)
    n = len(scorer.examples)
    base.update(zip(("accuracy_lo", "accuracy_hi"), clopper_pearson(int(base_ex["correct"].sum()), n, confidence)))
    estimates: dict[str, dict[str, float]] = {}
    control: list[Unit] = []
    stage_units: set[str] = set()
    stage_prompts: list[int] = []
    staged_exact: dict[str, Tensor] = {}  # stage-1 scores of the units that go on to the other prompts
    if method == "screened":
        from analysis.ga.screening import unit_effects

        # heads, channel groups, experts; refine: analysis.ga.screening.estimate_effects
        clock.lap("baseline")
        estimates = unit_effects(model, scorer, units, sites, mode, mean_cache, refine)
        clock.lap("estimates")
        pre: list[Unit] = []
        if prescreen_n:
            pre = _prescreen(model, scorer, units, prescreen_n, batch_size, mode, mean_cache, reuse_prefix,
                             replicas, estimates, progress)
        chosen = list(dict.fromkeys(candidates(units, estimates, verify_top) + pre[:verify_top] + extra))
        rest = [u for u in units if u not in chosen]
        control = random.Random(seed).sample(rest, min(n_control, len(rest)))
        for u in units:
            estimates[u.label].update(stage_drop=math.nan, stage_logprob_drop=math.nan)
        if stage_n is not None and stage_n < n:
            staged = [u for u in chosen if u.kind == "head" and u not in extra]
            checks = [u for u in control if u.kind == "head"]
            right = base_ex["correct"].bool().tolist()
            stage_prompts = sorted(([i for i in range(n) if right[i]] + [i for i in range(n) if not right[i]])[:stage_n])
            ranked = _prescreen(model, scorer, staged + checks, stage_prompts, batch_size, mode, mean_cache,
                                reuse_prefix, replicas, estimates, progress, key="stage", desc="stage 1",
                                keep=staged_exact)
            stage_units = {u.label for u in staged + checks}
            clock.lap("stage1")
            leaders = [u for u in ranked if u not in checks][:stage_keep]
            ranked_at = {u.label: i for i, u in enumerate(ranked)}
            bar_at = max((ranked_at[u.label] for u in leaders), default=-1)
            promoted = [u for u in checks if ranked_at[u.label] <= bar_at]
            staged_exact = {u.label: staged_exact[u.label] for u in leaders + promoted}
            chosen = list(dict.fromkeys(leaders + [u for u in chosen if u not in staged]))
            control_full = [u for u in control if u not in checks] + promoted
        else:
            control_full = control
        to_verify = [u for u in units if u in set(chosen) | set(control_full)]  # forward order
    else:
        to_verify = units
    r = replicas or replicas_for(model, scorer)
    bar = tqdm(total=len(to_verify), desc="rank_heads", disable=not progress)
    clock.lap("baseline" if method == "exhaustive" else "choose")
    direct = [u for u in to_verify if u.label not in staged_exact]
    exact = _exact(model, scorer, direct, mode, mean_cache, reuse_prefix, r, bar)
    if staged_exact:  # the rest of the prompts for the units that reached stage 2 from stage 1
        rest_prompts = [i for i in range(n) if i not in set(stage_prompts)]
        rest = ChoiceScorer(model, [scorer.examples[i] for i in rest_prompts], batch_size, scorer.shared_prefix)
        later = _exact(model, rest, [u for u in to_verify if u.label in staged_exact], mode, mean_cache,
                       reuse_prefix, replicas or replicas_for(model, rest), bar)
        for label, first in staged_exact.items():
            exact[label] = _merge(n, scorer.n_choices, [(stage_prompts, first), (rest_prompts, later[label])])
    clock.lap("exact")
    bar.close()
    rows, per_ex = [], {}
    for u in units:
        if u.label in exact:
            row, per_ex[u.label] = _row(u, exact[u.label], scorer, base_ex, confidence, seed)
        else:
            row = {"unit": u.label, "layer": u.layer, "module": u.module, "kind": u.kind, "index": _index(u),
                   "heads": " ".join(map(str, u.heads)), "drop": math.nan, "logprob_drop": math.nan}
        row["verified"] = u.label in exact
        if estimates:
            row.update(estimates[u.label], control=u in control,
                       stage="full" if row["verified"] else "subset" if u.label in stage_units else "estimate")
        rows.append(row)

    def order(r: dict[str, Any]) -> tuple:
        tier = 0 if r["verified"] else 1 if r.get("stage") == "subset" else 2
        return (tier, -_or(r["drop"], r.get("stage_drop") if tier == 1 else r.get("est_drop")),
                -_or(r["logprob_drop"], r.get("stage_logprob_drop") if tier == 1 else r.get("est_logprob_drop")))

    rows.sort(key=order)
    ranking = HeadRanking(base, rows, n_examples=n, method=method, timing=clock.laps)
    ranking.separability = _separability(rows, per_ex, confidence, seed)
    if exhaustive_instead:
        ranking.screen = {"n_units": len(units), "exhaustive": f"verify_top={verify_top} >= {len(units)} units"}
    if method == "screened":
        verified = [r for r in rows if r["verified"]]
        picked = [r for r in verified if not r["control"]] or verified
        tenth = picked[min(9, len(picked) - 1)]  # the screen's own 10th unit
        bar = (tenth["drop"], tenth["logprob_drop"])
        misses = [r["unit"] for r in verified if r["control"] and (r["drop"], r["logprob_drop"]) > bar]
        ranking.screen = {"n_units": len(units), "n_verified": len(to_verify),
                          "n_candidates": len(to_verify) - len(control_full),
                          "n_control_full": len(control_full),
                          "n_control": len(control), "control_units": [u.label for u in control],
                          "n_stage1": len(stage_units), "stage_prompts": sorted(stage_prompts),
                          "control_misses": misses, "tenth_drop": tenth["drop"],
                          "estimate_vs_exact": estimate_agreement(rows)}
    top = [by_label[r["unit"]] for r in rows[:pairs_top_k] if r["verified"]]
    top += [u for u in extra if u not in top]
    pairs = list(itertools.combinations(top, 2))
    clock.lap("rows")
    pair_scores = _pairs_exact(model, scorer, pairs, mode, mean_cache, reuse_prefix, progress)
    for a, b in pairs:
        scores = pair_scores[(a.label, b.label)]
        m, ex = scorer.metrics(scores), scorer.per_example(scores)
        singles = per_ex[a.label], per_ex[b.label]
        ranking.pairs.append({"pair": f"{a.label}+{b.label}", **m, "drop": base["accuracy"] - m["accuracy"],
                              **dict(zip(("drop_lo", "drop_hi"), paired_interval(base_ex["correct"] - ex["correct"],
                                                                               confidence, seed=seed))),
                              "logprob_drop": base["logprob"] - m["logprob"],
                              "single_drops": sum(base["accuracy"] - s["correct"].mean().item() for s in singles)})
    clock.lap("pairs")
    return ranking


def candidates(units: Sequence[Unit], estimates: dict[str, dict[str, float]], verify_top: int) -> list[Unit]:
    """The screen's picks: the `verify_top` best units by estimated (accuracy drop, log-prob drop), by
    estimated log-prob drop and by estimated margin drop (union, in that order)."""
    def best(key: Any) -> list[Unit]:
        return sorted(units, key=key)[:verify_top]

    e = estimates
    picks = (best(lambda u: (-e[u.label]["est_drop"], -e[u.label]["est_logprob_drop"]))
             + best(lambda u: -e[u.label]["est_logprob_drop"]) + best(lambda u: -e[u.label]["est_margin_drop"]))
    return list(dict.fromkeys(picks))


def _prescreen(model: Any, scorer: ChoiceScorer, units: list[Unit], n: int | Sequence[int], batch_size: int,
               mode: str, mean_cache: Any, reuse_prefix: bool, replicas: int | None, estimates: dict, progress: bool,
               key: str = "pre", desc: str = "prescreen", keep: dict[str, Tensor] | None = None) -> list[Unit]:
    """`units` ablated exactly on the first `n` prompts (or the prompts of index `n`) only; sorted by that
    (drop, log-prob drop), which goes into estimates[label] as f"{key}_drop", f"{key}_logprob_drop"
    (and each unit's scores [prompts choice] into `keep`, when given).

    The prescreen (every unit) is the fallback where first-order estimates fail (saturated attention
    or output: the organisms): it costs n / n_prompts of an exhaustive ranking and sees every
    nonlinearity. Staged verification runs it on the screen's candidates.
    """
    picked = scorer.examples[:n] if isinstance(n, int) else [scorer.examples[i] for i in n]
    sub = ChoiceScorer(model, picked, batch_size, scorer.shared_prefix)
    sub.keep_clean = scorer.keep_clean  # one clean run: the baseline and every layer's resume
    base = sub.per_example(sub.clean_scores())
    bar = tqdm(total=len(units), desc=desc, disable=not progress)
    exact = _exact(model, sub, units, mode, mean_cache, reuse_prefix, replicas or replicas_for(model, sub), bar)
    bar.close()
    if keep is not None:
        keep.update(exact)
    for u in units:
        ex = sub.per_example(exact[u.label])
        estimates[u.label].update({f"{key}_drop": (base["correct"] - ex["correct"]).mean().item(),
                                   f"{key}_logprob_drop": (base["logprob"] - ex["logprob"]).mean().item()})
    return sorted(units, key=lambda u: (-estimates[u.label][f"{key}_drop"], -estimates[u.label][f"{key}_logprob_drop"]))


def _pairs_exact(model: Any, scorer: ChoiceScorer, pairs: list[tuple[Unit, Unit]], mode: str, mean_cache: Any,
                 reuse_prefix: bool, progress: bool) -> dict[tuple[str, str], Tensor]:
    """Scores with both units of each pair ablated; each run starts at the pair's first layer (prefix reuse),
    or, for the pairs of a `pair_trees` root, at the second unit's layer of a run with the root ablated."""
    out = {}
    trees = pair_trees(pairs, model.cfg.n_layers) if reuse_prefix and pairs else {}
    bar = tqdm(total=len(pairs), desc="pairs", disable=not progress)

    def run(a: Unit, b: Unit, start: int | None, resids: list[Any] | None) -> None:
        with ablated(model, [a, b], mode, mean_cache):
            out[(a.label, b.label)] = scorer.scores(start, resids)
        bar.update()

    if reuse_prefix and pairs:
        grouped = {p for group in trees.values() for p in group}
        direct = [p for p in pairs if p not in grouped]
        starts = sorted({min(a.layer, b.layer) for a, b in direct} | {root.layer for root in trees})
        for layer, resids in scorer.prefixes(starts):
            for a, b in direct:
                if min(a.layer, b.layer) == layer:
                    run(a, b, layer, resids)
            for root in [r for r in trees if r.layer == layer]:
                partner = {p: p[1] if p[0] == root else p[0] for p in trees[root]}
                try:
                    with ablated(model, [root], mode, mean_cache):
                        later = dict(scorer.prefixes({u.layer for u in partner.values()}, layer, resids))
                except StateRefused:  # the root's hooks need whole rows: every pair from the root's layer
                    later = {}
                for (a, b), other in partner.items():
                    try:
                        run(a, b, other.layer, later[other.layer]) if later else run(a, b, layer, resids)
                    except StateRefused:  # the partner's hooks need whole rows, which start from the clean run
                        run(a, b, layer, resids)
    else:
        for a, b in pairs:
            run(a, b, None, None)
    bar.close()
    return out


def pair_trees(pairs: Sequence[tuple[Unit, Unit]], n_layers: int) -> dict[Unit, list[tuple[Unit, Unit]]]:
    """Pairs grouped under their shared first unit (the lower layer; pairs within one layer are left out),
    for the roots where one run with the root ablated, up to its last partner's layer, then each pair from
    its partner's layer, runs fewer layers than every pair from the root's layer (the order is kept)."""
    groups: dict[Unit, list[tuple[Unit, Unit]]] = {}
    for a, b in pairs:
        if a.layer != b.layer:
            groups.setdefault(a if a.layer < b.layer else b, []).append((a, b))
    out = {}
    for root, group in groups.items():
        layers = [max(a.layer, b.layer) for a, b in group]
        shared = (max(layers) - root.layer) + sum(n_layers - layer for layer in layers)
        if shared < len(group) * (n_layers - root.layer):
            out[root] = group
    return out


def _merge(n: int, n_choices: int, parts: list[tuple[Sequence[int], Tensor]]) -> Tensor:
    """Scores [n n_choices] from parts (prompt indices, their scores [len(indices) choices <= n_choices];
    -inf where a prompt has fewer choices)."""
    out = torch.full((n, n_choices), -math.inf, dtype=parts[0][1].dtype)
    for index, scores in parts:
        out[list(index), : scores.shape[1]] = scores
    return out


def _or(value: float, fallback: float | None) -> float:
    return fallback if (value is None or math.isnan(value)) and fallback is not None else value


def _separability(rows: list[dict[str, Any]], per_ex: dict[str, dict[str, Tensor]], confidence: float,
                  seed: int, k: int = 10) -> list[dict[str, Any]]:
    """For each of the top k verified units: is its effect different from the next verified unit's?"""
    verified = [r["unit"] for r in rows if r["verified"]][: k + 1]
    out = []
    for a, b in zip(verified, verified[1:]):
        item = {"unit": a, "next": b}
        for metric, key in (("correct", "drop"), ("logprob", "logprob_drop")):
            # drop_a - drop_b = (base - a) - (base - b) = b - a, per example
            yes, (lo, hi) = separable(per_ex[b][metric], per_ex[a][metric], confidence, seed=seed)
            item.update({f"{key}_diff_lo": lo, f"{key}_diff_hi": hi, f"{key}_separable": yes})
        out.append(item)
    return out


def estimate_agreement(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Pearson correlation of estimated and exact drops over the verified units (screened rankings)."""
    out: dict[str, float | None] = {}
    ver = [r for r in rows if r["verified"] and "est_drop" in r]
    for key in ("drop", "logprob_drop"):
        x = torch.tensor([r[f"est_{key}"] for r in ver], dtype=torch.float64)
        y = torch.tensor([r[key] for r in ver], dtype=torch.float64)
        ok = len(ver) > 2 and x.std() > 0 and y.std() > 0
        out[f"pearson_{key}"] = torch.corrcoef(torch.stack([x, y]))[0, 1].item() if ok else None
    return out


def _index(unit: Unit) -> int:
    """Column of the unit in `HeadRanking.matrix`: the head, or the channel group's number."""
    return unit.heads[0] // len(unit.heads) if len(unit.heads) > 1 else unit.heads[0]
