"""Per-position graphs: which token's information flows where, through the stream and inside the mixers.

Glossary
    position edge   a residual edge at one position: sender s at position p -> receiver r at the same
                    position p ("L0H3->L1H0.k@5"). The stream is per position, so an edge of graph.py is
                    the sum of its position edges: patching it is patching all of them at once.
    token edge      (unit, target j <- source i) inside a mixer (token_edges.py: "L1H0[20<-5]"): what joins
                    the positions. A path of the per-position graph runs embed@i -> L0H3.v@i ->
                    L0H3[j<-i] -> L0H3@j -> L1H0.k@j -> L1H0[20<-j] -> L1H0@20 -> logits@20.
    estimate        a position edge: EAP's score not summed over positions,
                        score(s -> r @ p) = sum over the batch of (a_s^corrupt - a_s^clean)[p] . g_r[p]
                    (g_r: the metric's gradient at the residual as r reads it, on the clean run; EAP-IG: the
                    gradient averaged over the interpolated runs, eap.py). Summed over p it is edge_attribution's
                    score. A token edge: token_edges.py's first-order estimate of cutting it in the clean run.
    exact           a position edge carries the corrupt run: receiver r reads x[p] + (a_s^corrupt - a_s)[p] at
                    position p only (runs.Patcher with a weight per edge and position); a token edge is cut by
                    the knockout machinery (token_edges.cut_token_edges). `position_effects` gives each
                    edge's exact effect alone, `verify_positions` a circuit's: every position edge outside it
                    carries the corrupt run, with the token edges in `cut` cut in the same run.
Prompts are one length and positions are shared by the batch: scores at p sum over the prompts' position p.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.eap import BATCH_SIZE, _integrated, chunks, pair
from analysis.circuits.graph import Graph, graph_of
from analysis.circuits.metrics import at_rows, tail_of
from analysis.circuits.runs import ReceiverGrads, gradients, patched, record
from analysis.circuits.token_edges import TokenEdge, TokenEdgeScores, TokenGradients, cut_token_edges
from analysis.circuits.verify import _faith, metric_of, sweep
from hooked.models.protocol import ATTENTION_MODES
from hooked.validate import Flag, Integer, OneOf, as_index, checked, metric_name, metric_value

Metric = Callable[[Tensor], Tensor]
_TEXT = re.compile(r"^(?P<sender>[^-]+)->(?P<receiver>[^@]+)@(?P<pos>-?\d+)$")


def position_index(graph: Graph, n_pos: int, edge: Any, what: str) -> tuple[int, int]:
    """(graph edge number, position) of a PositionEdge, "s->r@p" or (sender, receiver, pos); a token edge is
    refused by name (it is cut, not patched: cut=)."""
    if isinstance(edge, TokenEdge):
        raise TypeError(f"{what}: {edge} is a token edge; a circuit keeps position edges, token edges to cut "
                        "go in cut=")
    if isinstance(edge, str):
        m = _TEXT.match(edge)
        if m is None:
            raise ValueError(f"{what}: a position edge as text is 'sender->receiver@pos', got {edge!r}")
        edge = (m["sender"], m["receiver"], int(m["pos"]))
    if isinstance(edge, PositionEdge):
        edge = (edge.sender, edge.receiver, edge.pos)
    if not (isinstance(edge, (tuple, list)) and len(edge) == 3):
        raise TypeError(f"{what}: expected a PositionEdge, 'sender->receiver@pos' or (sender, receiver, pos), "
                        f"got {edge!r}")
    sender, receiver, pos = edge
    return graph.index((sender, receiver)), as_index(pos, n_pos, f"{what} {sender}->{receiver}", "positions")


@dataclass(frozen=True)
class PositionEdge:
    sender: str
    receiver: str
    pos: int
    score: float = float("nan")

    def __str__(self) -> str:
        return f"{self.sender}->{self.receiver}@{self.pos}"


class PositionScores:
    """Estimates of every position edge ([n_edges, pos]) and, with token edges, of every token edge.

    `top(n)` ranks both kinds together by |score| (each is the metric's estimated change); `[edge]` reads one
    (a PositionEdge, "s->r@p" or a TokenEdge); `at(edge)` the graph edge's scores over positions."""

    def __init__(self, graph: Graph, scores: Tensor, token: TokenEdgeScores | None, method: str,
                 clean_metric: float, corrupt_metric: float) -> None:
        self.graph, self.scores, self.token, self.method = graph, scores.detach().double().cpu(), token, method
        self.clean_metric, self.corrupt_metric = clean_metric, corrupt_metric
        self.n_pos = self.scores.shape[1]

    def __repr__(self) -> str:
        return (f"PositionScores({self.method}, {len(self.graph)} edges x {self.n_pos} positions"
                f"{'' if self.token is None else f' + {len(self.token)} token edges'}, top "
                f"{[str(e) for e in self.top(3)]})")

    def index(self, edge: Any) -> tuple[int, int]:
        """(graph edge number, position) of a PositionEdge, "s->r@p" or (sender, receiver, pos)."""
        return position_index(self.graph, self.n_pos, edge, "position edge")

    def __getitem__(self, edge: Any) -> float:
        if isinstance(edge, TokenEdge):
            if self.token is None:
                raise KeyError("these scores hold no token edges (position_attribution(token_edges=False))")
            return float(self.token.of(edge.unit)[edge.target, edge.source])
        e, p = self.index(edge)
        return float(self.scores[e, p])

    def at(self, edge: Any) -> Tensor:
        """[pos] the scores of one graph edge (an Edge, (sender, receiver) or "s->r") at every position."""
        return self.scores[self.graph.index(edge)]

    def position_edges(self, n: int | None = None) -> list[PositionEdge]:
        """The n position edges of largest |score| (all of them when n is None), largest first."""
        flat = self.scores.flatten()
        order = torch.argsort(flat.abs(), descending=True, stable=True)
        order = order if n is None else order[:n]
        out = []
        for k in order.tolist():
            e, p = divmod(k, self.n_pos)
            g = self.graph.edge(e)
            out.append(PositionEdge(g.sender, g.receiver, p, float(flat[k])))
        return out

    @checked(n=Integer(ge=0))
    def top(self, n: int) -> list[PositionEdge | TokenEdge]:
        """The n edges of either kind with the largest |score|, largest first."""
        both: list[PositionEdge | TokenEdge] = self.position_edges(n)
        if self.token is not None:
            both += self.token.top(n)
        return sorted(both, key=lambda e: -abs(e.score))[:n]

    def to_dict(self, n: int | None = None) -> dict[str, Any]:
        """The scores as plain data: every position edge (or the top n of each kind) and token edge."""
        tokens = [] if self.token is None else self.token.top(len(self.token) if n is None else n)
        return {"method": self.method, "clean_metric": self.clean_metric, "corrupt_metric": self.corrupt_metric,
                "n_pos": self.n_pos, "n_edges": len(self.graph),
                "position_edges": [{"sender": e.sender, "receiver": e.receiver, "pos": e.pos, "score": e.score}
                                   for e in self.position_edges(n)],
                "token_edges": [{"unit": e.unit, "target": e.target, "source": e.source, "score": e.score}
                                for e in tokens]}

    def to_json(self, path: str | Path, n: int | None = None) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(n), indent=1) + "\n")
        return path

    def plot(self, n: int = 20, path: str | Path | None = None, title: str | None = None) -> Any:
        """The top n edges over positions (x) and steps (y): analysis.circuits.plot.position_graph."""
        from analysis.circuits.plot_positions import position_graph

        return position_graph(self, n, path, title)


def _position_scores(graph: Graph, diff: Tensor, emb_diff: Tensor | None, grads: ReceiverGrads,
                     chunk: int = 256) -> Tensor:
    """[n_edges, pos] sum over batch and d_model of diff[s_e, :, p] . grad[r_e, :, p] (+ the embedding slot)."""
    out = torch.zeros(len(graph), diff.shape[2], dtype=torch.float64, device=diff.device)
    for start, stop, g in grads.blocks(4):
        edges = ((graph.edge_receiver >= start) & (graph.edge_receiver < stop)).nonzero()[:, 0]
        for a in range(0, len(edges), chunk):
            e = edges[a:a + chunk]
            d, gr = diff[graph.edge_sender[e]], g[graph.edge_receiver[e] - start].to(diff.dtype)
            out[e] = torch.einsum("ebpd,ebpd->ep", d, gr).double()
    if emb_diff is not None:
        for rs, ge in zip(graph.receiver_slices, grads.emb):
            if ge is not None:  # the embed sender reaches a side block through the embedding slot too
                e = [graph.index((graph.senders[0], graph.receivers[r])) for r in range(rs.start, rs.stop)]
                out[e] += torch.einsum("ebpd,bpd->ep", ge.double(), emb_diff[0].double())
    return out


@checked(method=OneOf("eap", "eap-ig"), steps=Integer(ge=1), token_edges=Flag(), batch_size=BATCH_SIZE,
         attention=OneOf(*ATTENTION_MODES))
def position_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, method: str = "eap", steps: int = 5,
                         token_edges: bool = True, batch_size: int | None = None,
                         attention: str = "scores") -> PositionScores:
    """Scores of every position edge (and, with token_edges, every token edge) by EAP or EAP-IG (glossary).

    Costs what edge_attribution costs: the same forwards, the product kept per position."""
    clean, corrupt = pair(model, clean, corrupt)
    graph = graph_of(model)
    token = TokenGradients(model, attention) if token_edges else None
    total, values, n = None, [0.0, 0.0], clean.shape[0]
    for part in chunks(n, batch_size):
        weight, m = (part.stop - part.start) / n, at_rows(metric, part)
        c_logits, corr = record(model, graph, corrupt[part], tail=tail_of(m))
        values[1] += weight * metric_value(m(c_logits), metric_name(metric))
        if method == "eap":
            value, cl, grads = gradients(model, graph, clean[part], m, token=token, pending=True)
        else:
            _, cl = record(model, graph, clean[part], tail=tail_of(m))
            value, (g, ge) = _integrated(model, graph, clean[part], corr, cl, m, steps, token)
            grads = _Pulled(graph, g, ge)
        values[0] += weight * value
        emb_diff = None if cl.emb is None else corr.emb - cl.emb
        s = weight * _position_scores(graph, corr.minus(cl), emb_diff, grads)
        total = s if total is None else total + s
        if token is not None:
            token.close_chunk(weight)
    return PositionScores(graph, total, token.scores() if token is not None else None, method, *values)


class _Pulled:
    """Gradients already pulled back ([n_receivers b p d] and the embedding slots), read like ReceiverGrads."""

    def __init__(self, graph: Graph, g: Tensor, emb: list[Tensor | None]) -> None:
        self.graph, self.g, self.emb = graph, g, emb

    def blocks(self, n: int) -> list[tuple[int, int, Tensor]]:
        return [(0, self.g.shape[0], self.g)]


# ------------------------------------------------------------------------------------ exact
def _coefs(graph: Graph, n_pos: int, rows: Sequence[Sequence[tuple[int, int]]], fill: float) -> Tensor:
    """[len(rows), n_edges, pos]: `fill` everywhere, 1 - fill at each row's (edge, position)s."""
    coef = torch.full((len(rows), len(graph), n_pos), fill, dtype=torch.float64)
    for k, row in enumerate(rows):
        for e, p in row:
            coef[k, e, p] = 1.0 - fill
    return coef


def _patched_metric(model: Any, graph: Graph, clean: Tensor, corrupt: Tensor, coef: Tensor, metric: Metric,
                    batch_size: int | None, cut: Sequence[Any], attention: str) -> Tensor:
    """[len(coef)] metric of clean patched by each row of coef [k, n_edges, pos] from the corrupt run (recorded
    with no cut), with the token edges `cut` cut in the patched runs."""
    out = torch.zeros(coef.shape[0], dtype=torch.float64)
    n, dtype = clean.shape[0], next(model.parameters()).dtype
    for part in chunks(n, batch_size):
        rows, m = part.stop - part.start, at_rows(metric, part)
        _, src = record(model, graph, corrupt[part])
        with cut_token_edges(model, cut, attention):
            for k in range(coef.shape[0]):
                logits = patched(model, graph, clean[part], src, coef[k:k + 1].to(dtype), tail=tail_of(m))
                out[k] += rows / n * metric_value(m(logits), metric_name(metric))
    return out


@checked(attention=OneOf(*ATTENTION_MODES), batch_size=BATCH_SIZE)
def position_effects(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                     attention: str = "scores", batch_size: int | None = None) -> Tensor:
    """[len(edges)] the metric's exact change for each edge alone: a position edge carrying the corrupt run
    (at its position only), a token edge cut in the clean run (what each kind's estimate estimates)."""
    clean, corrupt = pair(model, clean, corrupt)
    graph, n_pos = graph_of(model), clean.shape[1]
    base = metric_of(model, clean, metric, batch_size)
    out = torch.empty(len(edges), dtype=torch.float64)
    resid = [k for k, e in enumerate(edges) if not isinstance(e, TokenEdge)]
    if resid:
        rows = [[position_index(graph, n_pos, edges[k], f"edges[{k}]")] for k in resid]
        values = sweep(model, clean, corrupt, _coefs(graph, n_pos, rows, 0.0), metric, graph=graph,
                       batch_size=batch_size)
        out[resid] = values - base
    for k, e in enumerate(edges):
        if isinstance(e, TokenEdge):
            with cut_token_edges(model, [e], attention):
                out[k] = metric_of(model, clean, metric, batch_size) - base
    return out


@checked(attention=OneOf(*ATTENTION_MODES), batch_size=BATCH_SIZE)
def verify_positions(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                     cut: Sequence[Any] = (), attention: str = "scores",
                     batch_size: int | None = None) -> dict[str, float]:
    """A per-position circuit's exact metric: every position edge outside `edges` carries the corrupt run (the
    circuit's keep the clean one), and the token edges in `cut` are cut in the same run.

    Returns {"circuit", "clean", "corrupt", "faithfulness", "n_edges", "fraction"} (glossary of verify.py)."""
    clean, corrupt = pair(model, clean, corrupt)
    graph, n_pos = graph_of(model), clean.shape[1]
    keep = [position_index(graph, n_pos, e, f"edges[{k}]") for k, e in enumerate(edges)]
    cut = list(cut)
    for k, e in enumerate(cut):
        if not isinstance(e, (TokenEdge, tuple, list)):
            raise TypeError(f"cut[{k}]: expected a token edge (TokenEdge or (unit, target, source)), got {e!r}")
    coef = _coefs(graph, n_pos, [keep], 1.0)
    value = float(_patched_metric(model, graph, clean, corrupt, coef, metric, batch_size, cut, attention)[0])
    c, x = metric_of(model, clean, metric, batch_size), metric_of(model, corrupt, metric, batch_size)
    n_keep = len(set(keep))
    return {"circuit": value, "clean": c, "corrupt": x, "faithfulness": _faith(value, c, x), "n_edges": n_keep,
            "fraction": n_keep / (len(graph) * n_pos)}
