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
from analysis.circuits.metrics import tail_of
from analysis.circuits.receivers import ReceiverGroup, TorchHooks
from analysis.circuits.senders import Parts
from hooked.hook_points import scoped_hooks
from hooked.validate import metric_tensor

Grads = tuple[Tensor, list[Tensor | None]]  # (every receiver's input gradient [n_receivers b p d], embedding slots)


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


def forward_logits(model: Any, tokens: Tensor, attention_mask: Tensor | None, tail: int | None = None) -> Tensor:
    """The logits [b p d_vocab], or with `tail` only the last `tail` positions' [b tail d_vocab] (metrics.py's
    glossary): the final norm still reads every position, as the logits receiver reads it whole."""
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    if tail is None or tail >= tokens.shape[1]:
        return model(tokens, **kwargs)
    resid = model(tokens, stop_at_layer=model.cfg.n_layers, **kwargs)
    return model.unembed(model.ln_final(resid)[:, -tail:])


class Activations:
    """Each sender group's activation of one run (and the embedding side blocks read)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.acts: dict[int, Tensor] = {}
        self.emb: Tensor | None = None

    def emit(self, group: Any, act: Tensor | Parts, emb: Tensor | None = None) -> None:
        self.acts[id(group)] = act.detach()  # a unit group's Parts stay unbuilt until asked for
        if emb is not None:
            self.emb = emb.detach()

    def hooks(self) -> list[tuple[Any, Callable]]:
        return [h for g in self.graph.sender_groups for h in g.hooks(self.emit)]

    def get(self, group: Any) -> Tensor:
        """The group's activation [n batch pos d_model] (built once)."""
        act = self.acts[id(group)]
        if isinstance(act, Parts):
            act = self.acts[id(group)] = act.tensor()
        return act

    def minus(self, other: "Activations") -> Tensor:
        """Every sender's activation here minus in `other`, in the graph's sender order [n_senders batch pos
        d_model], written into one buffer (a unit group's from the two runs' differences: senders.Parts)."""
        first = self.get(self.graph.sender_groups[0])
        out = first.new_empty((len(self.graph.senders), *first.shape[1:]))
        for g, ss in zip(self.graph.sender_groups, self.graph.sender_slices):
            a, b = self.acts[id(g)], other.acts[id(g)]
            if isinstance(a, Parts) and isinstance(b, Parts):
                out[ss] = a.minus(b)
            else:
                torch.sub(self.get(g), other.get(g), out=out[ss])
        return out


@torch.no_grad()
def record(model: Any, graph: Graph, tokens: Tensor, attention_mask: Tensor | None = None,
           tail: int | None = None) -> tuple[Tensor, Activations]:
    acts = Activations(graph)
    with attached(acts.hooks(), []):
        logits = forward_logits(model, tokens, attention_mask, tail)
    return logits, acts


class ReceiverGrads:
    """The receivers' input gradients of one gradient run, pulled back (ReceiverGroup.resid_grads) when
    asked: `full()` gives all of them as Grads; `blocks(n)` gives them n runs of whole receiver groups at a
    time in one reused buffer, for a caller that consumes each run before the next (EAP's score product:
    it never holds [n_receivers b p d], nor faults in its pages). `emb` holds each group's embedding-slot
    gradient once the group is pulled."""

    def __init__(self, graph: Graph, raw: list[list[Tensor | None]], like: Tensor) -> None:
        self.graph, self.raw, self.like = graph, raw, like
        self.emb: list[Tensor | None] = [None] * len(graph.receiver_groups)

    def _fill(self, lo: int, hi: int, out: Tensor) -> None:
        slices, base = self.graph.receiver_slices, self.graph.receiver_slices[lo].start
        for k in range(lo, hi):
            rs = slices[k]
            e = self.graph.receiver_groups[k].resid_grads(self.raw[k], out[rs.start - base:rs.stop - base])
            self.emb[k] = None if e is None else e.detach()

    def full(self) -> Grads:
        out = self.like.new_empty((len(self.graph.receivers), *self.like.shape))  # every group writes its slots
        self._fill(0, len(self.graph.receiver_groups), out)
        return out, list(self.emb)

    def blocks(self, n: int) -> Iterator[tuple[int, int, Tensor]]:
        """(first receiver, last + 1, their gradients [m b p d]) for n runs of whole groups of about equal size."""
        slices, total = self.graph.receiver_slices, len(self.graph.receivers)
        cuts, k = [0], 0
        for j in range(1, n):
            while k < len(slices) and slices[k].stop <= j * total / n:
                k += 1
            if k > cuts[-1]:
                cuts.append(k)
        cuts.append(len(slices))
        runs = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        size = max(slices[b - 1].stop - slices[a].start for a, b in runs)
        buffer = self.like.new_empty((size, *self.like.shape))
        for a, b in runs:
            start, stop = slices[a].start, slices[b - 1].stop
            out = buffer[:stop - start]
            self._fill(a, b, out)
            yield start, stop, out


def receiver_blocks(graph: Graph, grads: "Grads | ReceiverGrads", n: int) -> Iterator[tuple[int, int, Tensor]]:
    """(first receiver, last + 1, their gradients [m b p d]) in about n runs, from pending gradients
    (ReceiverGrads.blocks: whole groups, pulled one run at a time) or pulled ones (Grads: slices)."""
    if isinstance(grads, ReceiverGrads):
        yield from grads.blocks(n)
        return
    size = -(-len(graph.receivers) // n)
    for a in range(0, len(graph.receivers), size):
        yield a, min(a + size, len(graph.receivers)), grads[0][a:a + size]


def embedding_slots(grads: "Grads | ReceiverGrads") -> list[Tensor | None]:
    """Each receiver group's embedding-slot gradient (a pending ReceiverGrads: once its blocks were read)."""
    return grads.emb if isinstance(grads, ReceiverGrads) else grads[1]


def gradients(model: Any, graph: Graph, tokens: Tensor, metric: Callable[[Tensor], Tensor],
              attention_mask: Tensor | None = None,
              embed: Callable[[Tensor], Tensor] | None = None,
              token: Any = None, pending: bool = False) -> tuple[float, Activations, Grads | ReceiverGrads]:
    """(metric value, sender activations, (every receiver's gradient [n_receivers b p d], per receiver group
    its embedding-slot gradient or None)); with pending=True a ReceiverGrads that pulls them when asked.

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
        value = metric_tensor(metric(forward_logits(model, tokens, attention_mask, tail_of(metric))), metric, grad=True)
        wanted = [t for g in graph.receiver_groups for t in g.grad_tensors()]
        extra = token.tensors() if token is not None else []
        grads = list(torch.autograd.grad(value.reshape(()), wanted + extra, retain_graph=True, allow_unused=True))
        if token is not None:
            token.take(grads[len(wanted):])
            grads = grads[:len(wanted)]
        raw = []
        for g in graph.receiver_groups:
            k = len(g.grad_tensors())
            raw.append([t.detach() if t is not None else None for t in grads[:k]])
            grads = grads[k:]
        x = graph.receiver_groups[-1].grad_tensors()[0].detach()  # the final residual: every site's shape
        pulled = ReceiverGrads(graph, raw, x)
        return float(value.detach()), acts, (pulled if pending else pulled.full())


class Patcher:
    """The hooks of one patched forward (see the glossary): senders emit, receivers ask for their delta.

    delta_r = sum_s coef[r, s] diff_s over the senders linked to r. Verifying a circuit patches almost every
    edge and a finite difference almost none, so both are sparse one way: with most weights 1, delta_r is
    the sum of every earlier residual sender's diff (kept as a running sum) minus the few off-one terms;
    with most weights 0, the few nonzero terms. Either costs the sparse terms, not senders x receivers."""

    running_sums = True  # False: every receiver's delta as the plain sum over its senders (tests compare)

    def __init__(self, graph: Graph, source: Activations, coef: Tensor) -> None:
        self.graph, self.source = graph, source
        self.replicas = coef.shape[0]
        self.dense = graph.dense(coef)  # [R, n_receivers, n_senders]
        self.linked = graph.dense(torch.ones(1, len(graph), device=coef.device))[0].bool()  # [V U]
        self.side = torch.tensor([sg.side for sg, ss in zip(graph.sender_groups, graph.sender_slices)
                                  for _ in range(ss.start, ss.stop)], device=coef.device)
        self.where = [(k, i) for k, ss in enumerate(graph.sender_slices) for i in range(ss.stop - ss.start)]
        self.diff: dict[int, Tensor] = {}  # sender group number -> [n, R*b, p, d] (source - this run)
        self.emb_diff: Tensor | None = None
        self._emitted: list[tuple[int, Tensor]] = []  # (stage, the group's summed diff), residual senders
        self._cum: tuple[int, Tensor | None] = (0, None)  # (emitted entries added, their sum)
        self._deltas: dict[int, tuple[Tensor | None, Tensor | None, Tensor | None]] = {}
        self._number = {id(sg): k for k, sg in enumerate(graph.sender_groups)}

    def _tiled(self, x: Tensor) -> Tensor:
        return x.repeat(1, self.replicas, *([1] * (x.ndim - 2)))

    def emit(self, group: Any, act: Tensor | Parts, emb: Tensor | None = None) -> None:
        act = act.tensor() if isinstance(act, Parts) else act
        d = self._tiled(self.source.get(group).to(act)) - act
        self.diff[self._number[id(group)]] = d
        if not group.side:
            self._emitted.append((group.stage, d.sum(0)))
        if emb is not None:
            self.emb_diff = self._tiled(self.source.emb.to(emb)) - emb

    def _sum_before(self, stage: int) -> Tensor | None:
        """Sum of the diffs of every residual sender written before `stage` (receivers ask in stage order)."""
        done, total = self._cum
        while done < len(self._emitted) and self._emitted[done][0] < stage:
            total = self._emitted[done][1] if total is None else total + self._emitted[done][1]
            done += 1
        self._cum = (done, total)
        return total

    def delta(self, group: ReceiverGroup) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(delta [v R*b p d] or None when no receiver of the group is patched, the embedding slot's delta,
        which receivers are patched [v] bool)."""
        key = id(group)
        if key not in self._deltas:
            self._deltas[key] = self._delta(group)
        return self._deltas[key]

    def _delta(self, group: ReceiverGroup) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        g = self.graph
        rs = g.receiver_slices[g.receiver_groups.index(group)]
        if self.dense.ndim == 4:  # a weight per position (analysis.circuits.positions)
            return self._delta_by_position(group, rs)
        weights, linked = self.dense[:, rs], self.linked[rs]  # [R v U], [v U]
        active = weights.ne(0).any(-1).any(0)
        if not bool(active.any()):
            return None, None, None
        residual = linked & ~self.side  # the senders the running sum holds, for every receiver of the group
        dense_terms = int(weights.ne(0).sum())
        off_one = torch.where(residual, weights - 1, weights)
        base = None
        if self.running_sums and int(off_one.ne(0).sum()) < dense_terms and bool(residual.any()):
            base, weights = self._sum_before(group.stage), off_one
        chosen = weights.ne(0).any(0).any(0).nonzero()[:, 0].tolist()  # senders with a term
        total = None if base is None else base.expand(weights.shape[1], *base.shape).clone()
        if chosen:
            d = torch.cat([self.diff[k][i:i + 1] for k, i in (self.where[s] for s in chosen)])
            n, rows = d.shape[:2]
            d = d.reshape(n, self.replicas, rows // self.replicas, *d.shape[2:])
            part = torch.einsum("rvn,nrbpd->vrbpd", weights[:, :, chosen].to(d.dtype), d).flatten(1, 2)
            total = part if total is None else total + part
        emb = None
        if group.two_slots:  # the embedding slot: only the embed sender reaches it
            w = self.dense[:, rs, 0].to(self.emb_diff.dtype)  # [R v]
            e = self.emb_diff.reshape(1, self.replicas, -1, *self.emb_diff.shape[2:])
            emb = (w.T[:, :, None, None, None] * e).flatten(1, 2)
        return total, emb, active

    def _delta_by_position(self, group: ReceiverGroup, rs: slice) -> tuple[Tensor | None, Tensor | None,
                                                                           Tensor | None]:
        """delta_r[p] = sum_s coef[r, s, p] diff_s[p]: the plain sum over the senders with a term."""
        weights = self.dense[:, rs]  # [R v U P]
        active = weights.ne(0).flatten(2).any(-1).any(0)
        if not bool(active.any()):
            return None, None, None
        total = None
        chosen = weights.ne(0).any(-1).any(1).any(0).nonzero()[:, 0].tolist()
        if chosen:
            d = torch.cat([self.diff[k][i:i + 1] for k, i in (self.where[s] for s in chosen)])
            n, rows = d.shape[:2]
            d = d.reshape(n, self.replicas, rows // self.replicas, *d.shape[2:])
            total = torch.einsum("rvnp,nrbpd->vrbpd", weights[:, :, chosen].to(d.dtype), d).flatten(1, 2)
        emb = None
        if group.two_slots:
            w = self.dense[:, rs, 0].to(self.emb_diff.dtype).transpose(0, 1)  # [v R P]
            e = self.emb_diff.reshape(1, self.replicas, -1, *self.emb_diff.shape[2:])
            emb = (w[:, :, None, :, None] * e).flatten(1, 2)
        return total, emb, active

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
            attention_mask: Tensor | None = None, frozen: bool = False, tail: int | None = None) -> Tensor:
    """Logits [R*batch pos d_vocab] of `base` tiled R = coef.shape[0] times, block j patched by coef[j]
    (source: the activations of a recorded run of other tokens of the same shape; coef [R, n_edges, pos]: a
    weight per edge and position, positions.py). frozen: receivers read
    their norm linearised at this run's scale (receivers.NormSite.read). tail: only the last positions'
    logits (forward_logits)."""
    if coef.ndim not in (2, 3) or coef.shape[1] != len(graph) or (coef.ndim == 3 and coef.shape[2] != base.shape[1]):
        raise ValueError(f"coef must be [replicas, n_edges={len(graph)}] or [replicas, n_edges, pos={base.shape[1]}] "
                         f"(a weight per position), got {tuple(coef.shape)}")
    patcher = Patcher(graph, source, coef.to(next(model.parameters()).device))
    points, torch_hooks = patcher.hooks(frozen)
    r = coef.shape[0]
    mask = None if attention_mask is None else attention_mask.repeat(r, 1)
    try:
        with attached(points, torch_hooks):
            return forward_logits(model, base.repeat(r, 1), mask, tail)
    finally:
        for g in graph.receiver_groups:
            if g.site is not None:
                g.site.frozen, g.site.x, g.site.scale = False, None, None
