"""Figure and table helpers shared by the analysis modules (matplotlib, no global pyplot state).

Glossary
    figure      a `matplotlib.figure.Figure` drawn off-screen (Agg canvas) and saved to a path; no
                backend is switched and no window opens, so these run headless and in tests.
    matrix      a 2-D tensor or array shown as a heatmap, row = first axis (layer, query position).
    min-max     (x - min) / (max - min): how the G&A paper shows SSM kernels ("hidden attention"),
                whose raw values are neither positive nor normalised.
    table       a list of dicts, one per row, saved as CSV or JSON by the path's suffix.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=float)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def heatmap(matrix: Any, path: str | Path, title: str = "", xlabel: str = "", ylabel: str = "",
            cmap: str = "viridis", centered: bool = False, xticklabels: Sequence[str] | None = None,
            yticklabels: Sequence[str] | None = None, colorbar_label: str = "") -> Path:
    """Save a heatmap of `matrix` (NaN cells blank). centered=True: a diverging map around 0."""
    m = _array(matrix)
    rows, cols = m.shape
    fig = _figure(min(2 + 0.35 * cols, 16), min(1.5 + 0.3 * rows, 14))
    ax = fig.add_subplot()
    kw: dict[str, Any] = {"cmap": "RdBu_r" if centered else cmap, "aspect": "auto", "interpolation": "nearest"}
    if centered:
        bound = np.nanmax(np.abs(m)) if np.isfinite(m).any() else 1.0
        kw.update(vmin=-bound, vmax=bound)
    im = ax.imshow(np.ma.masked_invalid(m), **kw)
    fig.colorbar(im, ax=ax, label=colorbar_label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticklabels is not None:
        ax.set_xticks(range(len(xticklabels)), list(xticklabels), rotation=90, fontsize=7)
    if yticklabels is not None:
        ax.set_yticks(range(len(yticklabels)), list(yticklabels), fontsize=7)
    return _save(fig, path)


def minmax(x: Any) -> np.ndarray:
    a = _array(x)
    lo, hi = np.nanmin(a), np.nanmax(a)
    return (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)


def plot_pattern(weights: Any, path: str | Path, str_tokens: Sequence[str] | None = None, title: str = "",
                 normalise: bool = False) -> Path:
    """One head's pattern or kernel [q_pos k_pos] with token labels; normalise=True: min-max (kernels)."""
    m = minmax(weights) if normalise else _array(weights)
    labels = None if str_tokens is None else [repr(t)[1:-1] for t in str_tokens]
    return heatmap(m, path, title, "source (key) position", "target (query) position", cmap="Blues",
                   xticklabels=labels, yticklabels=labels)


def line_plot(x: Sequence[Any], series: Mapping[str, Any], path: str | Path, title: str = "", xlabel: str = "",
              ylabel: str = "", bands: Mapping[str, tuple[Any, Any]] | None = None, hline: float | None = None) -> Path:
    """Lines (one per series) over x, with optional shaded (low, high) bands and a reference line."""
    fig = _figure(6.5, 4)
    ax = fig.add_subplot()
    for label, y in series.items():
        line, = ax.plot(list(x), _array(y), marker="o", ms=3, label=label)
        if bands and label in bands:
            lo, hi = bands[label]
            ax.fill_between(list(x), _array(lo), _array(hi), color=line.get_color(), alpha=0.2)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)


def bar_plot(labels: Sequence[str], values: Any, path: str | Path, title: str = "", ylabel: str = "") -> Path:
    fig = _figure(max(4, 0.4 * len(labels) + 2), 4)
    ax = fig.add_subplot()
    ax.bar(range(len(labels)), _array(values))
    ax.set_xticks(range(len(labels)), list(labels), rotation=60, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def scatter_plot(x: Any, y: Any, path: str | Path, title: str = "", xlabel: str = "", ylabel: str = "",
                 labels: Sequence[str] | None = None, n_labels: int = 0) -> Path:
    """Scatter of y against x; the `n_labels` points with the largest y are annotated with `labels`."""
    xs, ys = _array(x), _array(y)
    fig = _figure(5, 4)
    ax = fig.add_subplot()
    ax.scatter(xs, ys, s=14, alpha=0.7)
    if labels is not None and n_labels:
        for i in np.argsort(-ys)[:n_labels]:
            ax.annotate(labels[i], (xs[i], ys[i]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def save_table(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Rows (dicts) to .csv (columns in first-seen order) or .json."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(list(rows), indent=1, default=_plain))
        return path
    if path.suffix != ".csv":
        raise ValueError(f"save_table writes .csv or .json, got {path.name!r}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows([{k: _plain(v) for k, v in r.items()} for r in rows])
    return path


def _plain(v: Any) -> Any:
    if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
        return v.item() if v.ndim == 0 else v.tolist()
    return v
