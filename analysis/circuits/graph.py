"""One edge graph per model, built from the block and mixer protocols (no family names).

Glossary
    step       one place where a block reads the stream: a serial sublayer, or parallel branches that
               read one norm (writers that share their norm are one step). Steps are numbered over
               the whole model in forward order; that number is a node's `stage`.
    sender     what adds to the stream (analysis/circuits/senders.py): "embed", attention and Mamba-2
               heads "L{l}{tag}{h}" (the model map's labels, hooked.models.model_map: H, or M beside
               attention), experts "L{l}E{e}" and "L{l}shared", whole sublayers "mlp{l}", "mixer{l}"
               (Mamba-1: its channels stay one node), "attn{l}", a side block's output "shared{l}"
    receiver   what reads it (analysis/circuits/receivers.py): "L{l}{tag}{h}.q" / ".k" / ".v" (k and v
               by key-value head), Mamba-2 heads' own inputs "L{l}{tag}{h}.x" and their groups'
               "L{l}{tag}g{g}.B" / ".C", whole sublayers "mlp{l}", ..., side blocks "shared{l}", "logits"
    owner      the sender nodes whose write reads a receiver's input (`Graph.owners`): "L1H0.q" -> L1H0, a
               key or value head -> the query heads it serves, "mlp1" -> mlp1, a mixture's input -> its
               experts and shared MLP, a Mamba-2 head's "L1H0.x" -> the heads its gated norm normalises
               with it (one statistic per group of heads), a group's "L1Hg0.B" -> those of the group's
               heads (receivers.row_units); every unit of a sublayer with a post-norm (its scale reads
               them all); "logits" -> none. A path runs sender -> receiver -> the
               receiver's owners -> their edges (select.py)
    edge       sender -> receiver through the residual stream (the standard EAP graph: a reader's input
               is the sum of every earlier writer): every sender whose stage is before the
               receiver's. A side block's output reaches only its own step's receivers (it enters
               that step's input, not the stream). Edges are numbered; `Graph.edge(i)` names one.
Token edges (target j <- source i inside one mixer) are finer edges on the side: token_edges.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.receivers import (LogitsReceiver, ModuleReceiver, NormSite, ReceiverGroup, RowsReceiver,
                                         SideReceiver, row_parts, row_units)
from analysis.circuits.senders import EmbedSender, SenderGroup, WholeSender, writer_senders
from hooked.models.model_map import model_map
from hooked.validate import as_index


@dataclass(frozen=True)
class Edge:
    sender: str
    receiver: str
    score: float = float("nan")

    def __str__(self) -> str:
        return f"{self.sender}->{self.receiver}"


class Graph:
    """Senders, receivers and edges of one model; built once, reused by every run."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.sender_groups: list[SenderGroup] = [EmbedSender(model)]
        self.receiver_groups: list[ReceiverGroup] = []
        pairs: list[tuple[ReceiverGroup, SenderGroup, list[tuple[int, ...]] | None]] = []  # (inputs, its senders)
        sites: dict[int, NormSite] = {}
        sites = {id(s.module): s for s in model_map(model).mixers() if s.writer is not None}
        stage = 0
        for layer, block in enumerate(model.blocks):
            writers = list(block.writers())
            sides = {kind: (side, hook) for side, hook, kind in block.sides()}
            steps: list[list[Any]] = []
            for w in writers:  # the branches of a parallel step are one stage
                if steps and steps[-1][0].step == w.step:
                    steps[-1].append(w)
                else:
                    steps.append([w])
            for step in steps:
                for w in step:
                    if w.kind in sides:
                        side, hook = sides[w.kind]
                        self.receiver_groups.append(SideReceiver(side.module, f"{side.name}{layer}", layer, stage))
                        self.sender_groups.append(WholeSender(f"{side.name}{layer}", hook, layer, stage, side=True))
                        pairs.append((self.receiver_groups[-1], self.sender_groups[-1], None))
                for w in step:  # each reads through its own norm (GPT-NeoX's branches: ln1, ln2)
                    site = sites.setdefault(id(w.norm), NormSite(w.norm))
                    tag = sites[id(w.module)].tag if id(w.module) in sites else None  # a token mixer's units
                    parts = row_parts(w.module, layer, tag) if tag is not None else None
                    if parts is not None:
                        self.receiver_groups.append(RowsReceiver(site, w.in_scale, w.module, parts, layer, stage))
                    else:
                        self.receiver_groups.append(ModuleReceiver(site, w.in_scale, w.module, f"{w.kind}{layer}",
                                                                   layer, stage))
                    self.sender_groups.append(writer_senders(w, layer, stage, tag))
                    pairs.append((self.receiver_groups[-1], self.sender_groups[-1],
                                  row_units(w.module) if parts is not None else None))
                stage += 1
        self.n_stages = stage
        self.receiver_groups.append(LogitsReceiver(model.ln_final, stage, len(model.blocks)))
        self._index()
        self._own(pairs)

    def _own(self, pairs: list[tuple[ReceiverGroup, SenderGroup, list[tuple[int, ...]] | None]]) -> None:
        """owners[r]: the sender numbers receiver r is an input of (the glossary); () for the logits."""
        self.owners: list[tuple[int, ...]] = [()] * len(self.receivers)
        start = {id(g): ss.start for g, ss in zip(self.sender_groups, self.sender_slices)}
        for rg, sg, units in pairs:
            rs = self.receiver_slices[self.receiver_groups.index(rg)]
            whole = tuple(range(start[id(sg)], start[id(sg)] + len(sg.labels)))
            if getattr(getattr(sg, "writer", None), "post_norm", None) is not None:
                units = None  # a post-norm's scale reads every unit's write: each unit's reads them all
            for k, r in enumerate(range(rs.start, rs.stop)):
                self.owners[r] = whole if units is None or len(whole) == 1 else tuple(whole[u] for u in units[k])

    def _index(self) -> None:
        self.senders = [label for g in self.sender_groups for label in g.labels]
        self.receivers = [label for g in self.receiver_groups for label in g.labels]
        if len(set(self.senders)) != len(self.senders) or len(set(self.receivers)) != len(self.receivers):
            raise RuntimeError("circuit graph: two nodes share a label")
        self.sender_slices, self.receiver_slices = _slices(self.sender_groups), _slices(self.receiver_groups)
        pairs = []
        for rg, rs in zip(self.receiver_groups, self.receiver_slices):
            for sg, ss in zip(self.sender_groups, self.sender_slices):
                linked = (sg.stage == rg.stage) if sg.side else (sg.stage < rg.stage)
                if linked and not (sg.side and isinstance(rg, SideReceiver)):
                    pairs += [(s, r) for r in range(rs.start, rs.stop) for s in range(ss.start, ss.stop)]
        pairs.sort(key=lambda p: (p[1], p[0]))
        self.edge_sender = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        self.edge_receiver = torch.tensor([r for _, r in pairs], dtype=torch.long)
        self._edge_index = {(s, r): i for i, (s, r) in enumerate(pairs)}
        self._sender_index = {label: i for i, label in enumerate(self.senders)}
        self._receiver_index = {label: i for i, label in enumerate(self.receivers)}

    def __len__(self) -> int:
        return len(self.edge_sender)

    def __repr__(self) -> str:
        return (f"Graph({len(self.senders)} senders, {len(self.receivers)} receivers, {len(self)} edges, "
                f"{self.n_stages} steps)")

    def edge(self, i: int, score: float = float("nan")) -> Edge:
        return Edge(self.senders[int(self.edge_sender[i])], self.receivers[int(self.edge_receiver[i])], score)

    def edges(self) -> Iterator[Edge]:
        return (self.edge(i) for i in range(len(self)))

    def index(self, edge: Any) -> int:
        """The number of an edge given as an Edge, a (sender, receiver) pair, "sender->receiver" or its number
        (an index: negative counts from the end)."""
        if not isinstance(edge, (str, Edge, tuple, list)):  # an edge number, or no edge at all
            return as_index(edge, len(self), "edge", "edges of the graph")
        if isinstance(edge, str):
            if "->" not in edge:
                raise ValueError(f"an edge as text is 'sender->receiver', got {edge!r}")
            edge = tuple(edge.split("->", 1))
        sender, receiver = (edge.sender, edge.receiver) if isinstance(edge, Edge) else edge
        s, r = self._sender_index.get(sender), self._receiver_index.get(receiver)
        if s is None or r is None:
            unknown = sender if s is None else receiver
            raise KeyError(f"no node {unknown!r} in this model's graph ({self})")
        i = self._edge_index.get((s, r))
        if i is None:
            raise KeyError(f"{sender} does not reach {receiver}: no such edge (the sender writes after the "
                           "receiver reads, or a side block's output feeds only its own step)")
        return i

    def mask(self, edges: Any) -> Tensor:
        """Bool [n_edges]: True on the listed edges (Edges, pairs, "a->b" strings or edge numbers)."""
        out = torch.zeros(len(self), dtype=torch.bool)
        for e in edges:
            out[self.index(e)] = True
        return out

    def dense(self, coef: Tensor) -> Tensor:
        """[R, n_edges, *rest] edge weights -> [R, n_receivers, n_senders, *rest]."""
        out = coef.new_zeros((coef.shape[0], len(self.receivers), len(self.senders), *coef.shape[2:]))
        out[:, self.edge_receiver.to(coef.device), self.edge_sender.to(coef.device)] = coef
        return out


def _slices(groups: list[Any]) -> list[slice]:
    out, start = [], 0
    for g in groups:
        out.append(slice(start, start + len(g.labels)))
        start += len(g.labels)
    return out


def graph_of(model: Any) -> Graph:
    """The graph of `model` (cheap: read from the blocks' protocols on every call)."""
    return Graph(model)
