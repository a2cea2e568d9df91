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
                    computed once per layer (`stop_at_layer`) and every ablated run starts there.
    pair ablation   redundant heads hide from single-unit ranking (ablating one, its twin takes
                    over), so the top-k units are also ablated two at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from analysis.interventions.ablation import ablate_heads, head_layout
from analysis.interventions.experts import ablate_experts, moe_layout
from analysis.plots import save_table
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example


# ------------------------------------------------------------------------------- ranking
@dataclass(frozen=True)
class Unit:
    label: str  # "L3H5", "L5SH3", "L2C0-63", "L3E5"
    layer: int
    module: str
    heads: tuple[int, ...]  # head ids, or expert ids when kind == "expert"
    kind: str = "head"  # "head" (ablate_heads) or "expert" (ablate_experts)

    def specs(self) -> list[tuple[str, int]]:
        return [(self.module, h) for h in self.heads]


@contextlib.contextmanager
def ablated(model: Any, units: Sequence[Unit], mode: str = "zero", mean_cache: Any = None):
    """Ablate every unit at once: heads through ablate_heads, experts through ablate_experts (zero only)."""
    heads = [s for u in units if u.kind == "head" for s in u.specs()]
    experts = [s for u in units if u.kind == "expert" for s in u.specs()]
    if experts and mode != "zero":
        raise ValueError(f"expert units are zero-ablated only, got mode={mode!r}")
    with contextlib.ExitStack() as stack:
        if heads:
            stack.enter_context(ablate_heads(model, heads, mode=mode, mean_cache=mean_cache))
        if experts:
            stack.enter_context(ablate_experts(model, experts))
        yield model


def expert_units(model: Any) -> list[Unit]:
    """One unit per expert of every mixture-of-experts MLP ("L3E5": layer 3, expert 5)."""
    units = []
    for prefix, n in moe_layout(model).items():
        layer = int(prefix.split(".")[1])
        units += [Unit(f"L{layer}E{e}", layer, prefix, (e,), "expert") for e in range(n)]
    return units


def head_units(model: Any, channel_group: int | None = None) -> list[Unit]:
    """Every head of every layer; Mamba-1 channels in groups of `channel_group` (default d_inner/16)."""
    units = []
    layout = head_layout(model)
    for m in layout.values():
        # a layer with attention AND a mixer side by side (Falcon-H1): its SSM heads are "L0M3"
        tag = "M" if m.kind == "ssm" and f"blocks.{m.layer}.attn" in layout else m.tag
        if m.width > 1 or m.kind == "attn":
            units += [Unit(f"L{m.layer}{tag}{h}", m.layer, m.prefix, (h,)) for h in range(m.n_heads)]
            continue
        size = channel_group or max(1, m.n_heads // 16)
        for a in range(0, m.n_heads, size):
            b = min(a + size, m.n_heads)
            units.append(Unit(f"L{m.layer}C{a}-{b - 1}", m.layer, m.prefix, tuple(range(a, b))))
    return units


@dataclass
class HeadRanking:
    baseline: dict[str, float]
    rows: list[dict[str, Any]]  # one per unit, sorted by accuracy drop then log-prob drop
    pairs: list[dict[str, Any]] = field(default_factory=list)
    n_examples: int = 0

    def top(self, k: int = 2) -> list[str]:
        return [r["unit"] for r in self.rows[:k]]

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


def rank_heads(model: Any, examples: Sequence[Example], units: Sequence[Unit] | None = None, *,
               batch_size: int = 16, reuse_prefix: bool = True, pairs_top_k: int = 4, mode: str = "zero",
               mean_cache: Any = None, channel_group: int | None = None, progress: bool = True,
               pair_with: Sequence[Unit | str] = ()) -> HeadRanking:
    """Accuracy (and answer log-prob) drop when each unit is ablated; then pairs.

    Pairs: every pair among the top `pairs_top_k` units by single-unit drop plus the units in
    `pair_with` (Units or labels; e.g. the best aggregate scorers): redundant heads each cost little
    alone, so single-unit ranking alone would never pair them.
    """
    scorer = ChoiceScorer(model, examples, batch_size)
    units = list(units) if units is not None else head_units(model, channel_group)
    base = scorer.metrics(scorer.scores())
    bar = tqdm(total=len(units), desc="rank_heads", disable=not progress)
    results: dict[str, dict[str, float]] = {}

    def run(unit: Unit, start: int | None, resids: list[Tensor] | None) -> None:
        with ablated(model, [unit], mode, mean_cache):
            results[unit.label] = scorer.metrics(scorer.scores(start, resids))
        bar.update()

    layers = sorted({u.layer for u in units})
    if reuse_prefix:
        for layer, resids in scorer.prefixes(layers):
            for unit in (u for u in units if u.layer == layer):
                run(unit, layer, resids)
    else:
        for unit in units:
            run(unit, None, None)
    bar.close()
    rows = [{"unit": u.label, "layer": u.layer, "module": u.module, "kind": u.kind, "index": _index(u),
             "heads": " ".join(map(str, u.heads)), **results[u.label],
             "drop": base["accuracy"] - results[u.label]["accuracy"],
             "logprob_drop": base["logprob"] - results[u.label]["logprob"]} for u in units]
    rows.sort(key=lambda r: (-r["drop"], -r["logprob_drop"]))
    ranking = HeadRanking(base, rows, n_examples=len(scorer.examples))
    by_label = {u.label: u for u in units}
    top = [by_label[r["unit"]] for r in rows[:pairs_top_k]]
    for extra in pair_with:
        unit = by_label.get(extra if isinstance(extra, str) else extra.label)
        if unit is None:
            raise KeyError(f"pair_with: {extra!r} is not one of the ranked units")
        if unit not in top:
            top.append(unit)
    for a, b in tqdm(list(itertools.combinations(top, 2)), desc="pairs", disable=not progress):
        with ablated(model, [a, b], mode, mean_cache):
            m = scorer.metrics(scorer.scores())
        drop = base["accuracy"] - m["accuracy"]
        singles = results[a.label], results[b.label]
        ranking.pairs.append({"pair": f"{a.label}+{b.label}", **m, "drop": drop,
                              "single_drops": sum(base["accuracy"] - s["accuracy"] for s in singles)})
    return ranking


def _index(unit: Unit) -> int:
    """Column of the unit in `HeadRanking.matrix`: the head, or the channel group's number."""
    return unit.heads[0] // len(unit.heads) if len(unit.heads) > 1 else unit.heads[0]
