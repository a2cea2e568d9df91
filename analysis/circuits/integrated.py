"""EAP's gradient taken elsewhere than at the clean run: where the integration steps sit, the
EAP-IG-activations and clean-corrupted variants (Hanna et al. 2024; hannamw/EAP-IG's methods of those names).

Glossary
    alpha         the weight of the clean end on the path from the baseline (alpha = 0) to clean (alpha = 1)
    steps_at      where the `steps` points sit on that path: "mid", alpha = (k + 1/2) / steps (the midpoint
                  rule, our default: its error per step is ~10x smaller); "left", alpha = k / steps,
                  k = 0..steps-1 (from the baseline end, as hannamw/EAP-IG's EAP-IG-inputs places them);
                  "right", alpha = k / steps, k = 1..steps (as its EAP-IG-activations places them)
    eap-ig        the token embedding interpolated (eap.py): score(s -> r) = diff_s . mean_k grad_r(alpha_k)
    eap-ig-activations
                  each sender group's output interpolated in turn, the rest of the run clean:
                  score(s -> r) = diff_s . mean_k d metric / d x_r in the run where the group G of s writes
                  clean_G + alpha_k (baseline_G - clean_G) in place of its output (G: the sublayer's
                  senders, all heads of an attention layer at once, as the library's per-layer nodes; the
                  embedding sender sets the stream entering block 0 and the token embedding side blocks
                  read). An edge from G reads only gradients of G's runs: receivers after G, whose gradient
                  cannot pass through G. Cost: groups x steps gradient runs. The library instead adds every
                  group's runs into every edge (and its interpolated output carries no gradient, so an edge
                  into a receiver before G misses its paths through G in G's runs): ours is its per-node
                  definition, edge by edge.
    clean-corrupted
                  score(s -> r) = diff_s . (grad_r(clean) + grad_r(corrupt)) / 2: the gradient at the two ends
                  of the path, each taken in its own run (patch only: the corrupt run is one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.graph import Graph
from analysis.circuits.metrics import WithClean, with_clean
from analysis.circuits.prompts import Prompts, pad_free
from analysis.circuits.runs import (Activations, Grads, ReceiverGrads, attached, embedding_slots, gradients,
                                   receiver_blocks)
from analysis.circuits.senders import EmbedSender

STEPS_AT = ("mid", "left", "right")
Metric = Callable[..., Tensor]


def alphas(steps: int, steps_at: str) -> list[float]:
    """The clean end's weight at each step (see the glossary)."""
    shift = {"mid": 0.5, "left": 0.0, "right": 1.0}[steps_at]
    return [(k + shift) / steps for k in range(steps)]


def _set(target: Tensor) -> Any:
    """A hook that makes its activation `target` in value and keeps its gradient path (for the leaves below)."""

    def fn(x: Tensor, hook: Any) -> Tensor:
        return x + (target.to(x) - x).detach()

    return fn


def _group_hooks(group: Any, clean: Activations, diff: Tensor, emb_diff: Tensor, beta: float) -> list[tuple[Any, Any]]:
    """Hook points that make the group write clean + beta (baseline - clean), beta = 1 - alpha."""
    total = clean.get(group).sum(0) + beta * diff.sum(0)  # the group's senders sum to its output
    if isinstance(group, EmbedSender):
        emb = clean.emb[0] + beta * emb_diff[0]
        return [(group.embed_hook, _set(emb)), (group.resid_hook, _set(total))]
    hook = group.out_hook if hasattr(group, "out_hook") else group.writer.out_hook
    return [(hook, _set(total))]


def _add_rows(per_pair: Tensor, graph: Graph, ss: slice, diff: Tensor, emb_diff: Tensor | None,
              grads: ReceiverGrads | Grads, weight: float) -> None:
    """per_pair[ss, r] += weight * diff[ss] . grad_r for every receiver r (and the embedding slot for embed)."""
    flat = diff.flatten(1)
    for start, stop, g in receiver_blocks(graph, grads, 4):
        per_pair[ss, start:stop] += weight * (flat @ g.flatten(1).to(flat.dtype).T).double()
    if emb_diff is not None:
        for rs, ge in zip(graph.receiver_slices, embedding_slots(grads)):
            if ge is not None:
                per_pair[0, rs] += weight * (ge.flatten(1).double() @ emb_diff.flatten().double())


def _diffs(base: Activations, cl: Activations, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """baseline - clean for every sender and for the token embedding, zero at pad positions (prompts.py)."""
    diff, emb_diff = base.minus(cl), base.emb - cl.emb
    return (diff, emb_diff) if mask is None else (pad_free(diff, mask), pad_free(emb_diff, mask))


def activation_ig(model: Any, graph: Graph, clean: Prompts, base: Activations, cl: Activations,
                  clean_logits: Tensor, metric: Metric, steps: int, steps_at: str) -> Tensor:
    """Per-edge scores [n_edges] (float64) of eap-ig-activations on one chunk (see the glossary)."""
    diff, emb_diff = _diffs(base, cl, clean.attention_mask)
    m = with_clean(metric, clean_logits)
    per_pair = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64, device=diff.device)
    for group, ss in zip(graph.sender_groups, graph.sender_slices):
        is_embed = isinstance(group, EmbedSender)
        for alpha in alphas(steps, steps_at):
            points = _group_hooks(group, cl, diff[ss], emb_diff, 1.0 - alpha)
            with attached(points, []):
                _, _, grads = gradients(model, graph, clean.tokens, m, clean.attention_mask, pending=True)
            _add_rows(per_pair, graph, ss, diff[ss], emb_diff if is_embed else None, grads, 1.0 / steps)
    return per_pair[graph.edge_sender, graph.edge_receiver]


def clean_corrupted(model: Any, graph: Graph, clean: Prompts, corrupt: Prompts,
                    metric: Metric) -> tuple[float, float, Tensor]:
    """(metric on clean, on corrupt, per-edge scores [n_edges]) of clean-corrupted on one chunk: two gradient
    runs, which also record both runs' senders."""
    m = with_clean(metric)  # bound to the clean run's own logits when it reads them
    value, cl, g_clean = gradients(model, graph, clean.tokens, m, clean.attention_mask)  # pulled now: the next
    # run resets the norm sites
    m_corrupt = WithClean(metric, m.clean) if isinstance(m, WithClean) else metric
    value_corrupt, corr, g_corrupt = gradients(model, graph, corrupt.tokens, m_corrupt, corrupt.attention_mask,
                                               pending=True)
    diff, emb_diff = _diffs(corr, cl, clean.attention_mask)
    per_pair = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64, device=diff.device)
    everyone = slice(0, len(graph.senders))
    for grads in (g_clean, g_corrupt):
        _add_rows(per_pair, graph, everyone, diff, emb_diff, grads, 0.5)
    return value, value_corrupt, per_pair[graph.edge_sender, graph.edge_receiver]
