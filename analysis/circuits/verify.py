"""Exact verification of edge sets: patched runs (runs.py) with 0/1 weights, faithfulness, pruning.

Glossary
    circuit        a set of edges. Run on clean with only the circuit's edges carrying the clean run and
                   every other edge the corrupt run (its sender's corrupt activation replaces its clean
                   one in that receiver's input: path patching of every non-circuit edge at once)
    faithfulness   (metric(circuit) - metric(corrupt)) / (metric(clean) - metric(corrupt)): 1 when the
                   circuit alone carries the clean behaviour, 0 when it carries none (Hanna et al. 2024)
    edge effect    the metric's exact change when one edge alone carries the corrupt run (what EAP
                   estimates to first order)
    prune          the edges kept from a scoring: the top_n by |score|, or those with |score| >= threshold
    rescore        the estimate screens, exact edge effects rank: the `shortlist` edges of largest |estimate|
                   get their exact single-edge effect as score (one batched sweep). First-order estimates
                   can get an edge's sign wrong where attention moves (gpt2-kv: L0H3->L1H0.v estimated
                   +11.6 by EAP-IG, exactly -0.88), so top-n of the estimate alone can waste slots
    prompts        clean and corrupt as edge_attribution takes them: prompts of different lengths (lists, or
                   token batches with their `attention_mask`) run left-padded, each pair of one length
                   (prompts.py); every value equals the per-prompt runs combined as the metric combines them
    intervention   what a non-circuit edge carries (baselines.py): "patch" (the corrupt run), "zero", "mean"
                   (over `reference=`, whole or per_position); with zero and mean, "corrupt" in the results is
                   the fully ablated run (every edge at the baseline: one more replica of the sweep)
    clean logits   a metric(logits, clean_logits) (metrics.py) gets the unpatched base run's logits: one
                   forward per chunk
All variants of a sweep share forwards: replicas (analysis.interventions.batching) of the clean batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.baselines import INTERVENTIONS, Baseline, prepare
from analysis.circuits.eap import BATCH_SIZE, EdgeScores, chunks
from analysis.circuits.graph import Edge, Graph, graph_of
from analysis.circuits.metrics import at_rows, reads_clean, tail_of, with_clean
from analysis.circuits.prompts import Prompts, unpadded
from analysis.circuits.runs import forward_logits, patched
from analysis.interventions.batching import tiles_for
from hooked.validate import Flag, Instance, Integer, Number, OneOf, Seq, checked, metric_name, metric_value

Metric = Callable[..., Tensor]
ABLATION = dict(intervention=OneOf(*INTERVENTIONS), per_position=Flag())  # the rules of every entry point below


N_EDGES = lambda args: len(args["scores"])  # noqa: E731  (a count of edges is at most the graph's)


@checked(top_n=Integer(ge=0, none=True), threshold=Number(ge=0, none=True))
def prune(scores: EdgeScores, top_n: int | None = None, threshold: float | None = None) -> list[Edge]:
    """The edges kept by `top_n` (largest |score| first) or by `threshold` (|score| >= threshold); one of them."""
    if (top_n is None) == (threshold is None):
        raise ValueError("prune takes one of top_n or threshold")
    if top_n is not None:
        return scores.top(top_n)
    keep = int((scores.scores.abs() >= float(threshold)).sum())
    return scores.top(keep)


MASK = Instance(Tensor, "a tensor", none=True)  # the padding of clean and corrupt token batches (prompts.py)


@checked(shortlist=Integer(ge=0, le=N_EDGES), batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def rescore(model: Any, scores: EdgeScores, clean: Any, corrupt: Any, metric: Metric, shortlist: int,
            batch_size: int | None = None, attention_mask: Tensor | None = None, intervention: str = "patch",
            reference: Any = None, per_position: bool = False) -> EdgeScores:
    """A copy of `scores` whose `shortlist` largest-|score| edges score their exact effect (edge_effects);
    the other edges keep their estimate."""
    order = scores.order()[:shortlist]
    exact = edge_effects(model, [int(i) for i in order], clean, corrupt, metric, batch_size,
                         attention_mask=attention_mask, intervention=intervention, reference=reference,
                         per_position=per_position)
    values = scores.scores.clone()
    values[order] = exact
    return EdgeScores(scores.graph, values, f"{scores.method}+exact{shortlist}", scores.clean_metric,
                      scores.corrupt_metric, scores.token, scores.settings | {"shortlist": shortlist})


def sweep(model: Any, base: Tensor | Prompts, source: Tensor | Prompts | Baseline, coefs: Tensor, metric: Metric, *,
          graph: Graph | None = None, batch_size: int | None = None, replicas: int | None = None,
          frozen: bool = False, context: Callable[[int], Any] | None = None) -> Tensor:
    """metric of `base` patched by each row of coefs [k, n_edges] (runs.patched), [k] (float64). base and
    source: token ids of one shape, or Prompts of equal lengths (prompt_pair); or source a baselines.Baseline
    (of this graph).

    Chunks of the prompts are weighted by their share of the batch (a metric that is a mean over prompts).
    coefs [k, n_edges, pos]: a weight per edge and column of the padded batch (a chunk reads its last
    columns). context(offset): a context manager open around the patched forwards of a chunk whose first
    `offset` columns are trimmed (positions.py: token edges cut)."""
    graph = graph or graph_of(model)
    base = _prompts(base)
    baseline = source if isinstance(source, Baseline) else Baseline(graph, "patch", corrupt=_prompts(source))
    out = torch.zeros(coefs.shape[0], dtype=torch.float64)
    n = base.batch
    dtype = next(model.parameters()).dtype
    for part in chunks(n, batch_size):
        rows, m = part.stop - part.start, at_rows(metric, part)
        b = base.rows(part)
        _, src = baseline.activations(model, part, b)
        m = _bound(model, m, b)
        r = replicas or tiles_for(model, rows, b.width)
        for start in range(0, coefs.shape[0], r):
            block = coefs[start:start + r] if coefs.ndim == 2 else coefs[start:start + r, :, base.width - b.width:]
            with _opened(context, base.width - b.width):
                logits = patched(model, graph, b.tokens, src, block.to(dtype), b.attention_mask, frozen=frozen,
                                 tail=tail_of(m))
            for k in range(block.shape[0]):
                out[start + k] += (rows / n) * metric_value(m(logits[k * rows:(k + 1) * rows]), metric_name(metric))
    return out


def _opened(context: Callable[[int], Any] | None, offset: int) -> Any:
    return contextlib.nullcontext() if context is None else context(offset)


def _prompts(x: Tensor | Prompts) -> Prompts:
    return x if isinstance(x, Prompts) else unpadded(x)


@torch.no_grad()
def _bound(model: Any, metric: Metric, clean: Prompts) -> Callable[[Tensor], Tensor]:
    """The one-argument metric: bound to the logits of `clean` (one forward) when it reads the clean logits."""
    if not reads_clean(metric):
        return metric
    return with_clean(metric, forward_logits(model, clean.tokens, clean.attention_mask, tail_of(metric)))


@torch.no_grad()
def metric_of(model: Any, tokens: Tensor | Prompts, metric: Metric, batch_size: int | None = None,
              clean: Tensor | Prompts | None = None, context: Callable[[int], Any] | None = None) -> float:
    """The metric of an unpatched run (chunked as `sweep`); `clean`: the prompts whose logits a metric reading
    the clean logits compares with (default: `tokens`); `context`: as sweep's, open around the run measured."""
    tokens = _prompts(tokens)
    clean = tokens if clean is None else _prompts(clean)
    n = tokens.batch
    total = 0.0
    for p in chunks(n, batch_size):
        m, t = _bound(model, at_rows(metric, p), clean.rows(p)), tokens.rows(p)
        with _opened(context, tokens.width - t.width):
            logits = forward_logits(model, t.tokens, t.attention_mask, tail_of(m))
        total += (p.stop - p.start) / n * metric_value(m(logits), metric_name(metric))
    return total


def _ablated_sweep(model: Any, graph: Graph, clean: Prompts, baseline: Baseline, coefs: Tensor, metric: Metric,
                   batch_size: int | None, context: Callable[[int], Any] | None = None) -> tuple[Tensor, float, float]:
    """(the sweep's values, the clean metric, the fully ablated one: the corrupt run when patching, else one
    more replica with every edge at the baseline)."""
    c = metric_of(model, clean, metric, batch_size)
    if baseline.kind == "patch":
        values = sweep(model, clean, baseline, coefs, metric, graph=graph, batch_size=batch_size, context=context)
        return values, c, metric_of(model, baseline.corrupt, metric, batch_size, clean=clean)
    rows = torch.cat([coefs, torch.ones(1, *coefs.shape[1:], dtype=coefs.dtype)])
    values = sweep(model, clean, baseline, rows, metric, graph=graph, batch_size=batch_size, context=context)
    return values[:-1], c, float(values[-1])


@checked(batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def circuit_metric(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                   batch_size: int | None = None, attention_mask: Tensor | None = None, intervention: str = "patch",
                   reference: Any = None, per_position: bool = False) -> dict[str, float]:
    """{"circuit", "clean", "corrupt", "faithfulness", "n_edges", "fraction"} of one circuit, in one patched pass
    ("corrupt": the fully ablated run, see the glossary)."""
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    keep = graph.mask(edges)
    values, c, x = _ablated_sweep(model, graph, clean, baseline, (~keep).double()[None], metric, batch_size)
    value = float(values[0])
    return {"circuit": value, "clean": c, "corrupt": x, "faithfulness": _faith(value, c, x),
            "n_edges": int(keep.sum()), "fraction": float(keep.sum()) / len(graph)}


def _faith(value: float, clean: float, corrupt: float) -> float:
    if clean == corrupt:
        raise ValueError("the metric is equal on clean and corrupt: faithfulness is undefined")
    return (value - corrupt) / (clean - corrupt)


@checked(batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def verify_circuit(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                   batch_size: int | None = None, attention_mask: Tensor | None = None, intervention: str = "patch",
                   reference: Any = None, per_position: bool = False) -> float:
    """Faithfulness of the circuit `edges` (Edges, (sender, receiver) pairs or "sender->receiver"): the metric
    with only those edges carrying the clean run and every other edge the baseline (`intervention`: the
    corrupt run, zero, or the mean over `reference`), as a fraction of clean minus fully ablated. Exact: one
    forward (plus the clean, ablated and source-recording forwards)."""
    return circuit_metric(model, edges, clean, corrupt, metric, batch_size, attention_mask, intervention=intervention,
                          reference=reference, per_position=per_position)["faithfulness"]


@checked(sizes=Seq(Integer(ge=0, le=N_EDGES)), batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def faithfulness_curve(model: Any, scores: EdgeScores, clean: Any, corrupt: Any, metric: Metric,
                       sizes: Sequence[int], batch_size: int | None = None, attention_mask: Tensor | None = None,
                       intervention: str = "patch", reference: Any = None,
                       per_position: bool = False) -> list[dict[str, float]]:
    """Faithfulness of the top-k circuits for each k in sizes (replicas share forwards)."""
    graph = scores.graph
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    order = scores.order()
    coefs = torch.ones(len(sizes), len(graph), dtype=torch.float64)
    for row, k in enumerate(sizes):
        coefs[row, order[:k]] = 0.0
    values, c, x = _ablated_sweep(model, graph, clean, baseline, coefs, metric, batch_size)
    return [{"n_edges": int(k), "fraction": k / len(graph), "metric": float(v), "faithfulness": _faith(float(v), c, x)}
            for k, v in zip(sizes, values)]


@checked(batch_size=BATCH_SIZE, replicas=Integer(ge=1, none=True), attention_mask=MASK, **ABLATION)
def edge_effects(model: Any, edges: Sequence[Any], clean: Any, corrupt: Any, metric: Metric,
                 batch_size: int | None = None, replicas: int | None = None, attention_mask: Tensor | None = None,
                 intervention: str = "patch", reference: Any = None, per_position: bool = False) -> Tensor:
    """[len(edges)] the metric's exact change when each edge alone carries the baseline (`intervention`)."""
    graph = graph_of(model)
    clean, baseline = prepare(model, graph, clean, corrupt, intervention, reference, per_position, batch_size,
                              attention_mask, metric)
    coefs = torch.zeros(len(edges), len(graph), dtype=torch.float64)
    for row, e in enumerate(edges):
        coefs[row, graph.index(e)] = 1.0
    values = sweep(model, clean, baseline, coefs, metric, graph=graph, batch_size=batch_size, replicas=replicas)
    return values - metric_of(model, clean, metric, batch_size)
