"""Token edges: (unit, target j <- source i) inside a mixer, scored from gradients and verified by knockout.

Glossary
    token edge   what unit u (an attention head, an SSM head or Mamba-1 channel) at target position j reads
                 from source position i in one layer: a pattern entry A[u, j, i] or a kernel entry K[u, j, i]
                 (DESIGN.md section 4). Labelled "L1H0[7<-3]". Conv taps are not scored here.
    cut          knockout (analysis.interventions.knockout's arithmetic): an SSM's y_j loses K[j, i] u_i;
                 attention either zeroes A[j, i] ("pattern") or sets its score to -inf so the row
                 renormalises ("scores")
    estimate     the first-order change of the metric when the edge alone is cut in the clean run, summed
                 over the batch (positions are shared by the batch):
                 SSM        -K[u, j, i] (g_y[j, u] . x_i[u])      (y is linear in the kernel: the change of y
                            is exact, only what follows y is linearised)
                 "pattern"  -A[u, j, i] g_A[u, j, i],   g_A[u, j, k] = g_z[j, u] . v[k, u]
                 "scores"   A_ji / (1 - A_ji) (sum_k A_jk g_A[j, k] - g_A[j, i]): the renormalised row's
                            change (the whole row, -A g_A, when i is the row's only key)
                 where g_y, g_z are the metric's gradients at hook_y, hook_z and x_i the SSM input u_i.
The scores are the metric's estimated change (negative: the cut lowers the metric).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.metrics import at_rows, tail_of, with_clean
from analysis.circuits.runs import forward_logits
from hooked.hook_points import scoped_hooks
from hooked.models.model_map import Site, model_map
from hooked.models.protocol import ATTENTION_MODES
from hooked.validate import (Flag, Instance, Integer, OneOf, Text, check, checked, metric_name, metric_value,
                             token_edge)


@dataclass(frozen=True)
class TokenEdge:
    unit: str
    target: int
    source: int
    score: float = float("nan")

    def __str__(self) -> str:
        return f"{self.unit}[{self.target}<-{self.source}]"


def token_sites(model: Any) -> list[Site]:
    """Every token mixer's site of the model map (path, module, units and their labels), in forward order."""
    return model_map(model).mixers()


class TokenGradients:
    """Hooks for a gradient run (runs.gradients) that score every token edge of every mixer."""

    def __init__(self, model: Any, attention: str = "scores", width: int | None = None) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.attention, self.width = attention, width  # width: the padded batch's (chunks may be narrower)
        self.sites = token_sites(model)
        for site in self.sites:
            _check_scorable(site.path, site.module)
        self._seen: dict[str, dict[str, Tensor]] = {}
        self._pending: dict[str, Tensor] = {}
        self._total: dict[str, Tensor] = {}

    def hooks(self) -> list[tuple[Any, Callable]]:
        self._seen = {site.path: {} for site in self.sites}
        out = []
        for site in self.sites:
            seen = self._seen[site.path]

            def keep(key: str, seen: dict = seen) -> Callable:
                def fn(x: Tensor, hook: Any) -> None:
                    seen[key] = x.detach()
                return fn

            def grad_at(key: str, seen: dict = seen) -> Callable:
                def fn(x: Tensor, hook: Any) -> Tensor:
                    seen[key] = x.clone()
                    return seen[key]
                return fn

            mixing = site.mixing()  # output[j] = sum_i matrix[j, i] value[i]: pattern and v into z, kernel and u into y
            out += [(mixing.value, keep("v")), (mixing.matrix, keep("A")), (mixing.output, grad_at("out"))]
        return out

    def tensors(self) -> list[Tensor]:
        return [self._seen[site.path]["out"] for site in self.sites]

    def take(self, grads: Sequence[Tensor | None]) -> None:
        for site, g in zip(self.sites, grads):
            seen = self._seen[site.path]
            if g is None:
                score = None
            elif site.mixing().scores is not None:  # a softmax's entries: cut by renormalising or zeroing
                score = _attention_scores(seen["A"], site.module.repeat_kv(seen["v"]), g, self.attention)
            else:  # a kernel's: output is linear in them
                score = _kernel_scores(seen["A"], seen["v"], g, site.n)
            if score is not None:
                self._pending[site.path] = self._pending.get(site.path, 0) + score
        self._seen = {}

    def close_chunk(self, weight: float) -> None:
        for name, s in self._pending.items():
            pad = 0 if self.width is None else self.width - s.shape[-1]  # a chunk trimmed to its longest prompt:
            s = torch.nn.functional.pad(s, (pad, 0, pad, 0)) if pad else s  # its columns are the last ones
            self._total[name] = self._total.get(name, 0) + weight * s
        self._pending = {}

    def scores(self) -> "TokenEdgeScores":
        return TokenEdgeScores({site.path: (site.labels(), self._total[site.path]) for site in self.sites
                                if site.path in self._total}, self.attention)


def kernel_io(m: Any) -> tuple[Any, Any] | None:
    """(u, y) hook points of a recurrent mixer with y_j = sum_i K[j, i] u_i (K at hook_kernel, S0 = 0): the
    SSM input and output, a delta rule's values and output (its kernel reads q, k, beta, alpha), or a short
    conv's input B x and gated output C * conv (its bias is no kernel term); None when it has none."""
    mixing = m.mixing()  # the mixer's own answer (hooked.models.protocol.Mixing)
    return None if mixing is None or mixing.scores is not None else (mixing.value, mixing.output)


def _values_per_head(m: Any) -> bool:
    """Whether hook_v holds values per query head (latent attention) or per key-value head (repeat_kv)."""
    axes = m.mixing().value.axes
    return len(axes) == 4 and axes[2] in ("n_heads", "n_kv_heads")


def _check_scorable(name: str, m: Any) -> None:
    """Token-edge scores read attention's pattern and values per key-value head, or a recurrent mixer's
    kernel with its input and output (kernel_io); other mixers are refused by name."""
    mixing = m.mixing()
    ok = mixing is not None and (mixing.scores is None or _values_per_head(m))
    if not ok:
        raise NotImplementedError(
            f"token-edge scores: {name} ({type(m).__name__}) has no per-head pattern with values, nor a kernel "
            "with y = K u; score this model's residual edges (token_edges=False), or cut its token edges with "
            "knockout")


def _attention_scores(A: Tensor, v: Tensor, g_z: Tensor, mode: str) -> Tensor:
    g_A = torch.einsum("bjhd,bkhd->bhjk", g_z.double(), v.double())
    A = A.double()
    if mode == "pattern":
        s = -A * g_A
    else:
        whole = (A * g_A).sum(-1, keepdim=True)
        alone = A >= 1.0  # the row's only key: cutting it empties the row
        s = torch.where(alone, -A * g_A, A / (1.0 - A).clamp(min=1e-300) * (whole - g_A))
    return s.sum(0)  # [units q k]


def _kernel_scores(K: Tensor, u: Tensor, g_y: Tensor, n: int) -> Tensor:
    b, l = u.shape[:2]
    uu, gg = u.reshape(b, l, n, -1).double(), g_y.reshape(b, l, n, -1).double()
    return -(K.double() * torch.einsum("bjcr,bicr->bcji", gg, uu)).sum(0)  # [units j i]


class TokenEdgeScores:
    """Token-edge estimates of every mixer: `len()`, `.top(n)`, `.of(unit)` ([target source])."""

    def __init__(self, sites: dict[str, tuple[list[str], Tensor]], attention: str) -> None:
        self.sites, self.attention = sites, attention
        self._units = {label: (name, i) for name, (labels, _) in sites.items() for i, label in enumerate(labels)}

    def __len__(self) -> int:
        return sum(s.shape[0] * s.shape[1] * (s.shape[1] + 1) // 2 for _, s in self.sites.values())

    def of(self, unit: str) -> Tensor:
        name, i = self._units[unit]
        return self.sites[name][1][i]

    @checked(n=Integer(ge=0), absolute=Flag())  # past len(self): every token edge
    def top(self, n: int, absolute: bool = True) -> list[TokenEdge]:
        flat, index = [], []
        for name, (labels, s) in self.sites.items():
            causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
            u, j, i = (causal[None].expand_as(s)).nonzero(as_tuple=True)
            flat.append(s[u, j, i])
            index += [(labels[a], int(b), int(c)) for a, b, c in zip(u.tolist(), j.tolist(), i.tolist())]
        values = torch.cat(flat)
        order = torch.argsort(values.abs() if absolute else values, descending=True, stable=True)[:n]
        return [TokenEdge(*index[k], float(values[k])) for k in order.tolist()]


# ------------------------------------------------------------------------------------ knockout
def _as_triples(edges: Sequence[Any]) -> list[tuple[str, int, int]]:
    """(unit, target, source) of each edge, its positions integers (their range: at the run, token_edge)."""
    out = []
    for k, e in enumerate(edges):
        unit, j, i = (e.unit, e.target, e.source) if isinstance(e, TokenEdge) else e
        what = f"edges[{k}]"
        out.append((check(unit, f"{what}: unit", Text()), check(j, f"{what}: target", Integer()),
                    check(i, f"{what}: source", Integer())))
    return out


def in_chunk(edges: Sequence[Any], offset: int) -> list[tuple[str, int, int]]:
    """The token edges of a padded batch's columns in a chunk whose first `offset` columns are trimmed:
    positions >= 0 move back by offset (those before the chunk, pad columns of all its prompts, are
    dropped: cutting them changes nothing); positions from the end (< 0) are the same columns."""
    out = []
    for unit, j, i in _as_triples(edges):
        if 0 <= j < offset or 0 <= i < offset:
            continue
        out.append((unit, j if j < 0 else j - offset, i if i < 0 else i - offset))
    return out


@contextlib.contextmanager
def cut_token_edges(model: Any, edges: Sequence[Any], attention: str = "scores") -> Iterator[Any]:
    """Cut exactly the listed token edges (TokenEdges or (unit, target, source)) while open: attention per
    head (the other heads keep the entry), SSM per unit (mixer.cut_edges restricted to that unit)."""
    check(attention, "cut_token_edges: attention", OneOf(*ATTENTION_MODES))
    units = {label: (site.module, h) for site in token_sites(model) for h, label in enumerate(site.labels())}
    by_unit: dict[str, list[tuple[int, int]]] = {}
    for unit, j, i in _as_triples(edges):
        if unit not in units:
            raise KeyError(f"no unit {unit!r} in this model's mixers")
        token_edge(j, i, None, f"token edge {unit}[{j}<-{i}]")  # what is known before the run; the rest at it
        by_unit.setdefault(unit, []).append((j, i))
    hooks: list[tuple[Any, Callable]] = []
    attn_cuts: dict[int, tuple[Any, dict[int, tuple[str, list[tuple[int, int]]]]]] = {}
    for unit, pairs in by_unit.items():
        m, h = units[unit]
        if m.mixing().scores is not None:  # attention: per head here (its cut_edges cuts every head)
            attn_cuts.setdefault(id(m), (m, {}))[1][h] = (unit, pairs)
            continue
        channels = torch.zeros(m.heads().n, dtype=torch.bool)
        channels[h] = True
        targets: dict[int, list[int]] = {}
        for j, i in pairs:
            targets.setdefault(j, []).append(i)
        for j, sources in targets.items():
            hooks += [(p, fn) for p, fn in m.cut_edges(_masks(unit, j, sources), channels)]
    for m, per_head in attn_cuts.values():
        hooks += _head_cut_hooks(m, per_head, attention)
    with scoped_hooks([(p, fn, False) for p, fn in hooks]):
        yield model


def _masks(unit: str, target: int, sources: list[int]) -> Callable[[int, int, torch.device], tuple[Tensor, Tensor]]:
    def masks(batch: int, pos: int, device: torch.device) -> tuple[Tensor, Tensor]:
        t = torch.zeros(batch, pos, dtype=torch.bool, device=device)
        s = torch.zeros_like(t)
        for i in sources:
            j, i = token_edge(target, i, pos, f"token edge {unit}[{target}<-{i}]")
            t[:, j], s[:, i] = True, True
        return t, s
    return masks


def _head_cut_hooks(m: Any, per_head: dict[int, tuple[str, list[tuple[int, int]]]],
                    mode: str) -> list[tuple[Any, Callable]]:
    state: dict[str, Tensor] = {}

    def cut_of(x: Tensor) -> Tensor:
        cut = torch.zeros(x.shape[1:], dtype=torch.bool, device=x.device)  # [heads q k]
        for h, (unit, pairs) in per_head.items():
            j, i = zip(*(token_edge(j, i, x.shape[-2], f"token edge {unit}[{j}<-{i}]") for j, i in pairs))
            cut[h, list(j), list(i)] = True
        return cut[None]

    def on_scores(scores: Tensor, hook: Any) -> Tensor:
        cut = cut_of(scores)
        live = scores > torch.finfo(scores.dtype).min / 2
        state["dead"] = (live & cut).any(-1) & ~(live & ~cut).any(-1)
        return scores.masked_fill(cut, float("-inf"))

    def on_pattern(pattern: Tensor, hook: Any) -> Tensor:
        if mode == "pattern":
            return pattern.masked_fill(cut_of(pattern), 0.0)
        dead = state.pop("dead")
        return pattern.masked_fill(dead[..., None], 0.0) if bool(dead.any()) else pattern

    return ([(m.hook_attn_scores, on_scores)] if mode == "scores" else []) + [(m.hook_pattern, on_pattern)]


@torch.no_grad()
@checked(attention=OneOf(*ATTENTION_MODES), attention_mask=Instance(Tensor, "a tensor", none=True),
         batch_size=Integer(ge=1, none=True))
def verify_token_edges(model: Any, tokens: Any, edges: Sequence[Any], metric: Callable[..., Tensor],
                       attention: str = "scores", attention_mask: Tensor | None = None,
                       batch_size: int | None = None) -> dict[str, float]:
    """The metric's exact change when the listed token edges are all cut, beside the sum of their estimates
    (TokenEdges carry theirs): {"exact", "estimated", "clean"}. `tokens`: prompts as edge_attribution takes
    them (prompts.py); positions are the padded batch's columns, as edge_attribution(token_edges=True)
    scores them (prompt b's own position q is column q + width - length_b)."""
    from analysis.circuits.attribution import chunks
    from analysis.circuits.prompts import check_metric, prompts_of

    prompts = prompts_of(model, tokens, attention_mask, "tokens")
    if prompts.padded:
        check_metric(metric, prompts)
    clean = cut = 0.0
    for part in chunks(prompts.batch, batch_size):
        x, m, weight = prompts.rows(part), at_rows(metric, part), (part.stop - part.start) / prompts.batch
        clean_logits = forward_logits(model, x.tokens, x.attention_mask, tail_of(m))
        bound = with_clean(m, clean_logits)  # a metric(logits, clean_logits) reads the uncut run's
        clean += weight * metric_value(bound(clean_logits), metric_name(metric))
        with cut_token_edges(model, in_chunk(edges, prompts.width - x.width), attention):
            logits = forward_logits(model, x.tokens, x.attention_mask, tail_of(m))
        cut += weight * metric_value(bound(logits), metric_name(metric))
    estimated = sum(e.score for e in edges if isinstance(e, TokenEdge))
    return {"clean": clean, "exact": cut - clean, "estimated": float(estimated)}
