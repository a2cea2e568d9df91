"""Neuron scores: MLP hidden neurons and SSM channels, scored by attribution patching and verified exactly.

Glossary
    neuron      one feature of what a sublayer's output projection reads: an MLP's hidden neuron (its
                `mlp.hook_post`, "L{l}N{i}"), a token mixer's channel at the hook where its units' writes are
                cut (the model map's `write_hook`: Mamba-1's channel "L{l}C{i}" at hook_gated, a Mamba-2
                head's channel "L{l}H{h}[c]" at hook_gated; kind "attn": an attention head's hook_z feature)
    site        one hook whose neurons are scored (`NeuronSite`): its units' labels and their width
    kinds       which sites: "mlp" (every block's dense MLP; the neurons of experts are not scored, their
                experts are nodes, nodes.py), "ssm" (every SSM and other recurrent mixer), "attn"
    score       EAP at the neuron: (a^corrupt - a^clean) * d metric / d a on the clean run, summed over batch
                and positions (method "eap"); "eap-ig": the gradient averaged over `steps` runs whose token
                embedding is interpolated from corrupt to clean at the midpoints alpha = (k + 1/2) / steps
                (eap.py's EAP-IG). A site's neuron scores sum to its node's score where the output
                projection is linear in them (an MLP's, a head's: the tests check it)
    verify      `verify_neurons`: clean with every scored neuron outside the kept set set to its corrupt
                value (hooks on the sites), exact; unscored sites keep their clean computation
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.eap import BATCH_SIZE, chunks, pair
from analysis.circuits.metrics import at_rows, tail_of
from analysis.circuits.runs import attached, forward_logits
from hooked.models.model_map import label, model_map
from hooked.models.protocol import ExpertMixture
from hooked.validate import Flag, Integer, OneOf, Seq, checked, metric_name, metric_tensor, metric_value

Metric = Callable[[Tensor], Tensor]
KINDS = ("mlp", "ssm", "attn")


@dataclass(frozen=True)
class NeuronSite:
    hook: Any  # the HookPoint whose trailing features are the neurons ([.. n * width] or [.. n width])
    units: tuple[str, ...]  # one label per unit
    width: int  # neurons per unit
    kind: str  # "mlp", "ssm" or "attn"

    @property
    def name(self) -> str:
        return self.hook.name

    def neuron(self, unit: int, channel: int) -> str:
        return self.units[unit] if self.width == 1 else f"{self.units[unit]}[{channel}]"


@dataclass(frozen=True)
class Neuron:
    label: str  # "L1N7", "L0C5", "L1H0[3]"
    hook: str  # its site's hook name
    index: int  # its feature at the hook (unit * width + channel)
    score: float = float("nan")

    def __str__(self) -> str:
        return self.label


def neuron_sites(model: Any, kinds: Sequence[str] = ("mlp", "ssm")) -> list[NeuronSite]:
    """The sites of `kinds` in forward order (the glossary)."""
    sites = []
    for layer, block in enumerate(model.blocks):
        if "mlp" in kinds:
            for w in block.writers():
                hook = getattr(w.module, "hook_post", None)
                if w.kind == "mlp" and hook is not None and not isinstance(w.module, ExpertMixture):
                    n = w.module.dims["d_mlp"]
                    sites.append(NeuronSite(hook, tuple(label(layer, "N", i) for i in range(n)), 1, "mlp"))
        for s in model_map(model).layer_sites(layer):
            if s.mixes_tokens and s.kind in kinds:
                sites.append(NeuronSite(s.write_hook, tuple(s.labels()), s.width, s.kind))
    if not sites:
        raise ValueError(f"kinds: this model has no neuron sites of kinds {tuple(kinds)}")
    return sites


class NeuronScores:
    """Scores of every neuron of the sites: `.scores[hook name]` [n_units, width] float64, `.top(n)` ->
    Neurons, `.units()` {unit label: the sum of its neurons' scores}."""

    def __init__(self, sites: list[NeuronSite], scores: dict[str, Tensor], method: str, clean_metric: float,
                 corrupt_metric: float, settings: dict[str, Any] | None = None) -> None:
        self.sites, self.scores, self.method = sites, scores, method
        self.clean_metric, self.corrupt_metric = clean_metric, corrupt_metric
        self.settings = dict(settings or {})

    def __len__(self) -> int:
        return sum(s.numel() for s in self.scores.values())

    def __repr__(self) -> str:
        return f"NeuronScores({self.method}, {len(self)} neurons in {len(self.sites)} sites, top {self.top(3)})"

    def neurons(self) -> list[Neuron]:
        return [Neuron(site.neuron(u, c), site.name, u * site.width + c, float(self.scores[site.name][u, c]))
                for site in self.sites for u in range(len(site.units)) for c in range(site.width)]

    @checked(n=Integer(ge=0), absolute=Flag())
    def top(self, n: int, absolute: bool = True) -> list[Neuron]:
        """The n neurons of largest |score| (or score), largest first."""
        every = self.neurons()
        flat = torch.tensor([x.score for x in every], dtype=torch.float64)
        order = torch.argsort(flat.abs() if absolute else flat, descending=True, stable=True)[:n]
        return [every[int(i)] for i in order]

    def units(self) -> dict[str, float]:
        """Each unit's neurons summed: {unit label: score}."""
        return {u: float(self.scores[site.name][i].sum()) for site in self.sites for i, u in enumerate(site.units)}


def _grads(model: Any, sites: list[NeuronSite], tokens: Tensor, metric: Metric,
           embed: Callable[[Tensor], Tensor] | None) -> tuple[float, dict[str, Tensor], list[Tensor]]:
    """(metric, the sites' activations, d metric / d activation at every site) of one forward and backward."""
    seen: dict[str, Tensor] = {}

    def leaf(x: Tensor, hook: Any) -> Tensor:  # the graph starts here, whatever the parameters require
        return (embed(x.detach()) if embed is not None else x.detach()).requires_grad_(True)

    def keep(x: Tensor, hook: Any) -> None:
        seen[hook.name] = x

    points = [(model.hook_embed, leaf)] + [(s.hook, keep) for s in sites]
    with torch.enable_grad(), attached(points, []):
        value = metric_tensor(metric(forward_logits(model, tokens, None, tail_of(metric))), metric, grad=True)
        acts = [seen[s.name] for s in sites]
        grads = torch.autograd.grad(value.reshape(()), acts, allow_unused=True)
    grads = [torch.zeros_like(a) if g is None else g.detach() for a, g in zip(acts, grads)]
    return float(value.detach()), {s.name: a.detach() for s, a in zip(sites, acts)}, grads


@torch.no_grad()
def _record(model: Any, sites: list[NeuronSite], tokens: Tensor, metric: Metric) -> tuple[float, dict[str, Tensor]]:
    seen: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: Any) -> None:
        seen[hook.name] = x.detach()

    with attached([(model.hook_embed, keep)] + [(s.hook, keep) for s in sites], []):
        value = metric_value(metric(forward_logits(model, tokens, None, tail_of(metric))), metric_name(metric))
    return value, seen


def _per_neuron(site: NeuronSite, x: Tensor) -> Tensor:
    """[.. pos features] summed over every axis before the neurons -> [n_units, width] float64."""
    features = len(site.units) * site.width
    return x.reshape(-1, features).double().sum(0).reshape(len(site.units), site.width).cpu()


@checked(method=OneOf("eap", "eap-ig"), steps=Integer(ge=1), kinds=Seq(OneOf(*KINDS)), batch_size=BATCH_SIZE)
def neuron_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, method: str = "eap", steps: int = 5,
                       kinds: Sequence[str] = ("mlp", "ssm"), batch_size: int | None = None) -> NeuronScores:
    """Every neuron's EAP or EAP-IG score (the glossary): one corrupt forward, then one forward and backward
    on clean (EAP), or a clean forward and `steps` interpolated ones (EAP-IG), per chunk of `batch_size`."""
    clean, corrupt = pair(model, clean, corrupt)
    sites = neuron_sites(model, kinds)
    totals = {s.name: torch.zeros(len(s.units), s.width, dtype=torch.float64) for s in sites}
    values, n = [0.0, 0.0], clean.shape[0]
    for part in chunks(n, batch_size):
        weight, m = (part.stop - part.start) / n, at_rows(metric, part)
        corr_value, corr = _record(model, sites, corrupt[part], m)
        values[1] += weight * corr_value
        if method == "eap":
            value, cl, grads = _grads(model, sites, clean[part], m, None)
        else:
            value, cl = _record(model, sites, clean[part], m)
            e_corr, grads = corr[model.hook_embed.name], None
            for k in range(steps):
                alpha = (k + 0.5) / steps

                def embed(x: Tensor, alpha: float = alpha) -> Tensor:
                    return e_corr.to(x) + alpha * (x - e_corr.to(x))

                g = [t / steps for t in _grads(model, sites, clean[part], m, embed)[2]]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        values[0] += weight * value
        for s, g in zip(sites, grads):
            totals[s.name] += weight * _per_neuron(s, (corr[s.name] - cl[s.name]).to(g) * g)
    return NeuronScores(sites, totals, method, values[0], values[1],
                        {"method": method, "steps": steps if method == "eap-ig" else None, "kinds": list(kinds)})


def _kept(sites: list[NeuronSite], neurons: Iterable[Any]) -> dict[str, Tensor]:
    """{site hook name: bool [features]} of the kept neurons (Neurons, or their labels)."""
    by_label = {site.neuron(u, c): (site.name, u * site.width + c)
                for site in sites for u in range(len(site.units)) for c in range(site.width)}
    keep = {s.name: torch.zeros(len(s.units) * s.width, dtype=torch.bool) for s in sites}
    for x in neurons:
        key = x.label if isinstance(x, Neuron) else x
        if not isinstance(key, str) or key not in by_label:
            raise ValueError(f"neurons: {x!r} is no neuron of the scored sites (labels such as "
                             f"{', '.join(list(by_label)[:3])})")
        name, i = by_label[key]
        keep[name][i] = True
    return keep


@checked(kinds=Seq(OneOf(*KINDS)), batch_size=BATCH_SIZE)
def verify_neurons(model: Any, neurons: Iterable[Any], clean: Any, corrupt: Any, metric: Metric,
                   kinds: Sequence[str] = ("mlp", "ssm"), batch_size: int | None = None) -> dict[str, float]:
    """{"circuit", "clean", "corrupt", "faithfulness", "n_neurons", "fraction"}: the metric of clean with every
    neuron of the `kinds` sites outside `neurons` set to its corrupt value (exact, through hooks)."""
    clean, corrupt = pair(model, clean, corrupt)
    sites = neuron_sites(model, kinds)
    keep = _kept(sites, neurons)
    values, n = [0.0, 0.0, 0.0], clean.shape[0]
    for part in chunks(n, batch_size):
        weight, m = (part.stop - part.start) / n, at_rows(metric, part)
        corr_value, corr = _record(model, sites, corrupt[part], m)
        clean_value, _ = _record(model, sites, clean[part], m)

        def patch(x: Tensor, hook: Any) -> Tensor:
            mask = keep[hook.name].to(x.device)
            flat = x.reshape(*x.shape[:2], -1)
            return torch.where(mask, flat, corr[hook.name].reshape(flat.shape).to(x)).reshape(x.shape)

        with torch.no_grad(), attached([(s.hook, patch) for s in sites], []):
            value = metric_value(m(forward_logits(model, clean[part], None, tail_of(m))), metric_name(metric))
        values = [values[0] + weight * value, values[1] + weight * clean_value, values[2] + weight * corr_value]
    circuit, c, x = values
    if c == x:
        raise ValueError("the metric is equal on clean and corrupt: faithfulness is undefined")
    kept = sum(int(k.sum()) for k in keep.values())
    total = sum(k.numel() for k in keep.values())
    return {"circuit": circuit, "clean": c, "corrupt": x, "faithfulness": (circuit - x) / (c - x),
            "n_neurons": kept, "fraction": kept / total}
