"""Forwards over the circuit graph: record the senders, take the receivers' gradients, run with edges patched.

Glossary
    record       a forward keeping every sender group's activation [n batch pos d_model] (no gradient)
    gradients    a forward and one backward of a scalar metric: every receiver's input gradient (the
                 gradient of the metric with respect to the residual as that receiver alone reads it,
                 receivers.py) and the senders' activations
    patched run  a forward of `base` tokens where edge e = (s -> r) carries coef[e] of its sender's change:
                 receiver r reads x + delta_r,  delta_r = sum over its edges of coef[e] * (a_s^source - a_s),
                 a_s the sender's activation in this very run (so an edge patched upstream changes what
                 later edges carry) and a_s^source the source run's. coef = 1 on an edge: the receiver
                 sees the source run's sender there; 0: this run's. Edge patching (EAP's verification,
                 path patching) is this with 0/1 weights; a finite difference is this with a small weight.
    replicas     R rows of coef in one forward: the batch tiled R times, block j of rows patched by row j
                 (analysis.interventions.batching's rule).
    embed        `embed(x) -> x'` replaces the token embedding (hook_embed) of a gradient run: EAP-IG's
                 interpolation between the clean and corrupt embeddings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.graph import Graph
from analysis.circuits.receivers import ReceiverGroup, TorchHooks
from hooked.hook_points import scoped_hooks


@contextlib.contextmanager
def attached(hook_points: list[tuple[Any, Callable]], torch_hooks: TorchHooks) -> Iterator[None]:
    """Hook points (scoped to this caller) and module hooks, all removed on exit."""
    handles = []
    try:
        for module, kind, fn in torch_hooks:
            handles.append(module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn))
        with scoped_hooks([(p, fn, False) for p, fn in hook_points]):
            yield
    finally:
        for h in handles:
            h.remove()


def _forward(model: Any, tokens: Tensor, attention_mask: Tensor | None) -> Tensor:
    return model(tokens, attention_mask) if attention_mask is not None else model(tokens)


class Activations:
    """Each sender group's activation of one run (and the embedding side blocks read)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.acts: dict[int, Tensor] = {}
        self.emb: Tensor | None = None

    def emit(self, group: Any, act: Tensor, emb: Tensor | None = None) -> None:
        self.acts[id(group)] = act.detach()
        if emb is not None:
            self.emb = emb.detach()

    def hooks(self) -> list[tuple[Any, Callable]]:
        return [h for g in self.graph.sender_groups for h in g.hooks(self.emit)]

    def stacked(self) -> Tensor:
        """Every sender's activation, in the graph's sender order: [n_senders batch pos d_model]."""
        return torch.cat([self.acts[id(g)] for g in self.graph.sender_groups])


@torch.no_grad()
def record(model: Any, graph: Graph, tokens: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Activations]:
    acts = Activations(graph)
    with attached(acts.hooks(), []):
        logits = _forward(model, tokens, attention_mask)
    return logits, acts


def gradients(model: Any, graph: Graph, tokens: Tensor, metric: Callable[[Tensor], Tensor],
              attention_mask: Tensor | None = None,
              embed: Callable[[Tensor], Tensor] | None = None,
              token: Any = None) -> tuple[float, Activations, list[tuple[Tensor, Tensor | None]]]:
    """(metric value, sender activations, per receiver group (grad [n b p d], embedding-slot grad or None)).

    token: a token_edges.TokenGradients that takes its gradients in the same backward."""
    acts = Activations(graph)

    def leaf(x: Tensor, hook: Any) -> Tensor:  # the graph starts here, whatever the parameters require
        x = embed(x.detach()) if embed is not None else x.detach()
        return x.requires_grad_(True)

    sites = {id(g.site): g.site for g in graph.receiver_groups if g.site is not None}
    torch_hooks = [h for s in sites.values() for h in s.hooks(grad=True)]
    torch_hooks += [h for g in graph.receiver_groups for h in g.grad_hooks()]
    points = [(model.hook_embed, leaf)] + acts.hooks() + (token.hooks() if token is not None else [])
    with torch.enable_grad(), attached(points, torch_hooks):
        value = metric(_forward(model, tokens, attention_mask))
        if not torch.is_tensor(value) or value.numel() != 1:
            raise ValueError(f"metric must return a scalar tensor, got {value!r}")
        wanted = [t for g in graph.receiver_groups for t in g.grad_tensors()]
        extra = token.tensors() if token is not None else []
        grads = list(torch.autograd.grad(value.reshape(()), wanted + extra, retain_graph=True, allow_unused=True))
        if token is not None:
            token.take(grads[len(wanted):])
            grads = grads[:len(wanted)]
        out = []
        for g in graph.receiver_groups:
            k = len(g.grad_tensors())
            out.append(tuple(t.detach() if t is not None else None for t in g.resid_grads(grads[:k])))
            grads = grads[k:]
    return float(value.detach()), acts, out


class Patcher:
    """The hooks of one patched forward (see the glossary): senders emit, receivers ask for their delta."""

    def __init__(self, graph: Graph, source: Activations, coef: Tensor) -> None:
        self.graph, self.source = graph, source
        self.replicas = coef.shape[0]
        self.dense = graph.dense(coef)  # [R, n_receivers, n_senders]
        self.diff: dict[int, Tensor] = {}  # sender group -> [n, R*b, p, d] (source - this run)
        self.emb_diff: Tensor | None = None
        self._deltas: dict[int, tuple[Tensor | None, Tensor | None]] = {}

    def _tiled(self, x: Tensor) -> Tensor:
        return x.repeat(1, self.replicas, *([1] * (x.ndim - 2)))

    def emit(self, group: Any, act: Tensor, emb: Tensor | None = None) -> None:
        self.diff[id(group)] = self._tiled(self.source.acts[id(group)].to(act)) - act
        if emb is not None:
            self.emb_diff = self._tiled(self.source.emb.to(emb)) - emb

    def delta(self, group: ReceiverGroup) -> tuple[Tensor | None, Tensor | None]:
        key = id(group)
        if key not in self._deltas:
            self._deltas[key] = self._delta(group)
        return self._deltas[key]

    def _delta(self, group: ReceiverGroup) -> tuple[Tensor | None, Tensor | None]:
        g = self.graph
        rs = g.receiver_slices[g.receiver_groups.index(group)]
        weights = self.dense[:, rs]  # [R v U]
        if not bool(weights.any()):
            return None, None
        total = None
        for sg, ss in zip(g.sender_groups, g.sender_slices):
            w = weights[:, :, ss]
            if id(sg) not in self.diff or not bool(w.any()):
                continue
            d = self.diff[id(sg)]
            n, rows = d.shape[:2]
            d = d.reshape(n, self.replicas, rows // self.replicas, *d.shape[2:])
            part = torch.einsum("rvn,nrbpd->vrbpd", w.to(d.dtype), d).flatten(1, 2)
            total = part if total is None else total + part
        if total is None:
            return None, None
        emb = None
        if group.two_slots:  # the embedding slot: only the embed sender reaches it
            w = weights[:, :, 0].to(self.emb_diff.dtype)  # [R v]
            e = self.emb_diff.reshape(1, self.replicas, -1, *self.emb_diff.shape[2:])
            emb = (w.T[:, :, None, None, None] * e).flatten(1, 2)
        return total, emb

    def hooks(self, frozen: bool = False) -> tuple[list[tuple[Any, Callable]], TorchHooks]:
        points = [h for sg in self.graph.sender_groups for h in sg.hooks(self.emit)]
        sites = {id(r.site): r.site for r in self.graph.receiver_groups if r.site is not None}
        for s in sites.values():
            s.frozen = frozen
            points += s.points()
        torch_hooks = [h for s in sites.values() for h in s.hooks(grad=False)]
        torch_hooks += [h for r in self.graph.receiver_groups for h in r.patch_hooks(self.delta)]
        return points, torch_hooks


@torch.no_grad()
def patched(model: Any, graph: Graph, base: Tensor, source: Activations, coef: Tensor,
            attention_mask: Tensor | None = None, frozen: bool = False) -> Tensor:
    """Logits [R*batch pos d_vocab] of `base` tiled R = coef.shape[0] times, block j patched by coef[j]
    (source: the activations of a recorded run of other tokens of the same shape). frozen: receivers read
    their norm linearised at this run's scale (receivers.NormSite.read)."""
    if coef.ndim != 2 or coef.shape[1] != len(graph):
        raise ValueError(f"coef must be [replicas, n_edges={len(graph)}], got {tuple(coef.shape)}")
    patcher = Patcher(graph, source, coef.to(next(model.parameters()).device))
    points, torch_hooks = patcher.hooks(frozen)
    r = coef.shape[0]
    mask = None if attention_mask is None else attention_mask.repeat(r, 1)
    try:
        with attached(points, torch_hooks):
            return _forward(model, base.repeat(r, 1), mask)
    finally:
        for g in graph.receiver_groups:
            if g.site is not None:
                g.site.frozen, g.site.x, g.site.scale = False, None, None
