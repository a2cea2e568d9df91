"""The runs neuron scores read (neurons.py): the sites' activations and gradients, and their baselines.

Glossary
    NeuronReader    attribution.py's reader for neuron sites: a run records every site's activation (and the
                    token embedding, hook_embed) as {hook name: [batch pos features]} (features: the site's
                    units x width, flattened); a gradient run also gives d metric / d activation at every site
    NeuronBaseline  what an ablated neuron carries (baselines.py's interventions at the sites): "patch" the
                    corrupt run's activation, "zero" 0, "mean" the reference's mean over prompts and real
                    positions ([1 1 features]) or per position ([1 pos features]). The fully ablated run
                    (`ablated`: the far end of faithfulness, NeuronScores' corrupt_metric) is the graph's:
                    the corrupt run for patch, the run with every edge at the baseline for zero and mean
                    (baselines.Baseline.ablated), so verify_neurons and verify_circuit share their ends.
    set_sites       hooks that set the sites' neurons outside `keep` to a baseline's (exact, verify_neurons)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.baselines import Baseline, real_means
from analysis.circuits.metrics import tail_of
from analysis.circuits.prompts import Prompts
from analysis.circuits.runs import attached, forward_logits
from hooked.validate import metric_tensor

Metric = Callable[[Tensor], Tensor]


def flat(x: Tensor) -> Tensor:
    """[batch pos ...] -> [batch pos features]."""
    return x.reshape(*x.shape[:2], -1)


class NeuronReader:
    """Records and gradient runs at the neuron sites (see the glossary)."""

    def __init__(self, model: Any, sites: list[Any]) -> None:
        self.sites, self.embed = sites, model.hook_embed.name

    def record(self, model: Any, x: Prompts, tail: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        seen: dict[str, Tensor] = {}

        def keep(t: Tensor, hook: Any) -> None:
            seen[hook.name] = flat(t.detach())

        with torch.no_grad(), attached([(model.hook_embed, keep)] + [(s.hook, keep) for s in self.sites], []):
            logits = forward_logits(model, x.tokens, x.attention_mask, tail)
        return logits, seen

    def gradients(self, model: Any, x: Prompts, metric: Metric, embed: Any = None, token: Any = None,
                  pending: bool = False) -> tuple[float, dict[str, Tensor], list[Tensor]]:
        """(metric, the sites' activations, d metric / d activation at every site) of one forward and backward."""
        if token is not None:
            raise ValueError("neuron scores take no token edges")
        seen: dict[str, Tensor] = {}

        def leaf(t: Tensor, hook: Any) -> Tensor:  # the graph starts here, whatever the parameters require
            seen[hook.name] = flat(t.detach())
            return (embed(t.detach()) if embed is not None else t.detach()).requires_grad_(True)

        def keep(t: Tensor, hook: Any) -> None:
            seen[hook.name] = t

        points = [(model.hook_embed, leaf)] + [(s.hook, keep) for s in self.sites]
        with torch.enable_grad(), attached(points, []):
            logits = forward_logits(model, x.tokens, x.attention_mask, tail_of(metric))
            value = metric_tensor(metric(logits), metric, grad=True)
            acts = [seen[s.name] for s in self.sites]
            grads = torch.autograd.grad(value.reshape(()), acts, allow_unused=True)
        grads = [flat(torch.zeros_like(a) if g is None else g.detach()) for a, g in zip(acts, grads)]
        out = {s.name: flat(a.detach()) for s, a in zip(self.sites, acts)} | {self.embed: seen[self.embed]}
        return float(value.detach()), out, grads

    def embedding(self, acts: dict[str, Tensor]) -> Tensor:
        return acts[self.embed]

    @staticmethod
    def add(total: list[Tensor] | None, grads: list[Tensor], scale: float) -> list[Tensor]:
        g = [t * scale for t in grads]
        return g if total is None else [a + b for a, b in zip(total, g)]


class NeuronBaseline:
    """One intervention at the neuron sites (see the glossary); `edges`: the graph's Baseline of the same
    intervention (its corrupt prompts, and the fully ablated run)."""

    def __init__(self, model: Any, reader: NeuronReader, edges: Baseline, reference: Prompts | None = None,
                 per_position: bool = False, batch_size: int | None = None) -> None:
        self.reader, self.edges, self.kind = reader, edges, edges.kind
        self.means: dict[str, Tensor] | None = None
        if self.kind == "mean":
            names = [s.name for s in reader.sites] + [reader.embed]
            values = real_means(model, reference, per_position, batch_size,
                                lambda r: [reader.record(model, r, None)[1][k] for k in names])
            self.means = dict(zip(names, values))

    def activations(self, model: Any, part: slice, clean: Prompts,
                    tail: int | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
        """(the corrupt logits or None, each site's baseline: [batch pos features], or broadcast [1 1|pos ...])."""
        if self.kind == "patch":
            return self.reader.record(model, self.edges.corrupt.rows(part), tail)
        if self.kind == "mean":
            return None, self.means
        like = next(model.parameters())
        names = [s.name for s in self.reader.sites] + [self.reader.embed]
        return None, {k: like.new_zeros(()) for k in names}  # broadcast against every site

    def ablated(self, model: Any, clean: Prompts, acts: Any, corrupt_logits: Tensor | None,
                tail: int | None = None) -> Tensor:
        """The fully ablated run's logits (the graph's: see the glossary)."""
        if corrupt_logits is not None:
            return corrupt_logits
        _, everything = self.edges.activations(model, slice(0, clean.batch), clean)
        return self.edges.ablated(model, clean, everything, None, tail=tail)


def set_sites(sites: list[Any], keep: dict[str, Tensor], base: dict[str, Tensor]) -> list[tuple[Any, Callable]]:
    """Hooks setting every site's neurons outside keep[name] (bool [features]) to base[name]."""

    def patch(x: Tensor, hook: Any) -> Tensor:  # a baseline of [1 1|pos features] or a scalar broadcasts
        return torch.where(keep[hook.name].to(x.device), flat(x), base[hook.name].to(x)).reshape(x.shape)

    return [(s.hook, patch) for s in sites]
