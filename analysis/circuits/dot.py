"""A circuit as Graphviz dot text (render with `dot -Tsvg`; plot.py draws it with matplotlib).

Glossary
    node      a sender ("embed", "L1H0", "mlp1", ...: a box) or "logits"; a receiver that is part of a node
              ("L1H0.q", a key head "L1H0.k" serving heads 0 and 1, a Mamba-2 group's "L1Hg0.B": a small
              ellipse labelled by its part) has its own dot node, linked to each of its owners (graph.py)
              by a dashed line with kind="owner". A receiver that is its node ("mlp1" reads as "mlp1"
              writes; "logits") is that node
    edge      sender -> receiver, one dot edge per circuit edge, with kind="edge", `score` (repr: the exact
              float), width by |score| relative to the largest, red when the score is negative, blue else
Node names are quoted dot IDs equal to the graph's labels, so the text parses back to the same edges.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from analysis.circuits.graph import Edge


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(graph: Any, edges: Iterable[Edge], name: str = "circuit") -> str:
    """Dot text of the circuit `edges` (Edges of `graph`, with scores) (the glossary)."""
    edges = list(edges)
    for e in edges:
        graph.index(e)  # every edge is one of the graph's (a KeyError names the node otherwise)
    senders = set(graph.senders)
    biggest = max((abs(e.score) for e in edges if e.score == e.score), default=0.0) or 1.0
    lines = [f"digraph {_q(name)} {{", "  rankdir=LR;", '  node [fontsize=10, fontname="Helvetica"];']
    nodes: dict[str, str] = {}
    links: list[str] = []
    for e in edges:
        nodes.setdefault(e.sender, "shape=box")
        if e.receiver in senders or e.receiver == "logits":
            nodes.setdefault(e.receiver, "shape=doubleoctagon" if e.receiver == "logits" else "shape=box")
            continue
        if e.receiver not in nodes:
            part = e.receiver.rpartition(".")[2]
            nodes[e.receiver] = f'shape=ellipse, width=0.3, height=0.2, fontsize=8, label={_q(part)}'
            for s in graph.owners[graph.receivers.index(e.receiver)]:
                owner = graph.senders[s]
                nodes.setdefault(owner, "shape=box")
                links.append(f"  {_q(e.receiver)} -> {_q(owner)} [kind=owner, style=dashed, arrowhead=none];")
    for node, attrs in nodes.items():
        lines.append(f"  {_q(node)} [{attrs}];")
    for e in edges:
        width = 0.5 + 4.5 * abs(e.score) / biggest if e.score == e.score else 1.0
        color = "#c0392b" if e.score < 0 else "#2e6fba"
        lines.append(f"  {_q(e.sender)} -> {_q(e.receiver)} [kind=edge, score={_q(repr(float(e.score)))}, "
                     f"penwidth={width:.3f}, color={_q(color)}];")
    lines += links + ["}"]
    return "\n".join(lines) + "\n"
