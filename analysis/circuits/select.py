"""Circuit selection: top-n, threshold or greedy, pruned to the edges on a path from the input to the logits.

Glossary
    node       a sender of the graph, plus the logits. A receiver belongs to its owners, the nodes whose write
               reads it (graph.py: "L1H0.q" to L1H0, a key head to the query heads it serves, "mlp1" to mlp1,
               a Mamba-2 head's x to the heads its gated norm groups with it); the logits receiver is the
               logits node
    path       embed -> receiver r1 -> an owner of r1 -> receiver r2 -> ... -> logits, each hop an edge of the
               circuit (sender -> receiver) or ownership (receiver -> its node)
    pruning    keeping the edges that lie on such a path (`on_paths`): the sender is reached from embed and
               the receiver (an owner of it) reaches the logits. What it drops changes nothing in an edge
               patching run: a sender no circuit edge feeds reads the corrupt stream everywhere, so it
               writes its corrupt activation anyway; a node whose edges all carry the corrupt run makes its
               inputs irrelevant (the test checks faithfulness before = after; not on MiniMax, whose stream
               is renormalised at every step, so a receiver reads no sum of senders). The library's `prune`
               (hannamw/EAP-IG: drop nodes without in- or outgoing edges until nothing changes) keeps the same
    top_n      the n edges of largest |score|; threshold: those with |score| >= threshold
    greedy     (hannamw/EAP-IG's apply_greedy) grow from the logits: n times, add the best-scored edge among
               those whose receiver belongs to the logits or to a node already in the circuit; its sender
               joins the circuit
    Selection  the result: the kept edges (largest |score| first), n before and after pruning, and with a model
               the pruned circuit's exact metric and faithfulness (verify.circuit_metric)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.eap import EdgeScores
from analysis.circuits.graph import Edge
from hooked.validate import Flag, Integer, Number, checked

Metric = Callable[[Tensor], Tensor]


@dataclass
class Selection:
    edges: list[Edge]  # kept after pruning, largest |score| first
    rule: str  # "top_n", "threshold" or "greedy"
    n_selected: int  # before pruning
    n_kept: int  # after pruning
    nodes: list[str] = field(default_factory=list)  # senders on the kept paths (with "logits")
    faithfulness: float | None = None  # of the kept edges, with a model (select_circuit)
    metric: dict[str, float] | None = None  # verify.circuit_metric of the kept edges
    graph: Any = field(default=None, repr=False, compare=False)  # the graph the edges are of

    def to_dot(self, name: str = "circuit") -> str:
        """The kept circuit as Graphviz dot text (dot.py)."""
        from analysis.circuits.dot import to_dot

        return to_dot(self.graph, self.edges, name)

    def draw(self, path: str | Path, title: str = "") -> Path:
        """The kept circuit drawn over layers into an image file (plot.draw_circuit)."""
        from analysis.circuits.plot import draw_circuit, layer_of

        model = getattr(self.graph, "model", None)
        if model is not None:
            n_layers = model.cfg.n_layers
        else:  # a saved graph: one past the deepest layer its nodes name
            n_layers = 1 + int(max((layer_of(s, 0) for s in self.graph.senders), default=0))
        return draw_circuit(self.edges, n_layers, path, title or f"{self.rule}: {self.n_kept} edges")

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "n_selected": self.n_selected, "n_kept": self.n_kept, "nodes": self.nodes,
                "faithfulness": self.faithfulness, "metric": self.metric,
                "edges": [{"sender": e.sender, "receiver": e.receiver, "score": e.score} for e in self.edges]}


def _owner_pairs(graph: Any) -> tuple[Tensor, Tensor]:
    """(receiver, sender) numbers of every ownership link."""
    pairs = [(r, s) for r, owners in enumerate(graph.owners) for s in owners]
    if not pairs:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    r, s = zip(*pairs)
    return torch.tensor(r), torch.tensor(s)


def on_paths(graph: Any, keep: Tensor) -> Tensor:
    """Bool [n_edges]: the edges of `keep` (bool [n_edges]) on a path from embed to the logits (the glossary)."""
    if keep.shape != (len(graph),) or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool mask over the graph's {len(graph)} edges, got {keep.dtype} "
                         f"{tuple(keep.shape)}")
    own_r, own_s = _owner_pairs(graph)
    es, er = graph.edge_sender, graph.edge_receiver
    n_s, n_r = len(graph.senders), len(graph.receivers)
    terminal = torch.tensor([len(o) == 0 for o in graph.owners])  # the logits
    reached = torch.zeros(n_s, dtype=torch.bool)
    reached[graph.senders.index("embed")] = True
    while True:  # senders fed from embed: one stage deeper each round
        fed = torch.zeros(n_r, dtype=torch.bool)
        fed[er[keep & reached[es]]] = True
        grown = reached.clone()
        grown[own_s[fed[own_r]]] = True
        if bool((grown == reached).all()):
            break
        reached = grown
    useful = terminal.clone()  # receivers from which the logits are reached
    while True:
        to_logits = torch.zeros(n_s, dtype=torch.bool)
        to_logits[es[keep & useful[er]]] = True
        grown = terminal.clone()
        grown[own_r[to_logits[own_s]]] = True
        if bool((grown == useful).all()):
            break
        useful = grown
    return keep & reached[es] & useful[er]


def greedy_mask(scores: EdgeScores, n: int, absolute: bool = True) -> Tensor:
    """Bool [n_edges]: n edges grown from the logits (the glossary), without pruning."""
    graph = scores.graph
    key = scores.scores.abs() if absolute else scores.scores
    owned: list[list[int]] = [[] for _ in graph.senders]  # sender -> the receivers it owns
    for r, owners in enumerate(graph.owners):
        for s in owners:
            owned[s].append(r)
    by_receiver: list[list[int]] = [[] for _ in graph.receivers]
    for e, r in enumerate(graph.edge_receiver.tolist()):
        by_receiver[r].append(e)
    heap: list[tuple[float, int]] = []
    opened = [False] * len(graph.receivers)

    def open_receivers(rs: list[int]) -> None:
        for r in rs:
            if not opened[r]:
                opened[r] = True
                for e in by_receiver[r]:
                    heapq.heappush(heap, (-float(key[e]), e))

    open_receivers([r for r, owners in enumerate(graph.owners) if not owners])  # the logits
    keep = torch.zeros(len(graph), dtype=torch.bool)
    in_circuit = [False] * len(graph.senders)
    senders = graph.edge_sender.tolist()
    for _ in range(min(n, len(graph))):
        if not heap:
            break
        _, e = heapq.heappop(heap)
        keep[e] = True
        s = senders[e]
        if not in_circuit[s]:
            in_circuit[s] = True
            open_receivers(owned[s])
    return keep


@checked(top_n=Integer(ge=0, none=True), threshold=Number(ge=0, none=True), greedy=Integer(ge=0, none=True),
         absolute=Flag())
def select(scores: EdgeScores, top_n: int | None = None, threshold: float | None = None, greedy: int | None = None,
           absolute: bool = True) -> Selection:
    """The edges chosen by one rule (top_n, threshold or greedy: the number of edges), pruned to those on a
    path from the input to the logits (the glossary), with the sizes before and after."""
    given = [name for name, v in (("top_n", top_n), ("threshold", threshold), ("greedy", greedy)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"select takes exactly one of top_n, threshold or greedy, got {given or 'none'}")
    graph = scores.graph
    key = scores.scores.abs() if absolute else scores.scores
    if top_n is not None:
        keep = torch.zeros(len(graph), dtype=torch.bool)
        keep[scores.order(absolute)[:top_n]] = True
    elif threshold is not None:
        keep = key >= float(threshold)
    else:
        keep = greedy_mask(scores, greedy, absolute)
    kept = on_paths(graph, keep)
    order = [int(i) for i in scores.order(absolute) if bool(kept[i])]
    senders = sorted(set(graph.edge_sender[kept].tolist()))
    nodes = [graph.senders[s] for s in senders] + (["logits"] if bool(kept.any()) else [])
    return Selection([graph.edge(i, float(scores.scores[i])) for i in order], given[0], int(keep.sum()),
                     int(kept.sum()), nodes, graph=graph)


def select_circuit(model: Any, scores: EdgeScores, clean: Any, corrupt: Any, metric: Metric, *,
                   top_n: int | None = None, threshold: float | None = None, greedy: int | None = None,
                   absolute: bool = True, **kwargs: Any) -> Selection:
    """`select`, then the kept circuit verified exactly: its metric and faithfulness in the Selection
    (verify.circuit_metric, which takes the other keyword arguments)."""
    from analysis.circuits.verify import circuit_metric

    chosen = select(scores, top_n=top_n, threshold=threshold, greedy=greedy, absolute=absolute)
    chosen.metric = circuit_metric(model, chosen.edges, clean, corrupt, metric, **kwargs)
    chosen.faithfulness = chosen.metric["faithfulness"]
    return chosen
