"""Node scores: every sender node of the graph scored and verified as a whole (heads, SSM heads, MLPs,
experts, side blocks, embed).

Glossary
    node          a sender of the graph (graph.py): "embed", a head "L1H0", an SSM head, "mlp1", an expert
                  "L1E0", a side block "shared1", a Mamba-1 mixer "mixer0"
    node score    EAP at the node: (a_s^corrupt - a_s^clean) . d metric / d a_s on the clean run, summed over
                  batch, positions and d_model (a_s: what the node adds to the stream). The stream carries a_s
                  to every receiver after it and to nothing else, so d metric / d a_s is the sum of those
                  receivers' input gradients, and the node's score is the sum of its outgoing edges' scores
                  (`node_scores`: no forward beyond the edge scores'; EAP-IG's the same with its averaged
                  gradients). A head's score is also grad x diff at its hook_z (the output projection is
                  linear): the test's hand computation
    node patching a run of clean in which every node outside the set carries its corrupt activation to every
                  receiver (all its outgoing edges patched): `verify_nodes`, exact, through the edge patcher
Neuron scores (MLP neurons, SSM channels) are in neurons.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.eap import EdgeScores, edge_attribution
from analysis.circuits.verify import circuit_metric
from hooked.validate import Flag, Integer, checked

Metric = Callable[[Tensor], Tensor]


class NodeScores:
    """One score per sender node: `[label]`, `.top(n)` -> [(label, score)], `.scores` [n_senders] float64."""

    def __init__(self, graph: Any, scores: Tensor, method: str, settings: dict[str, Any] | None = None) -> None:
        self.graph, self.scores, self.method = graph, scores.detach().double().cpu(), method
        self.settings = dict(settings or {})
        self._index = {label: i for i, label in enumerate(graph.senders)}

    def __len__(self) -> int:
        return len(self.scores)

    def __getitem__(self, node: str) -> float:
        if node not in self._index:
            raise KeyError(f"no node {node!r} in this graph; nodes: {', '.join(self.graph.senders[:6])}, ...")
        return float(self.scores[self._index[node]])

    def __repr__(self) -> str:
        return f"NodeScores({self.method}, {len(self)} nodes, top {self.top(3)})"

    @checked(n=Integer(ge=0), absolute=Flag())
    def top(self, n: int, absolute: bool = True) -> list[tuple[str, float]]:
        """The n nodes of largest |score| (or score), largest first."""
        key = self.scores.abs() if absolute else self.scores
        order = torch.argsort(key, descending=True, stable=True)[:n]
        return [(self.graph.senders[int(i)], float(self.scores[i])) for i in order]

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "settings": self.settings,
                "nodes": {label: float(s) for label, s in zip(self.graph.senders, self.scores)}}


def node_scores(scores: EdgeScores) -> NodeScores:
    """Each sender node's score from its edges' (the glossary): sum of the scores of the edges leaving it."""
    graph = scores.graph
    total = torch.zeros(len(graph.senders), dtype=torch.float64).index_add_(0, graph.edge_sender, scores.scores)
    return NodeScores(graph, total, scores.method, scores.settings)


def node_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, **kwargs: Any) -> NodeScores:
    """Every node's EAP (or EAP-IG) score: `edge_attribution` with the same arguments, summed per sender."""
    return node_scores(edge_attribution(model, clean, corrupt, metric, **kwargs))


def node_edges(graph: Any, nodes: Iterable[str]) -> list[int]:
    """The numbers of the edges leaving `nodes` (sender labels, checked against the graph)."""
    index = {label: i for i, label in enumerate(graph.senders)}
    keep = torch.zeros(len(graph.senders), dtype=torch.bool)
    for node in nodes:
        if not isinstance(node, str) or node not in index:
            raise ValueError(f"nodes: {node!r} is no node of this graph; nodes are senders such as "
                             f"{', '.join(graph.senders[:5])}")
        keep[index[node]] = True
    return keep[graph.edge_sender].nonzero()[:, 0].tolist()


def verify_nodes(model: Any, nodes: Iterable[str], clean: Any, corrupt: Any, metric: Metric,
                 **kwargs: Any) -> dict[str, float]:
    """verify.circuit_metric's record ("circuit", "clean", "corrupt", "faithfulness", "n_edges", "fraction")
    plus "n_nodes" and "fraction_nodes", for the node set `nodes`: clean with every other node's corrupt
    activation carried to every receiver (node patching, the glossary). Exact: the edge circuit of the
    nodes' outgoing edges (circuit_metric, whose keyword arguments it takes)."""
    from analysis.circuits.graph import graph_of

    nodes = list(nodes)
    graph = graph_of(model)
    edges = node_edges(graph, nodes)
    out = circuit_metric(model, edges, clean, corrupt, metric, **kwargs)
    out["n_nodes"] = len(set(nodes))
    out["fraction_nodes"] = len(set(nodes)) / len(graph.senders)
    return out
