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
    prompts         edge_attribution's (prompts.py): lists or padded batches, `intervention` (patch, zero,
                    mean: the estimate's diff and the exact runs' source are the baseline's, baselines.py),
                    `steps_at`, metrics reading the clean logits. One estimate loop with edge_attribution
                    (attribution.py), the product kept per position.
    positions       the padded batch's COLUMNS, shared by the batch: a score at p sums the prompts' column p.
                    Prompts are left-padded, so prompt b's own position q is column q + width - length_b
                    (width: the longest prompt; `settings["lengths"]` holds the lengths); columns counted
                    from the end (-1: every prompt's last token) agree across prompts. Pad columns score 0
                    and patching them changes nothing.
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

from analysis.circuits.attribution import GraphReader, attribute, real, settings_of
from analysis.circuits.baselines import prepare
from analysis.circuits.eap import BATCH_SIZE
from analysis.circuits.graph import Graph, graph_of
from analysis.circuits.integrated import STEPS_AT
from analysis.circuits.runs import Grads, ReceiverGrads, embedding_slots, receiver_blocks
from analysis.circuits.token_edges import TokenEdge, TokenEdgeScores, TokenGradients, cut_token_edges, in_chunk
from analysis.circuits.verify import ABLATION, MASK, _ablated_sweep, _faith, metric_of, sweep
from hooked.models.protocol import ATTENTION_MODES
from hooked.validate import Flag, Integer, OneOf, as_index, checked

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
                 clean_metric: float, corrupt_metric: float, settings: dict[str, Any] | None = None) -> None:
        self.graph, self.scores, self.token, self.method = graph, scores.detach().double().cpu(), token, method
        self.clean_metric, self.corrupt_metric = clean_metric, corrupt_metric
        self.settings: dict[str, Any] = dict(settings or {})  # what produced them (attribution.settings_of)
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
        return {"method": self.method, "settings": self.settings, "clean_metric": self.clean_metric,
                "corrupt_metric": self.corrupt_metric,
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


def _position_scores(graph: Graph, diff: Tensor, emb_diff: Tensor | None, grads: Grads | ReceiverGrads,
                     chunk: int = 256) -> Tensor:
    """[n_edges, pos] sum over batch and d_model of diff[s_e, :, p] . grad[r_e, :, p] (+ the embedding slot)."""
    out = torch.zeros(len(graph), diff.shape[2], dtype=torch.float64, device=diff.device)
    for start, stop, g in receiver_blocks(graph, grads, 4):
        edges = ((graph.edge_receiver >= start) & (graph.edge_receiver < stop)).nonzero()[:, 0]
        for a in range(0, len(edges), chunk):
            e = edges[a:a + chunk]
            d, gr = diff[graph.edge_sender[e]], g[graph.edge_receiver[e] - start].to(diff.dtype)
            out[e] = torch.einsum("ebpd,ebpd->ep", d, gr).double()
    if emb_diff is not None:
        for rs, ge in zip(graph.receiver_slices, embedding_slots(grads)):
            if ge is not None:  # the embed sender reaches a side block through the embedding slot too
                e = [graph.index((graph.senders[0], graph.receivers[r])) for r in range(rs.start, rs.stop)]
                out[e] += torch.einsum("ebpd,bpd->ep", ge.double(), emb_diff[0].double())
    return out


@checked(method=OneOf("eap", "eap-ig"), steps=Integer(ge=1), token_edges=Flag(), batch_size=BATCH_SIZE,
         attention=OneOf(*ATTENTION_MODES), attention_mask=MASK, steps_at=OneOf(*STEPS_AT), **ABLATION)
def position_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, method: str = "eap", steps: int = 5,
                         token_edges: bool = True, batch_size: int | None = None, attention: str = "scores",
                         attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
                         per_position: bool = False, steps_at: str = "mid") -> PositionScores:
    """Scores of every position edge (and, with token_edges, every token edge) by EAP or EAP-IG (glossary),
    with edge_attribution's arguments (prompts, intervention, steps_at, metrics reading the clean logits).

    Costs what edge_attribution costs: the same forwards (attribution.py), the product kept per position."""
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    token = TokenGradients(model, attention, width=clean.width) if token_edges else None
    total, values = torch.zeros(len(graph), clean.width, dtype=torch.float64), [0.0, 0.0]
    for ch in attribute(model, GraphReader(graph), clean, baseline, metric, method, steps, steps_at, batch_size,
                        token, values):
        diff = real(ch.base.minus(ch.run), ch.clean.attention_mask)  # pad positions add nothing
        emb_diff = None if ch.run.emb is None else real(ch.base.emb - ch.run.emb, ch.clean.attention_mask)
        total[:, clean.width - ch.clean.width:] += ch.weight * _position_scores(graph, diff, emb_diff, ch.grads).cpu()
    return PositionScores(graph, total, token.scores() if token is not None else None, method, *values,
                          settings=settings_of(method, steps, steps_at, intervention, per_position, clean))


# ------------------------------------------------------------------------------------ exact
def _coefs(graph: Graph, n_pos: int, rows: Sequence[Sequence[tuple[int, int]]], fill: float) -> Tensor:
    """[len(rows), n_edges, pos]: `fill` everywhere, 1 - fill at each row's (edge, position)s."""
    coef = torch.full((len(rows), len(graph), n_pos), fill, dtype=torch.float64)
    for k, row in enumerate(rows):
        for e, p in row:
            coef[k, e, p] = 1.0 - fill
    return coef


def _cuts(model: Any, cut: Sequence[Any], attention: str) -> Callable[[int], Any] | None:
    """For verify.sweep: the token edges `cut` cut in a chunk whose first `offset` columns are trimmed."""
    if not cut:
        return None
    return lambda offset: cut_token_edges(model, in_chunk(cut, offset), attention)


@checked(attention=OneOf(*ATTENTION_MODES), batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def position_effects(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                     attention: str = "scores", batch_size: int | None = None, attention_mask: Tensor | None = None,
                     intervention: str = "patch", reference: Any = None, per_position: bool = False) -> Tensor:
    """[len(edges)] the metric's exact change for each edge alone: a position edge carrying the baseline
    (`intervention`, at its position only), a token edge cut in the clean run (what each kind's estimate
    estimates). Positions are the padded batch's columns (glossary)."""
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    base = metric_of(model, clean, metric, batch_size)
    out = torch.empty(len(edges), dtype=torch.float64)
    resid = [k for k, e in enumerate(edges) if not isinstance(e, TokenEdge)]
    if resid:
        rows = [[position_index(graph, clean.width, edges[k], f"edges[{k}]")] for k in resid]
        values = sweep(model, clean, baseline, _coefs(graph, clean.width, rows, 0.0), metric, graph=graph,
                       batch_size=batch_size)
        out[resid] = values - base
    for k, e in enumerate(edges):
        if isinstance(e, TokenEdge):
            out[k] = metric_of(model, clean, metric, batch_size, context=_cuts(model, [e], attention)) - base
    return out


@checked(attention=OneOf(*ATTENTION_MODES), batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def verify_positions(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                     cut: Sequence[Any] = (), attention: str = "scores", batch_size: int | None = None,
                     attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
                     per_position: bool = False) -> dict[str, float]:
    """A per-position circuit's exact metric: every position edge outside `edges` carries the baseline
    (`intervention`; the circuit's keep the clean run), and the token edges in `cut` are cut in the same run.

    Returns {"circuit", "clean", "corrupt", "faithfulness", "n_edges", "fraction"} (glossary of verify.py;
    "corrupt": the fully ablated run)."""
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    keep = [position_index(graph, clean.width, e, f"edges[{k}]") for k, e in enumerate(edges)]
    cut = list(cut)
    for k, e in enumerate(cut):
        if not isinstance(e, (TokenEdge, tuple, list)):
            raise TypeError(f"cut[{k}]: expected a token edge (TokenEdge or (unit, target, source)), got {e!r}")
    coef = _coefs(graph, clean.width, [keep], 1.0)
    values, c, x = _ablated_sweep(model, graph, clean, baseline, coef, metric, batch_size,
                                  context=_cuts(model, cut, attention))
    value, n_keep = float(values[0]), len(set(keep))
    return {"circuit": value, "clean": c, "corrupt": x, "faithfulness": _faith(value, c, x), "n_edges": n_keep,
            "fraction": n_keep / (len(graph) * clean.width)}
