"""Edge scores saved and loaded as JSON, with the graph they score.

Glossary
    file         one JSON object: "format" and "version", "model" (the model's name: its loader's hub id or
                 path when known, else its family), "method", "settings", "clean_metric", "corrupt_metric",
                 the graph ("senders", "receivers", "owners": per receiver its owners' sender numbers,
                 "edges": [sender number, receiver number] per edge in edge order) and "scores" (one float
                 per edge, written with Python's shortest round-trip repr: loading gives the same floats)
    StoredGraph  a saved graph, loaded without its model: names, edges and owners (enough for indexing,
                 selection, drawing and dot text; not for runs, which need the model)
    load         with a model, the scores are put on its graph after checking that the saved graph is the
                 same (senders, receivers and edges, in order); without, on a StoredGraph.
Token-edge scores (`EdgeScores.token`) are not saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from analysis.circuits.graph import Graph

FORMAT, VERSION = "hooked.circuits.EdgeScores", 1


class StoredGraph(Graph):
    """A graph read from a file: Graph's indexing (`edge`, `edges`, `index`, `mask`, `len`) without a model."""

    def __init__(self, senders: list[str], receivers: list[str], edges: list[list[int]], owners: list[list[int]],
                 model_name: str | None = None) -> None:
        self.model, self.model_name = None, model_name
        self.sender_groups, self.receiver_groups, self.n_stages = [], [], 0
        self.senders, self.receivers = list(senders), list(receivers)
        self.owners = [tuple(o) for o in owners]
        self.edge_sender = torch.tensor([s for s, _ in edges], dtype=torch.long)
        self.edge_receiver = torch.tensor([r for _, r in edges], dtype=torch.long)
        self._edge_index = {(s, r): i for i, (s, r) in enumerate(edges)}
        self._sender_index = {label: i for i, label in enumerate(self.senders)}
        self._receiver_index = {label: i for i, label in enumerate(self.receivers)}

    def __repr__(self) -> str:
        return (f"StoredGraph({self.model_name}: {len(self.senders)} senders, {len(self.receivers)} receivers, "
                f"{len(self)} edges)")


def model_name(model: Any) -> str:
    """What names a model in a saved file: its hub id or path when its loader kept one, else its family."""
    for name in ("name_or_path", "source"):
        value = getattr(model, name, None)
        if isinstance(value, (str, Path)):
            return str(value)
    return str(getattr(model, "family", type(model).__name__))


def _graph_dict(graph: Graph) -> dict[str, Any]:
    return {"senders": list(graph.senders), "receivers": list(graph.receivers),
            "owners": [list(o) for o in graph.owners],
            "edges": [[s, r] for s, r in zip(graph.edge_sender.tolist(), graph.edge_receiver.tolist())]}


def save(scores: Any, path: str | Path) -> Path:
    """Write `scores` (EdgeScores) with its graph to `path` as JSON (the glossary); returns the path."""
    graph = scores.graph
    name = graph.model_name if isinstance(graph, StoredGraph) else model_name(graph.model)
    data = {"format": FORMAT, "version": VERSION, "model": name, "method": scores.method,
            "settings": scores.settings, "clean_metric": scores.clean_metric,
            "corrupt_metric": scores.corrupt_metric, **_graph_dict(graph), "scores": scores.scores.tolist()}
    path = Path(path)
    try:
        text = json.dumps(data)
    except TypeError as e:
        raise ValueError(f"scores.settings must hold JSON values (numbers, strings, lists, dicts): {e}") from None
    path.write_text(text + "\n")
    return path


def load(path: str | Path, model: Any = None) -> dict[str, Any]:
    """What EdgeScores.load builds its scores from: {"graph", "scores", "method", "clean_metric",
    "corrupt_metric", "settings"} of the file at `path`, the graph `model`'s (checked to be the saved one)
    or a StoredGraph."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no file {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"path: {str(path)!r} is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"path: {str(path)!r} holds no saved edge scores (format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"path: {str(path)!r} is version {data.get('version')!r}; this hooked reads {VERSION}")
    stored = StoredGraph(data["senders"], data["receivers"], data["edges"], data["owners"], data["model"])
    if len(data["scores"]) != len(stored):
        raise ValueError(f"path: {len(data['scores'])} scores for {len(stored)} edges")
    graph: Graph = stored
    if model is not None:
        from analysis.circuits.graph import graph_of

        graph = graph_of(model)
        mine = _graph_dict(graph)
        for key in ("senders", "receivers", "edges", "owners"):
            if mine[key] != data[key]:
                raise ValueError(f"model: its graph's {key} differ from the saved graph's (saved on "
                                 f"{data['model']!r}, {stored}; this model: {graph})")
    scores = torch.tensor([float(s) for s in data["scores"]], dtype=torch.float64)
    return {"graph": graph, "scores": scores, "method": data["method"], "clean_metric": data["clean_metric"],
            "corrupt_metric": data["corrupt_metric"], "settings": data["settings"]}
