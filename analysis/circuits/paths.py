"""Path patching (Wang et al. 2022; TransformerLens's direct path patching) on every family.

Glossary
    base, source  the run that is patched, and the run the senders' activations come from (TL's direct path
                  patching: base = corrupted tokens, source = clean): token ids of one shape, or prompts as
                  edge_attribution takes them (lists, or batches with their `attention_mask`: prompts.py),
                  each base prompt with a source prompt of its length. `intervention` "zero" / "mean"
                  (source=None; `reference=`, per_position: baselines.py) patches the paths with the
                  senders' baselines instead: path ablation
    path          sender -> receiver through the residual stream only: the receiver reads
                  x + (a_s^source - a_s^base); every other reader of the sender, and every other path
                  into the receiver, keeps the base run (frozen), so only the direct effect is patched.
                  A path whose sender writes after its receiver reads does not exist and is skipped.
    receivers     graph labels ("L1H0.q", "mlp2", "logits", ...); a label without a suffix ("L1H0")
                  names all of its parts (".q", ".k", ".v")
    norm          "exact": the receiver's norm is recomputed on the patched input; "frozen": linearised at
                  the base run's scale, as TL's get_act_patch_direct_path does (delta / ln_scale through
                  the reader's weights); equal to TL's numbers on TL-processed weights (fold_ln, centred
                  writers), where that linearisation is what TL computes
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.baselines import prepare
from analysis.circuits.eap import BATCH_SIZE
from analysis.circuits.graph import Graph, graph_of
from analysis.circuits.verify import ABLATION, MASK, sweep
from hooked.validate import checked

NORMS = ("exact", "frozen")


def _match(graph: Graph, labels: Sequence[str], receivers: bool) -> list[int]:
    names = graph.receivers if receivers else graph.senders
    out = []
    for label in labels:
        hit = [i for i, n in enumerate(names) if n == label or (receivers and n.startswith(label + "."))]
        if not hit:
            kind = "receiver" if receivers else "sender"
            raise KeyError(f"no {kind} {label!r} in this model's graph ({graph})")
        out += hit
    return out


def path_coef(graph: Graph, senders: Sequence[str], receivers: Sequence[str]) -> Tensor:
    """[n_edges] with 1 on every edge from one of `senders` to one of `receivers`."""
    s_idx, r_idx = set(_match(graph, senders, False)), set(_match(graph, receivers, True))
    keep = [i for i in range(len(graph)) if int(graph.edge_sender[i]) in s_idx and int(graph.edge_receiver[i]) in r_idx]
    coef = torch.zeros(len(graph), dtype=torch.float64)
    coef[keep] = 1.0
    return coef


def _run(model: Any, base: Any, source: Any, coefs: Tensor, metric: Callable[..., Tensor], norm: str,
         batch_size: int | None, attention_mask: Any, intervention: str, reference: Any,
         per_position: bool) -> Tensor:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    graph = graph_of(model)
    base, baseline = prepare(model, graph, base, source, intervention, reference, per_position, batch_size,
                             attention_mask, metric)
    return sweep(model, base, baseline, coefs, metric, graph=graph, batch_size=batch_size, frozen=norm == "frozen")


PATHS = dict(batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)


@checked(**PATHS)
def path_patch(model: Any, base: Any, source: Any, metric: Callable[..., Tensor], senders: Sequence[str],
               receivers: Sequence[str], norm: str = "exact", batch_size: int | None = None,
               attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
               per_position: bool = False) -> float:
    """The metric of `base` with every path sender -> receiver (senders x receivers) carrying the source run's
    sender (or its baseline: `intervention`), all other paths frozen to base (see the glossary). One patched
    forward."""
    coef = path_coef(graph_of(model), senders, receivers)
    if not bool(coef.any()):
        raise ValueError(f"no path from {list(senders)} to {list(receivers)}: every sender writes after the "
                         "receivers read")
    return float(_run(model, base, source, coef[None], metric, norm, batch_size, attention_mask, intervention,
                      reference, per_position)[0])


@checked(**PATHS)
def path_patch_sweep(model: Any, base: Any, source: Any, metric: Callable[..., Tensor], senders: Sequence[str],
                     receivers: Sequence[str], norm: str = "exact", batch_size: int | None = None,
                     attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
                     per_position: bool = False) -> Tensor:
    """[len(senders), len(receivers)]: `path_patch` of each (sender, receiver) pair alone (NaN where there is
    no path); the pairs share forwards (replicas)."""
    graph = graph_of(model)
    coefs, where = [], []
    for a, s in enumerate(senders):
        for b, r in enumerate(receivers):
            c = path_coef(graph, [s], [r])
            if bool(c.any()):
                coefs.append(c)
                where.append((a, b))
    out = torch.full((len(senders), len(receivers)), float("nan"), dtype=torch.float64)
    if coefs:
        values = _run(model, base, source, torch.stack(coefs), metric, norm, batch_size, attention_mask,
                      intervention, reference, per_position)
        for (a, b), v in zip(where, values):
            out[a, b] = v
    return out
