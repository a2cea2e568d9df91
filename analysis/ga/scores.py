"""Gather and Aggregate scores from attention patterns and SSM kernels, and the masking contexts.

Glossary
    weights      w[b, head, q, k]: how much query position q reads key position k. Attention:
                 the pattern (rows sum to 1 over real keys). SSM heads: the kernel's magnitude,
                 row-normalised, w = |K[q, k]| / sum_k' |K[q, k']| (DESIGN.md section 4: row =
                 target, column = source; the D skip and the conv are not in the kernel).
    segment s    token positions [first_s, last_s]; last_s is its segment-final token (the newline
                 ending a `key:value` line or an answer option).
    gather       mean over segments of sum_{k = first_s}^{last_s - 1} w[last_s, k]: the share of the
                 segment-final token's reading that comes from the rest of its own segment (the
                 token itself excluded, so a head that only attends to itself scores 0). In [0, 1].
    aggregate    sum_s w[query, last_s]: the share of the query position's reading that lands on
                 segment-final tokens. In [0, 1]; uniform reading scores n_segments / (query + 1).
    unit score   mean over the unit's heads (a Mamba-1 channel group: its channels), then over
                 examples.
    Gather pattern     a head restricted to gathering: each segment-final row may read only its own
                 segment [first_s, last_s]; other rows untouched.
    Aggregate pattern  a head restricted to aggregating: the query row may read only segment-final
                 tokens; other rows untouched.
    mode         how attention rows are restricted: "scores" sets the cut scores to the dtype's
                 minimum before the softmax (the row renormalises over what is left), "pattern"
                 zeroes the cut entries after it (no renormalisation; G&A's Zamba2 masking). SSM
                 heads always zero the cut kernel entries (kernels are not normalised).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.interventions.ablation import attached, resolve_heads
from analysis.kernel_rows import _positions
from analysis.ga.ranking import Unit
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example, encode_prompts
from hooked.validate import Integer, Seq, checked
from hooked.models.model_map import Site, model_map
from hooked.models.protocol import Mixing


# ----------------------------------------------------------------------------- weights
def weight_rows_hooks(site: Site, rows: Tensor, on_rows: Callable[[Tensor], None]) -> list[tuple[str, Callable]]:
    """Forward hooks calling on_rows(x[:, :, rows]) with x the mixing matrix of the head module `site` (the
    model map's): rows of the pattern, or of the kernel without the pos x pos tensor (matrix_slices).
    Their weights are the site's `mixing().weights` (the pattern as is; |kernel| row-normalised)."""
    hooks = site.module.matrix_slices(lambda pos, device: _positions(rows, pos, "rows", device), on_rows)
    return [(point.name, fn) for point, fn in hooks]


# ------------------------------------------------------------------------------- masks
def gather_edges(shape: tuple[int, int], segments: Sequence[Sequence[tuple[int, int]]]) -> tuple[Tensor, Tensor]:
    """(rows [batch q], allowed [batch q k]) of the Gather pattern."""
    batch, pos = shape
    rows = torch.zeros(batch, pos, dtype=torch.bool)
    allowed = torch.zeros(batch, pos, pos, dtype=torch.bool)
    for b, spans in enumerate(segments):
        for first, last in spans:
            rows[b, last] = True
            allowed[b, last, first: last + 1] = True
    return rows, allowed


def aggregate_edges(shape: tuple[int, int], segments: Sequence[Sequence[tuple[int, int]]],
                    queries: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(rows [batch q], allowed [batch q k]) of the Aggregate pattern."""
    batch, pos = shape
    rows = torch.zeros(batch, pos, dtype=torch.bool)
    allowed = torch.zeros(batch, pos, pos, dtype=torch.bool)
    for b, (spans, q) in enumerate(zip(segments, queries)):
        rows[b, q] = True
        for _, last in spans:
            allowed[b, q, last] = True
    return rows, allowed


def gather_exclusive_mask(segments: Sequence[Sequence[tuple[int, int]]], shape: tuple[int, int]) -> Tensor:
    """[batch q k]: True at (last_s, k) for k in [first_s, last_s) (the gather score's support)."""
    _, allowed = gather_edges(shape, segments)
    for b, spans in enumerate(segments):
        for _, last in spans:
            allowed[b, last, last] = False
    return allowed


@contextlib.contextmanager
def restrict_heads(model: Any, heads: Sequence[Any], rows: Tensor, allowed: Tensor,
                   mode: str = "scores") -> Iterator[Any]:
    """Cut every edge (q, k) with rows[b, q] and not allowed[b, q, k] in the listed heads."""
    if mode not in ("scores", "pattern"):
        raise ValueError(f"mode must be 'scores' or 'pattern', got {mode!r}")
    mp = model_map(model)
    cut = rows[:, :, None] & ~allowed  # [batch q k]
    hooks = []
    for prefix, hs in resolve_heads(model, heads).items():
        point, value = mp.site(prefix).mixing().cut_at(mode)  # axis 1: the head (Mamba-2) or channel (Mamba-1)
        hooks.append((point.name, _cut_hook(hs, cut, "min" if value is None else "zero"), False))
    with attached(model, hooks):
        yield model


def _cut_hook(heads: list[int], cut: Tensor, fill: str) -> Callable:
    def hook(x: Tensor, hook: Any) -> Tensor:  # x [batch head q k]
        if cut.shape != (x.shape[0], x.shape[2], x.shape[3]):
            raise ValueError(f"{hook.name}: the mask is for {tuple(cut.shape)}, the run is {tuple(x.shape)}")
        which = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        which[heads] = True
        where = which[None, :, None, None] & cut.to(x.device)[:, None]
        value = torch.finfo(x.dtype).min if fill == "min" else 0.0
        return x.masked_fill(where, value)

    return hook


def gather_only(model: Any, heads: Sequence[Any], batch: Any, mode: str = "scores"):
    """Restrict `heads` to the Gather pattern for a batch with `.tokens` and `.segments`."""
    rows, allowed = gather_edges(tuple(batch.tokens.shape), batch.segments)
    return restrict_heads(model, heads, rows, allowed, mode)


def aggregate_only(model: Any, heads: Sequence[Any], batch: Any, mode: str = "scores"):
    """Restrict `heads` to the Aggregate pattern for a batch with `.tokens`, `.segments`, `.queries`."""
    rows, allowed = aggregate_edges(tuple(batch.tokens.shape), batch.segments, batch.queries)
    return restrict_heads(model, heads, rows, allowed, mode)


def masked_accuracy(model: Any, examples: Sequence[Example], heads: Sequence[Any], pattern: str,
                    mode: str = "scores", batch_size: int = 16) -> dict[str, float]:
    """Accuracy and answer log-prob with `heads` restricted to the "gather" or "aggregate" pattern."""
    restrict = {"gather": gather_only, "aggregate": aggregate_only}[pattern]
    scorer = ChoiceScorer(model, examples, batch_size)
    return scorer.metrics(scorer.scores(context=lambda batch: restrict(model, heads, batch, mode)))


# ------------------------------------------------------------------------------ scores
@checked(examples=Seq(), batch_size=Integer(ge=1), channel_group=Integer(ge=1, none=True))
def ga_scores(model: Any, examples: Sequence[Example], units: Sequence[Unit] | None = None,
              batch_size: int = 8, channel_group: int | None = None) -> dict[str, dict[str, float]]:
    """{unit label: {"gather", "aggregate"}} on the examples' prompts (definitions in the docstring)."""
    mp = model_map(model)  # asked once
    return unit_scores(model, examples, mp.units(channel_group) if units is None else mp.placed(units), batch_size)


def unit_scores(model: Any, examples: Sequence[Example], units: Sequence[Unit],
                batch_size: int = 8) -> dict[str, dict[str, float]]:
    """`ga_scores` of the model map's `units` (they carry their sites: the map is not asked again)."""
    sites = list({u.module: u.placed() for u in units}.values())
    sums: dict[str, Tensor] = {}  # module prefix -> [2, n_heads] summed over examples
    for start in range(0, len(examples), batch_size):
        batch = encode_prompts(model, list(examples[start: start + batch_size]))
        a_mask = batch.summary_mask().cpu()  # [b k]
        pos = batch.tokens.shape[1]
        # only rows are read: the segment-final tokens (gather) and the query, the last position (aggregate)
        rows = sorted({last for spans in batch.segments for _, last in spans} | {pos - 1})
        g_mask = gather_exclusive_mask(batch.segments, tuple(batch.tokens.shape))[:, rows]  # [b row k]
        n_seg = torch.tensor([max(len(s), 1) for s in batch.segments], dtype=torch.float64)
        hooks = []
        for site in sites:
            score = _score_rows(site.path, site.mixing(), g_mask, rows.index(pos - 1), a_mask, n_seg, sums)
            hooks += weight_rows_hooks(site, torch.tensor(rows), score)
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(batch.tokens, batch.attention_mask, stop_at_layer=max(u.layer for u in units) + 1)
    out = {}
    for u in units:
        per_head = sums[u.module][:, list(u.heads)].mean(-1) / len(examples)
        out[u.label] = {"gather": per_head[0].item(), "aggregate": per_head[1].item()}
    return out


def _score_rows(prefix: str, mixing: Mixing, g_mask: Tensor, query_row: int, a_mask: Tensor, n_seg: Tensor,
                sums: dict) -> Callable:
    def on_rows(x: Tensor) -> None:  # x [batch head row k], g_mask [batch row k]
        w = mixing.weights(x.detach().double().cpu())
        gather = (w * g_mask[:, None]).sum((-1, -2)) / n_seg[:, None]  # [batch head]
        aggregate = (w[:, :, query_row, :] * a_mask[:, None]).sum(-1)  # the query is the last position (left padding)
        total = torch.stack([gather.sum(0), aggregate.sum(0)])
        sums[prefix] = sums.get(prefix, 0) + total

    return on_rows
