"""Neuron scores: MLP hidden neurons and SSM channels, scored by attribution patching and verified exactly.

Glossary
    neuron      one feature of what a sublayer's output projection reads: an MLP's hidden neuron (its
                `mlp.hook_post`, "L{l}N{i}"), a token mixer's channel at the hook where its units' writes are
                cut (the model map's `write_hook`: Mamba-1's channel "L{l}C{i}" at hook_gated, a Mamba-2
                head's channel "L{l}H{h}[c]" at hook_gated; kind "attn": an attention head's hook_z feature)
    site        one hook whose neurons are scored (`NeuronSite`): its units' labels and their width
    kinds       which sites: "mlp" (every block's dense MLP; the neurons of experts are not scored, their
                experts are nodes, nodes.py), "ssm" (every SSM and other recurrent mixer), "attn"
    score       EAP at the neuron: (a^baseline - a^clean) * d metric / d a on the clean run, summed over batch
                and positions (method "eap"); "eap-ig": the gradient averaged over `steps` runs whose token
                embedding is interpolated from the baseline's to clean at integrated.alphas(steps, steps_at).
                The loop is edge_attribution's (attribution.py: prompts of different lengths, `intervention`
                patch / zero / mean with the baseline at the sites (neuron_runs.py), metrics reading the clean
                logits). A site's neuron scores sum to its node's score where the output
                projection is linear in them (an MLP's, a head's: the tests check it)
    verify      `verify_neurons`: clean with every scored neuron outside the kept set set to its baseline
                (hooks on the sites), exact; unscored sites keep their clean computation
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.attribution import attribute, chunks, real, settings_of
from analysis.circuits.baselines import prepare
from analysis.circuits.eap import BATCH_SIZE
from analysis.circuits.graph import graph_of
from analysis.circuits.integrated import STEPS_AT
from analysis.circuits.metrics import at_rows, tail_of, with_clean
from analysis.circuits.neuron_runs import NeuronBaseline, NeuronReader, set_sites
from analysis.circuits.prompts import Prompts, prompts_of
from analysis.circuits.runs import attached, forward_logits
from analysis.circuits.verify import ABLATION, MASK
from hooked.models.model_map import label, model_map
from hooked.models.protocol import ExpertMixture
from hooked.validate import Flag, Integer, OneOf, Seq, checked, metric_name, metric_value

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


def _per_neuron(site: NeuronSite, x: Tensor) -> Tensor:
    """[.. pos features] summed over every axis before the neurons -> [n_units, width] float64."""
    features = len(site.units) * site.width
    return x.reshape(-1, features).double().sum(0).reshape(len(site.units), site.width).cpu()


def _prepared(model: Any, kinds: Sequence[str], clean: Any, corrupt: Any, metric: Metric, intervention: str,
              reference: Any, per_position: bool, batch_size: int | None,
              attention_mask: Any) -> tuple[list[NeuronSite], NeuronReader, Prompts, NeuronBaseline]:
    """(the sites, their reader, the clean prompts, the sites' baseline), every argument checked by name."""
    sites = neuron_sites(model, kinds)
    reader = NeuronReader(model, sites)
    clean, edges = prepare(model, graph_of(model), clean, corrupt, intervention, reference, per_position,
                           batch_size, attention_mask, metric)
    ref = prompts_of(model, reference, None, "reference") if intervention == "mean" else None
    return sites, reader, clean, NeuronBaseline(model, reader, edges, ref, per_position, batch_size)


@checked(method=OneOf("eap", "eap-ig"), steps=Integer(ge=1), kinds=Seq(OneOf(*KINDS)), batch_size=BATCH_SIZE,
         attention_mask=MASK, steps_at=OneOf(*STEPS_AT), **ABLATION)
def neuron_attribution(model: Any, clean: Any, corrupt: Any, metric: Metric, method: str = "eap", steps: int = 5,
                       kinds: Sequence[str] = ("mlp", "ssm"), batch_size: int | None = None,
                       attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
                       per_position: bool = False, steps_at: str = "mid") -> NeuronScores:
    """Every neuron's EAP or EAP-IG score (the glossary), with edge_attribution's arguments (prompts,
    intervention, steps_at, metrics reading the clean logits) and its forwards (attribution.py)."""
    sites, reader, clean, baseline = _prepared(model, kinds, clean, corrupt, metric, intervention, reference,
                                               per_position, batch_size, attention_mask)
    totals = {s.name: torch.zeros(len(s.units), s.width, dtype=torch.float64) for s in sites}
    values = [0.0, 0.0]
    for ch in attribute(model, reader, clean, baseline, metric, method, steps, steps_at, batch_size, None, values):
        for s, g in zip(sites, ch.grads):
            diff = ch.base[s.name].to(g) - ch.run[s.name].to(g)  # pad positions add nothing
            totals[s.name] += ch.weight * _per_neuron(s, real(diff * g, ch.clean.attention_mask))
    settings = settings_of(method, steps, steps_at, intervention, per_position, clean) | {"kinds": list(kinds)}
    return NeuronScores(sites, totals, method, values[0], values[1], settings)


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


@checked(kinds=Seq(OneOf(*KINDS)), batch_size=BATCH_SIZE, attention_mask=MASK, **ABLATION)
def verify_neurons(model: Any, neurons: Iterable[Any], clean: Any, corrupt: Any, metric: Metric,
                   kinds: Sequence[str] = ("mlp", "ssm"), batch_size: int | None = None,
                   attention_mask: Tensor | None = None, intervention: str = "patch", reference: Any = None,
                   per_position: bool = False) -> dict[str, float]:
    """{"circuit", "clean", "corrupt", "faithfulness", "n_neurons", "fraction"}: the metric of clean with every
    neuron of the `kinds` sites outside `neurons` set to its baseline (`intervention`; exact, through hooks);
    "corrupt": the fully ablated run (neuron_runs.py)."""
    sites, reader, clean, baseline = _prepared(model, kinds, clean, corrupt, metric, intervention, reference,
                                               per_position, batch_size, attention_mask)
    keep = _kept(sites, neurons)
    values, name = [0.0, 0.0, 0.0], metric_name(metric)
    for part in chunks(clean.batch, batch_size):
        weight, m, cp = (part.stop - part.start) / clean.batch, at_rows(metric, part), clean.rows(part)
        c_logits, base = baseline.activations(model, part, cp, tail_of(m))
        ablated = baseline.ablated(model, cp, base, c_logits, tail_of(m))
        clean_logits = reader.record(model, cp, tail_of(m))[0]
        bound = with_clean(m, clean_logits)
        with torch.no_grad(), attached(set_sites(sites, keep, base), []):
            value = metric_value(bound(forward_logits(model, cp.tokens, cp.attention_mask, tail_of(m))), name)
        now = [value, metric_value(bound(clean_logits), name), metric_value(bound(ablated), name)]
        values = [a + weight * b for a, b in zip(values, now)]
    circuit, c, x = values
    if c == x:
        raise ValueError("the metric is equal on clean and corrupt: faithfulness is undefined")
    kept = sum(int(k.sum()) for k in keep.values())
    total = sum(k.numel() for k in keep.values())
    return {"circuit": circuit, "clean": c, "corrupt": x, "faithfulness": (circuit - x) / (c - x),
            "n_neurons": kept, "fraction": kept / total}
