"""One chunked attribution run for every estimate: edges (eap.py), position edges (positions.py), neurons.

Glossary
    reader      where a run's activations are read and its gradients taken: `GraphReader` (the graph's
                senders and receivers, runs.record / runs.gradients: edges and position edges) or
                neuron_runs.NeuronReader (the neuron sites). A reader records a run (logits, activations),
                takes one gradient run (value, activations, gradients) with the token embedding (hook_embed)
                replaced by `embed(x)`, adds gradients up and names a run's token embedding.
    baseline    what an ablated activation carries (baselines.py; the neuron sites': neuron_runs.py):
                `activations(model, part, clean_chunk, tail)` -> (the corrupt logits or None, the chunk's
                baseline), `ablated(...)` -> the fully ablated run's logits (EdgeScores' `corrupt_metric`)
    Chunk       one slice of the prompts (batch_size=), trimmed to its longest prompt: its weight (share of
                the prompts), the metric for its rows (`metric`, and `bound`: its one-argument form, reading
                the clean logits of this chunk when it reads them, metrics.py), the clean prompts, the
                baseline and clean activations (`base`, `run`), the method's gradients (`grads`) and the
                clean logits. Each entry point multiplies these into its own scores (its "score product")
    run         `attribute(...)` yields one Chunk per slice, in order, and after each adds the chunk's metric
                values (clean, fully ablated) weighted by its share and closes the token-edge gradients of
                the chunk; `values` holds the weighted sums when the loop is done
    methods     "eap": the baseline recorded, the fully ablated run (zero, mean: one patched forward; patch:
                the corrupt run itself), one forward and backward on clean (its own logits are the clean
                logits). "eap-ig": the clean run recorded, then `steps` gradient runs whose token embedding
                goes from the baseline's to clean at integrated.alphas(steps, steps_at) (and one more clean
                gradient run for token edges). "eap-ig-activations": the clean run recorded, no gradients
                here (integrated.activation_ig takes them). "clean-corrupted": nothing run here
                (integrated.clean_corrupted runs both ends and sets the chunk's values)
    positions   the padded batch's columns (prompts.py: left padding, so prompt b's own position p is column
                p + width - length_b); a chunk trimmed to w columns holds the last w of them
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from analysis.circuits.graph import Graph
from analysis.circuits.integrated import alphas
from analysis.circuits.metrics import WithClean, at_rows, tail_of, with_clean
from analysis.circuits.prompts import Prompts
from analysis.circuits.runs import gradients, record
from hooked.validate import metric_name, metric_value

Metric = Callable[..., Tensor]


def chunks(n: int, batch_size: int | None) -> list[slice]:
    """Slices of `batch_size` prompts (checked at the entry points: an integer >= 1 or None, all at once)."""
    size = n if batch_size is None else batch_size
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


class GraphReader:
    """The graph's senders and receivers (runs.py): activations are runs.Activations, gradients runs.Grads
    (pending: a runs.ReceiverGrads, pulled when the product asks)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def record(self, model: Any, x: Prompts, tail: int | None) -> tuple[Tensor, Any]:
        return record(model, self.graph, x.tokens, x.attention_mask, tail=tail)

    def gradients(self, model: Any, x: Prompts, metric: Metric, embed: Any = None, token: Any = None,
                  pending: bool = False) -> tuple[float, Any, Any]:
        return gradients(model, self.graph, x.tokens, metric, x.attention_mask, embed=embed, token=token,
                         pending=pending)

    @staticmethod
    def embedding(acts: Any) -> Tensor:
        return acts.emb[0]

    @staticmethod
    def add(total: Any, grads: Any, scale: float) -> Any:
        g, ge = grads[0].mul_(scale), [None if e is None else e * scale for e in grads[1]]
        if total is None:
            return g, ge
        return total[0].add_(g), [None if a is None else a + e for a, e in zip(total[1], ge)]


def integrated(model: Any, reader: Any, clean: Prompts, base: Any, metric: Metric, steps: int,
               steps_at: str) -> Any:
    """The reader's gradients averaged over runs whose token embedding is interpolated from the baseline's
    to the clean one at integrated.alphas(steps, steps_at) (EAP-IG)."""
    e_base = reader.embedding(base)
    total = None
    for alpha in alphas(steps, steps_at):

        def embed(x: Tensor, alpha: float = alpha) -> Tensor:
            return e_base.to(x) + alpha * (x - e_base.to(x))

        total = reader.add(total, reader.gradients(model, clean, metric, embed=embed)[2], 1.0 / steps)
    return total


@dataclass
class Chunk:
    part: slice
    weight: float
    metric: Metric  # the metric for these rows (at_rows)
    clean: Prompts
    bound: Callable[[Tensor], Tensor] | None = None  # its one-argument form on this chunk (metrics.with_clean)
    base: Any = None  # the baseline's activations
    run: Any = None  # the clean run's activations
    grads: Any = None
    clean_logits: Tensor | None = None
    value: float = 0.0  # the metric on clean
    ablated: float = 0.0  # the metric of the fully ablated run
    extra: dict[str, Any] = field(default_factory=dict)


def attribute(model: Any, reader: Any, clean: Prompts, baseline: Any, metric: Metric, method: str, steps: int,
              steps_at: str, batch_size: int | None, token: Any = None,
              values: list[float] | None = None) -> Iterator[Chunk]:
    """The chunks of one attribution run (see the glossary); `values` ([clean, ablated], filled in place)."""
    values = [0.0, 0.0] if values is None else values
    n, name = clean.batch, metric_name(metric)
    for part in chunks(n, batch_size):
        chunk = Chunk(part, (part.stop - part.start) / n, at_rows(metric, part), clean.rows(part))
        m, cp, tail = chunk.metric, chunk.clean, tail_of(chunk.metric)
        if method != "clean-corrupted":
            c_logits, chunk.base = baseline.activations(model, part, cp, tail=tail)
            # first: a patched run (zero, mean) resets the norm sites that pending gradients read
            ablated = baseline.ablated(model, cp, chunk.base, c_logits, tail=tail)
            if method == "eap":
                bound = with_clean(m)  # a metric reading the clean logits gets this run's own
                chunk.value, chunk.run, chunk.grads = reader.gradients(model, cp, bound, token=token, pending=True)
                chunk.clean_logits = bound.clean if isinstance(bound, WithClean) else None
            else:
                chunk.clean_logits, chunk.run = reader.record(model, cp, tail)
            chunk.bound = with_clean(m, chunk.clean_logits)
            chunk.ablated = metric_value(chunk.bound(ablated), name)
            if method != "eap":
                chunk.value = metric_value(chunk.bound(chunk.clean_logits), name)
            if method == "eap-ig":
                chunk.grads = integrated(model, reader, cp, chunk.base, chunk.bound, steps, steps_at)
                if token is not None:  # token edges estimate a cut of the clean run: their own clean gradients
                    reader.gradients(model, cp, chunk.bound, token=token)
        yield chunk
        values[0] += chunk.weight * chunk.value
        values[1] += chunk.weight * chunk.ablated
        if token is not None:
            token.close_chunk(chunk.weight)


def settings_of(method: str, steps: int, steps_at: str, intervention: str, per_position: bool,
                clean: Prompts) -> dict[str, Any]:
    """What produced a set of scores (EdgeScores.settings and its siblings)."""
    settings: dict[str, Any] = {"method": method, "intervention": intervention}
    if method in ("eap-ig", "eap-ig-activations"):
        settings.update(steps=steps, steps_at=steps_at)
    if intervention == "mean":
        settings["per_position"] = per_position
    if clean.padded:  # prompts of different lengths
        settings["lengths"] = clean.lengths.tolist()
    return settings


def real(x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """x [... batch pos features] with every pad position set to 0 (prompts.py: pad positions add nothing)."""
    if attention_mask is None:
        return x
    return x.masked_fill(~attention_mask.to(x.device)[:, :, None], 0.0)
