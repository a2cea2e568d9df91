"""A per-position circuit drawn over positions and steps (positions.py).

Glossary
    x           the token position (only the span the drawn edges touch)
    y           the graph's steps (graph.py: a serial sublayer, or parallel branches that read one norm): a
                receiver reads at its step's height, a sender writes 0.6 above it; embed writes below step 0,
                logits read above the last
    residual    a position edge s -> r @ p: a vertical arrow at p from the sender's height to the receiver's
    token edge  u[j <- i]: an arc inside unit u's step from its input at source i to its output at target j
    colour      red when the edge's score is negative (corrupting / cutting it lowers the metric), blue when
                positive; width by |score| relative to the largest drawn
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.plots import _figure, _save

WRITE = 0.6  # a sender's height above its step's input


def _heights(graph: Any) -> tuple[dict[str, float], dict[str, float], dict[int, int]]:
    """(sender label -> height, receiver label -> height, layer -> its first step)."""
    senders = {label: g.stage + WRITE for g in graph.sender_groups for label in g.labels}
    receivers = {label: float(g.stage) for g in graph.receiver_groups for label in g.labels}
    first: dict[int, int] = {}
    for g in graph.receiver_groups:
        first.setdefault(g.layer, g.stage)
    return senders, receivers, first


def _unit_height(unit: str, senders: dict[str, float], first: dict[int, int]) -> float:
    """A token edge's unit: its sender's step, or (a unit inside a whole-sublayer sender, a Mamba-1
    channel) its layer's first step."""
    if unit in senders:
        return senders[unit] - WRITE
    from hooked.models.model_map import label_layer

    return float(first.get(label_layer(unit), 0))


def position_graph(scores: Any, n: int = 20, path: str | Path | None = None, title: str | None = None) -> Any:
    """Draw the top n edges of PositionScores (both kinds); saved when `path` is given, else the figure."""
    from analysis.circuits.token_edges import TokenEdge

    edges = scores.top(n)
    graph = scores.graph
    senders, receivers, first = _heights(graph)
    arrows = []
    for e in edges:
        if isinstance(e, TokenEdge):
            y = _unit_height(e.unit, senders, first)
            arrows.append((e, (e.source, y), (e.target, y + WRITE), f"{e.unit}[{e.target}<-{e.source}]", -0.35))
        else:
            arrows.append((e, (e.pos, senders[e.sender]), (e.pos, receivers[e.receiver]),
                           f"{e.sender}->{e.receiver}", 0.0))
    xs = [x for _, a, b, _, _ in arrows for x in (a[0], b[0])] or [0, scores.n_pos - 1]
    lo, hi = min(xs), max(xs)
    fig = _figure(3.0 + 0.9 * (hi - lo + 1), 1.5 + 0.8 * (graph.n_stages + 2))
    ax = fig.add_subplot()
    biggest = max((abs(e.score) for e in edges), default=1.0) or 1.0
    for e, start, end, text, rad in arrows:
        width = 0.6 + 4.0 * abs(e.score) / biggest
        color = "#c0392b" if e.score < 0 else "#2e6fba"
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", lw=width, color=color, alpha=0.65,
                                                             connectionstyle=f"arc3,rad={rad}"))
        ax.text((start[0] + end[0]) / 2 + 0.06, (start[1] + end[1]) / 2 + (0.25 if rad else 0.0), text,
                fontsize=6, color="#222222")
    ax.set_xlim(lo - 0.6, hi + 0.9)
    ax.set_ylim(-0.9, graph.n_stages + 0.4)
    ax.set_xticks(range(lo, hi + 1), [str(p) for p in range(lo, hi + 1)], fontsize=7)
    steps = {g.stage: g.layer for g in graph.receiver_groups}
    ax.set_yticks([WRITE - 1] + [float(s) for s in sorted(steps)],
                  ["embed"] + [f"step {s} (layer {steps[s]})" if s < graph.n_stages else "logits"
                               for s in sorted(steps)], fontsize=7)
    ax.set_xlabel("position", fontsize=8)
    ax.set_title(title if title is not None else f"per-position circuit: top {len(edges)} edges ({scores.method})",
                 fontsize=9)
    return fig if path is None else _save(fig, path)
