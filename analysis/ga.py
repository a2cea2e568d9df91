"""Gather-and-Aggregate: choice scoring, accuracy, and head ranking by ablation (Bick, Xing, Gu 2025).

Glossary
    choice tokens   prompt and choice are tokenised together (merges across the boundary are
                    real: "is" + "42" may not be "is" then "42"). The choice tokens are the joint
                    tokens from the first position where the joint tokenisation departs from the
                    prompt's own (normally: right after the prompt's tokens; when a merge swallowed
                    the prompt's last token, the merged token counts as a choice token, scored
                    given everything before it).
    score           summed log-probability of the choice tokens; predicted = argmax over choices.
    context         the joint tokens minus the last: one forward of a context yields the
                    log-probabilities of every token of every choice it extends, so choices that
                    share a context (all single-token choices of a prompt) cost one row.
    unit            what `rank_heads` ablates at once: an attention head, a Zamba2 shared head of
                    one invocation ("L5SH3"), a Mamba-2 head, or a group of Mamba-1 channels
                    ("L2C0-63"): single channels are too many and too redundant to rank one by one.
    prefix reuse    ablating a unit of layer l cannot change the residual entering layer l: it is
                    computed once per layer (`stop_at_layer`) and every ablated run starts there.
    pair ablation   redundant heads hide from single-unit ranking (ablating one, its twin takes
                    over), so the top-k units are also ablated two at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from analysis.ablation import ablate_heads, head_layout
from analysis.patching import layer_inputs
from analysis.plots import save_table
from analysis.tasks import Example, encode, kv_retrieval, multiple_choice, segment_token_spans, tokenizer_of  # noqa: F401


# ------------------------------------------------------------------------------- scoring
@dataclass
class ChoiceBatch:
    """Left-padded context rows plus where each scored token is read."""

    tokens: Tensor  # [rows pos]
    attention_mask: Tensor | None  # [rows pos], None when nothing is padded
    rows: Tensor  # [picks] row of each scored position
    cols: Tensor  # [picks] column (padded coordinates) whose logits predict the target
    targets: Tensor  # [picks] the choice token scored there
    owner: Tensor  # [picks] flat (example, choice) slot the log-prob is added to
    segments: list[list[tuple[int, int]]]  # per row: each segment's (first, last) token, padded coordinates
    queries: list[int]  # per row: the prompt's last token (padded coordinates)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChoiceScorer:
    """Tokenise once, then score choices as often as needed (under ablations, from a layer's residual)."""

    def __init__(self, model: Any, examples: Sequence[Example], batch_size: int = 16) -> None:
        tok = tokenizer_of(model)
        self.model, self.examples = model, list(examples)
        self.n_choices = max(len(e.choices) for e in self.examples)
        contexts: list[tuple[int, tuple[int, ...], int, list[tuple[int, int]]]] = []  # (example, ids, query, spans)
        picks: list[tuple[int, tuple[int, ...], int, int, int]] = []  # (example, context needed, pos, target, slot)
        for i, ex in enumerate(self.examples):
            prompt = encode(tok, ex.prompt)
            spans = segment_token_spans(tok, ex) if ex.segments else []
            mine: list[tuple[int, ...]] = []
            for c, choice in enumerate(ex.choices):
                joint = encode(tok, ex.prompt + choice)
                k = common_prefix(prompt, joint)
                if k == 0 or len(joint) <= k:
                    raise ValueError(f"example {i}: choice {choice!r} adds no token after the prompt (or no context)")
                need = tuple(joint[:-1])
                if not any(ctx[: len(need)] == need for ctx in mine):  # keep only maximal contexts
                    mine = [ctx for ctx in mine if need[: len(ctx)] != ctx]
                    mine.append(need)
                picks += [(i, need, p, joint[p + 1], i * self.n_choices + c) for p in range(k - 1, len(joint) - 1)]
            for ctx in mine:
                contexts.append((i, ctx, len(prompt) - 1, spans))
        where = {}
        for n, (i, ctx, _, _) in enumerate(contexts):
            where.setdefault(i, []).append((ctx, n))
        resolved = []  # each pick read from a maximal context of its example that extends what it needs
        for i, need, p, target, slot in picks:
            n = next(n for ctx, n in where[i] if ctx[: len(need)] == need)
            resolved.append((n, p, target, slot))
        self.batches = self._batch(contexts, resolved, batch_size, model)

    def _batch(self, contexts, picks, batch_size: int, model: Any) -> list[ChoiceBatch]:
        tok = tokenizer_of(model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        device = next(model.parameters()).device
        order = sorted(range(len(contexts)), key=lambda n: len(contexts[n][1]))
        by_context: dict[int, list] = {}
        for n, p, target, slot in picks:
            by_context.setdefault(n, []).append((p, target, slot))
        batches = []
        for start in range(0, len(order), batch_size):
            members = order[start: start + batch_size]
            width = max(len(contexts[n][1]) for n in members)
            tokens = torch.full((len(members), width), pad, dtype=torch.long)
            mask = torch.zeros((len(members), width), dtype=torch.long)
            rows, cols, targets, owner, segments, queries = [], [], [], [], [], []
            for r, n in enumerate(members):
                _, ids, query, spans = contexts[n]
                off = width - len(ids)
                tokens[r, off:] = torch.tensor(ids)
                mask[r, off:] = 1
                segments.append([(a + off, b + off) for a, b in spans])
                queries.append(query + off)
                for p, target, slot in by_context.get(n, []):
                    rows.append(r), cols.append(p + off), targets.append(target), owner.append(slot)
            full = bool(mask.all())
            batches.append(ChoiceBatch(tokens.to(device), None if full else mask.to(device),
                                       *(torch.tensor(x, device=device) for x in (rows, cols, targets, owner)),
                                       segments, queries))
        return batches

    # ---------------------------------------------------------------------------- running
    def prefixes(self, layers: Sequence[int]) -> Iterator[tuple[int, list[Tensor]]]:
        """(l, [residual entering block l for each batch]) for ascending `layers`, one forward in all."""
        runs = [layer_inputs(self.model, b.tokens, b.attention_mask, layers) for b in self.batches]
        for items in zip(*runs):
            yield items[0][0], [resid for _, resid in items]

    def scores(self, start_at_layer: int | None = None, resids: Sequence[Tensor] | None = None,
               context: Callable[[ChoiceBatch], Any] | None = None) -> Float[Tensor, "example choice"]:
        """Summed log-probs [n_examples, max_choices] (-inf where an example has fewer choices).

        start_at_layer + resids: run from those residuals (see `prefixes`). context(batch): a
        context manager entered around each batch's forward (masking experiments).
        Only the scored positions go through the final norm and the unembedding.
        """
        model, n = self.model, self.model.cfg.n_layers
        flat = torch.zeros(len(self.examples) * self.n_choices, dtype=torch.float64)
        with torch.no_grad():
            for b, batch in enumerate(self.batches):
                with context(batch) if context is not None else contextlib.nullcontext():
                    if start_at_layer is None:
                        resid = model(batch.tokens, batch.attention_mask, stop_at_layer=n)
                    else:
                        resid = model(resids[b], batch.attention_mask, start_at_layer=start_at_layer,
                                      stop_at_layer=n, tokens=batch.tokens)
                picked = resid[batch.rows, batch.cols]
                logp = model.unembed(model.ln_final(picked[None]))[0].float().log_softmax(-1)
                values = logp.gather(1, batch.targets[:, None])[:, 0].double().cpu()
                flat.index_add_(0, batch.owner.cpu(), values)
        out = flat.view(len(self.examples), self.n_choices)
        for i, ex in enumerate(self.examples):
            out[i, len(ex.choices):] = float("-inf")
        return out

    def metrics(self, scores: Tensor) -> dict[str, float]:
        return {"accuracy": accuracy(scores, self.examples), "logprob": answer_logprob(scores, self.examples)}


def score_choices(model: Any, examples: Sequence[Example], batch_size: int = 16) -> Float[Tensor, "example choice"]:
    """Summed log-probability of each choice's tokens after its prompt (batched, padded)."""
    return ChoiceScorer(model, examples, batch_size).scores()


def accuracy(scores: Tensor, examples: Sequence[Example]) -> float:
    answers = torch.tensor([e.answer for e in examples])
    return (scores.argmax(-1) == answers).double().mean().item()


def answer_logprob(scores: Tensor, examples: Sequence[Example]) -> float:
    """Mean log-probability of the right choice, normalised over the choices (a smooth accuracy)."""
    answers = torch.tensor([e.answer for e in examples])
    return scores.log_softmax(-1).gather(1, answers[:, None]).mean().item()


# ------------------------------------------------------------------------------- ranking
@dataclass(frozen=True)
class Unit:
    label: str  # "L3H5", "L5SH3", "L2C0-63"
    layer: int
    module: str
    heads: tuple[int, ...]

    def specs(self) -> list[tuple[str, int]]:
        return [(self.module, h) for h in self.heads]


def head_units(model: Any, channel_group: int | None = None) -> list[Unit]:
    """Every head of every layer; Mamba-1 channels in groups of `channel_group` (default d_inner/16)."""
    units = []
    for m in head_layout(model).values():
        if m.width > 1 or m.kind == "attn":
            units += [Unit(f"L{m.layer}{m.tag}{h}", m.layer, m.prefix, (h,)) for h in range(m.n_heads)]
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
        """[layer, head] of `key` for the layers' own heads (NaN elsewhere; Zamba2 shared heads left out)."""
        own = [r for r in self.rows if "SH" not in r["unit"]]
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
        with ablate_heads(model, unit.specs(), mode=mode, mean_cache=mean_cache):
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
    rows = [{"unit": u.label, "layer": u.layer, "module": u.module, "index": _index(u),
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
        with ablate_heads(model, a.specs() + b.specs(), mode=mode, mean_cache=mean_cache):
            m = scorer.metrics(scorer.scores())
        drop = base["accuracy"] - m["accuracy"]
        singles = results[a.label], results[b.label]
        ranking.pairs.append({"pair": f"{a.label}+{b.label}", **m, "drop": drop,
                              "single_drops": sum(base["accuracy"] - s["accuracy"] for s in singles)})
    return ranking


def _index(unit: Unit) -> int:
    """Column of the unit in `HeadRanking.matrix`: the head, or the channel group's number."""
    return unit.heads[0] // len(unit.heads) if len(unit.heads) > 1 else unit.heads[0]


def __getattr__(name: str) -> Any:
    """`from analysis.ga import ga_scores` (DESIGN.md section 5): the scores live in analysis.ga_scores."""
    if name in ("ga_scores", "gather_only", "aggregate_only", "restrict_heads", "masked_accuracy"):
        from analysis import ga_scores as module

        return getattr(module, name)
    raise AttributeError(f"module 'analysis.ga' has no attribute {name!r}")
