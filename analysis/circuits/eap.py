"""Edge attribution patching: every edge's effect on a metric, estimated from a few forwards.

Glossary
    clean, corrupt  the run explained, and the run whose activations replace it: token ids [batch pos]
                    (with `attention_mask` when padded, left or right), or lists of strings, of 1-D token
                    tensors or of `Example`s, of different lengths (prompts.py: left-padded internally)
    padding         (prompts.py) each clean prompt and its corrupt must have one length: pairs of different
                    lengths are refused, naming them. Every batch runs LEFT-padded with the mask (a right-
                    padded one is moved row by row), so logits[:, -1] is each prompt's last token: AnswerDiff
                    and `metric.tail` work unchanged (a tail longer than a prompt, or AnswerDiff(pos >= 0),
                    is refused). No real position reads a pad position (every family's attention_mask
                    path: masked keys, SSM / delta-rule inputs zeroed), so the receivers' gradients there are
                    exactly 0; the sender diffs there are set to 0 too (a left-pad query's attention row
                    has no visible key and is uniform over all keys, real ones included, so its activations
                    differ between clean and corrupt): pad positions add nothing to a score, and what a
                    patched run changes there reaches no real position. The scores then equal the per-
                    prompt runs combined as the metric combines them (a mean over prompts: the mean of the
                    per-prompt scores). Chunks
                    (batch_size) are trimmed to their longest prompt; a batch of one length runs unmasked.
                    Token-edge positions are the padded batch's columns (prompt b's position p is column
                    p + width - length_b: positions counted from the end agree across prompts)
    metric          `metric(logits) -> scalar tensor`, a mean over prompts (analysis.interventions.logit_diff,
                    answer_prob, circuits.metrics.AnswerDiff for per-prompt answers: metrics.py), or
                    `metric(logits, clean_logits)` (metrics.KL; the arity rule: metrics.reads_clean)
    intervention    what an ablated edge carries (baselines.py): "patch" (the corrupt run), "zero", "mean"
                    (over `reference=`, whole or per_position); every estimate below uses
                    diff = baseline - clean, and `corrupt_metric` is the fully ablated run's metric
    EAP             (Syed et al. 2023) score(s -> r) = sum over batch and positions of
                    (a_s^corrupt - a_s^clean) . d metric / d x_r on the clean run: the first-order change of
                    the metric when edge s -> r alone carries the corrupt sender (x_r: the residual as r
                    reads it). One forward on corrupt, one forward and one backward on clean; memory
                    linear in nodes x positions (activations and gradients per node, never per edge).
    EAP-IG          (Hanna et al. 2024) the gradient averaged over `steps` runs whose token embedding is
                    interpolated from corrupt to clean at alpha = (k + 1/2) / steps (midpoints; `steps_at`:
                    integrated.py). "eap-ig-activations" and "clean-corrupted": integrated.py
    batch_size      prompts per forward: scores of chunks are added, weighted by their share of the
                    prompts (right when the metric is a mean over prompts, as the helpers are)
    token_edges     also score the token edges inside every mixer (token_edges.py): the estimate of
                    cutting (unit, target j <- source i) in the clean run, from the same kind of gradients
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.attribution import GraphReader, attribute, settings_of
from analysis.circuits.attribution import chunks  # noqa: F401  (re-exported)
from analysis.circuits.baselines import INTERVENTIONS, prepare
from analysis.circuits.graph import Edge, Graph
from analysis.circuits.integrated import STEPS_AT, activation_ig, clean_corrupted
from analysis.circuits.prompts import pad_free, prompts_of
from analysis.circuits.runs import Grads, ReceiverGrads, embedding_slots, receiver_blocks
from hooked.models.protocol import ATTENTION_MODES
from hooked.validate import Flag, Instance, Integer, OneOf, checked

METHODS = ("eap", "eap-ig", "eap-ig-activations", "clean-corrupted")
Metric = Callable[[Tensor], Tensor]


class EdgeScores:
    """Scores of every edge of a graph: `len()`, `.top(n)`, `[edge]`, `.edges()`, `.to_json(path)`;
    `.save(path)` / `EdgeScores.load(path, model=None)` (store.py). `settings`: what produced the scores
    (method, steps, steps_at, intervention, per_position, lengths, ...), saved with them."""

    def __init__(self, graph: Graph, scores: Tensor, method: str, clean_metric: float, corrupt_metric: float,
                 token: Any = None, settings: dict[str, Any] | None = None) -> None:
        self.graph, self.scores, self.method = graph, scores.detach().double().cpu(), method
        self.clean_metric, self.corrupt_metric = clean_metric, corrupt_metric
        self.token = token  # TokenEdgeScores or None
        self.settings: dict[str, Any] = dict(settings or {})

    def __len__(self) -> int:
        return len(self.graph)

    def __getitem__(self, edge: Any) -> float:
        return float(self.scores[self.graph.index(edge)])

    def __repr__(self) -> str:
        return (f"EdgeScores({self.method}, {len(self)} edges, metric clean {self.clean_metric:.4g} / corrupt "
                f"{self.corrupt_metric:.4g}, top {[str(e) for e in self.top(3)]})")

    def order(self, absolute: bool = True) -> Tensor:
        """Edge numbers from the largest score down (by |score| when absolute)."""
        key = self.scores.abs() if absolute else self.scores
        return torch.argsort(key, descending=True, stable=True)

    @checked(n=Integer(ge=0), absolute=Flag())
    def top(self, n: int, absolute: bool = True) -> list[Edge]:
        """The n edges of largest |score| (or score), largest first (n >= 0; past len(self): every edge)."""
        return [self.graph.edge(int(i), float(self.scores[i])) for i in self.order(absolute)[:n]]

    def edges(self) -> list[Edge]:
        return [self.graph.edge(i, float(s)) for i, s in enumerate(self.scores)]

    def save(self, path: str | Path) -> Path:
        """The scores with their graph, method and settings as JSON (store.py); token-edge scores are not saved."""
        from analysis.circuits.store import save

        return save(self, path)

    @staticmethod
    def load(path: str | Path, model: Any = None) -> "EdgeScores":
        """Scores saved by `save`, on `model`'s graph (checked equal) or, without a model, on the saved graph."""
        from analysis.circuits.store import load

        parts = load(path, model)
        return EdgeScores(parts.pop("graph"), parts.pop("scores"), parts.pop("method"), **parts)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "settings": self.settings, "clean_metric": self.clean_metric,
                "corrupt_metric": self.corrupt_metric,
                "n_edges": len(self), "senders": self.graph.senders, "receivers": self.graph.receivers,
                "edges": [{"sender": e.sender, "receiver": e.receiver, "score": e.score} for e in self.top(len(self))]}

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def as_tokens(model: Any, x: Any) -> Tensor:
    """Token ids [batch pos] from a tensor, or from a list of prompts (prompts.py) of one length."""
    p = prompts_of(model, x)
    if p.padded:
        raise ValueError(f"prompts tokenise to lengths {sorted(set(p.lengths.tolist()))}: this needs one length")
    return p.tokens


def pair(model: Any, clean: Any, corrupt: Any) -> tuple[Tensor, Tensor]:
    """(clean, corrupt) token ids of one shape (unpadded: prompt_pair for prompts of different lengths)."""
    clean, corrupt = as_tokens(model, clean), as_tokens(model, corrupt)
    if clean.shape != corrupt.shape:
        raise ValueError(f"clean and corrupt must have the same shape, got {tuple(clean.shape)} and "
                         f"{tuple(corrupt.shape)}")
    return clean, corrupt


def _edge_scores(graph: Graph, diff: Tensor, emb_diff: Tensor | None, grads: Grads | ReceiverGrads,
                 blocks: int = 4) -> Tensor:
    """score[e] = diff[s_e] . grad[r_e] summed over batch, positions and d_model (+ the embedding slot).

    Receivers (in stage order) are split into `blocks` runs of whole groups, each multiplied with the senders
    up to the last one linked to it: about 5/8 of senders x receivers, in large products (one small product
    per receiver group would re-read every sender's diff each time), in the activations' dtype, summed in
    float64. Pending gradients (runs.ReceiverGrads) are pulled back one run at a time into one buffer."""
    flat_d = diff.flatten(1)
    per_pair = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64, device=diff.device)
    last = torch.full((len(graph.receivers),), -1, dtype=torch.long)
    last.scatter_reduce_(0, graph.edge_receiver, graph.edge_sender, "amax")
    for start, stop, g in receiver_blocks(graph, grads, blocks):
        hi = int(last[start:stop].max()) + 1
        if hi > 0:
            per_pair[:hi, start:stop] = (flat_d[:hi] @ g.flatten(1).to(flat_d.dtype).T).double()
    if emb_diff is not None:
        for rs, ge in zip(graph.receiver_slices, embedding_slots(grads)):
            if ge is not None:  # embed (sender 0) reaches a side block through the embedding slot too
                per_pair[0, rs] += ge.flatten(1).double() @ emb_diff.flatten().double()
    return per_pair[graph.edge_sender, graph.edge_receiver]


BATCH_SIZE = Integer(ge=1, none=True)  # prompts per forward; None: all at once


@checked(method=OneOf(*METHODS), steps=Integer(ge=1), token_edges=Flag(), batch_size=BATCH_SIZE,
         attention=OneOf(*ATTENTION_MODES), attention_mask=Instance(Tensor, "a tensor", none=True),
         intervention=OneOf(*INTERVENTIONS), per_position=Flag(), steps_at=OneOf(*STEPS_AT))
def edge_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, method: str = "eap", steps: int = 5,
                     token_edges: bool = False, attention_mask: Tensor | None = None,
                     batch_size: int | None = None, attention: str = "scores", intervention: str = "patch",
                     reference: Any = None, per_position: bool = False, steps_at: str = "mid") -> EdgeScores:
    """Scores of every edge of the model's graph (graph.py) by EAP, EAP-IG, EAP-IG-activations or
    clean-corrupted (see the glossary; integrated.py), patching from `corrupt` or ablating to zero or to the
    mean over `reference` (`intervention`, baselines.py: corrupt=None for zero and mean).

    Returns EdgeScores: `len(scores)` edges, `scores.top(n)` the n largest by |score|, each an Edge with
    `.sender`, `.receiver`, `.score`. With token_edges=True, `scores.token` holds the token-edge
    estimates of every mixer (`attention`: the cut they estimate on attention, "scores" or "pattern").
    Prompts of different lengths (glossary: padding): lists, or token batches with their `attention_mask`.
    """
    from analysis.circuits.graph import graph_of
    from analysis.circuits.token_edges import TokenGradients

    if method == "clean-corrupted" and intervention != "patch":
        raise ValueError(f"method='clean-corrupted' takes the gradient at the corrupt run: intervention='patch' only, "
                         f"got {intervention!r}")
    if token_edges and method in ("eap-ig-activations", "clean-corrupted"):
        raise ValueError(f"token_edges=True is estimated by 'eap' and 'eap-ig', not by method={method!r}")
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    total, values = None, [0.0, 0.0]
    token = TokenGradients(model, attention, width=clean.width) if token_edges else None
    for ch in attribute(model, GraphReader(graph), clean, baseline, metric, method, steps, steps_at, batch_size,
                        token, values):
        if method == "clean-corrupted":
            corrupt_rows = baseline.corrupt.rows(ch.part)
            ch.value, ch.ablated, s = clean_corrupted(model, graph, ch.clean, corrupt_rows, ch.metric)
        elif method == "eap-ig-activations":
            s = activation_ig(model, graph, ch.clean, ch.base, ch.run, ch.clean_logits, ch.metric, steps, steps_at)
        else:
            diff = ch.base.minus(ch.run)
            emb_diff = None if ch.run.emb is None else ch.base.emb - ch.run.emb
            if ch.clean.attention_mask is not None:  # pad positions add nothing (glossary: padding)
                diff, emb_diff = pad_free(diff, ch.clean.attention_mask), pad_free(emb_diff, ch.clean.attention_mask)
            s = _edge_scores(graph, diff, emb_diff, ch.grads)
        total = ch.weight * s if total is None else total + ch.weight * s
    return EdgeScores(graph, total, method, values[0], values[1], token.scores() if token is not None else None,
                      settings=settings_of(method, steps, steps_at, intervention, per_position, clean))


