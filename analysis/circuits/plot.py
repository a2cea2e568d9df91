"""A circuit drawn over layers: nodes in columns by layer, edges as lines sized by |score|.

Glossary
    node      a unit of the graph: a sender and its receivers share one node (head "L1H0" draws
              "L1H0.q", ".k", ".v" too; "mlp2" both ways); "embed" sits left of layer 0, "logits" right of
              the last layer. Receivers of a Mamba-2 head's group ("L1Hg0.B") draw as their own node.
    edge      a line from sender to receiver, width by |score| (relative to the largest drawn), red when
              corrupting it lowers the metric (score < 0), blue when it raises it; the receiver's input
              part (q, k, v, x, B, C) is written at the line's end
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from analysis.circuits.graph import Edge
from analysis.plots import _figure, _save
from hooked.models.model_map import label_layer

def node_of(label: str) -> tuple[str, str]:
    """(node, input part) of a graph label: "L1H0.q" -> ("L1H0", "q"), "mlp2" -> ("mlp2", "")."""
    node, _, part = label.partition(".")
    return node, part


def layer_of(node: str, n_layers: int) -> float:
    if node == "embed":
        return -1.0
    if node == "logits":
        return float(n_layers)
    layer = label_layer(node)  # a unit's or an input group's label (hooked.models.model_map's grammar)
    if layer is None:  # a whole sublayer: "mlp2", "attn1", "mixer0", "shared3"
        name = node.rstrip("0123456789")
        if not (name.isalpha() and name.islower() and len(name) < len(node)):
            raise ValueError(f"cannot place node {node!r} in a layer")
        layer = int(node[len(name):])
    return float(layer)


def draw_circuit(edges: Sequence[Edge], n_layers: int, path: str | Path, title: str = "") -> Path:
    """Save the drawing of `edges` (Edges with scores) over `n_layers` layers."""
    nodes: dict[str, float] = {}
    for e in edges:
        for label in (e.sender, e.receiver):
            node = node_of(label)[0]
            nodes.setdefault(node, layer_of(node, n_layers))
    columns: dict[float, list[str]] = {}
    for node, x in sorted(nodes.items(), key=lambda kv: (kv[1], _natural(kv[0]))):
        columns.setdefault(x, []).append(node)
    where = {node: (x, i - (len(col) - 1) / 2) for x, col in columns.items() for i, node in enumerate(col)}
    tallest = max((len(c) for c in columns.values()), default=1)
    fig = _figure(2.0 + 1.6 * (n_layers + 2), 1.5 + 0.45 * tallest)
    ax = fig.add_subplot()
    biggest = max((abs(e.score) for e in edges), default=1.0) or 1.0
    parts: dict[tuple[str, str], list[str]] = {}
    for e in edges:  # the input parts an arrow's receiver node takes, written once per node pair
        part = node_of(e.receiver)[1]
        key = (node_of(e.sender)[0], node_of(e.receiver)[0])
        if part and part not in parts.setdefault(key, []):
            parts[key].append(part)
    for e in edges:
        (x0, y0), (x1, y1) = where[node_of(e.sender)[0]], where[node_of(e.receiver)[0]]
        width = 0.5 + 5.0 * abs(e.score) / biggest
        color = "#c0392b" if e.score < 0 else "#2e6fba"
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", lw=width, color=color, alpha=0.7, shrinkA=9, shrinkB=9,
                                    connectionstyle="arc3,rad=0.12"))
    for (sender, receiver), names in parts.items():
        (x0, y0), (x1, y1) = where[sender], where[receiver]
        ax.text(x1 - 0.18, y1 + 0.08 * (1 if y0 <= y1 else -1), ",".join(names), fontsize=6, ha="right",
                color="#333333")
    for node, (x, y) in where.items():
        ax.text(x, y, node, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#555555", lw=0.6))
    ax.set_xlim(-1.7, n_layers + 0.7)
    ax.set_ylim(-tallest / 2 - 0.6, tallest / 2 + 0.6)
    ax.set_xticks([-1] + list(range(n_layers)) + [n_layers], ["embed"] + [f"layer {l}" for l in range(n_layers)]
                  + ["logits"], fontsize=7)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _natural(label: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]
