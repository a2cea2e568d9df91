"""The model map: every site where units write, the units, one label grammar, and each unit's write.

Built once per model from the block and mixer protocols (`model_map(model)`), rebuilt when a block is
replaced. Analyses ask it instead of working out the model's structure themselves.

Glossary
    site     one module of one block whose output is a sum of units' writes: a token mixer (attention,
             SSM, delta rule, short conv; Zamba2's shared attention too) or a mixture of experts.
             `layer`, `path` (the module's full name: "blocks.3.attn", "blocks.5.shared.attn",
             "blocks.2.mlp") and `tag`, the label letter of its units
    unit     one part of a site that writes on its own, index i in [0, site.n): an attention head, an SSM
             head, a delta-rule head (d_v channels), a Mamba-1 or short-conv channel (width 1), an expert
    label    "L{layer}{tag}{i}", or "L{layer}{tag}{a}-{b}" for the units a..b of one site (Mamba-1 channel
             groups). tag: "H" a block's own heads (attention, or the SSM heads of a block without
             attention), "M" SSM heads beside attention in one block (Falcon-H1), "SH" a shared attention
             invocation (Zamba2), "C" units one feature wide (Mamba-1, short-conv channels), "E" experts,
             "N" MLP neurons (the cache's neuron stacks). `label` builds one and `parse_label` reads one
             (site.py, with the Site and Unit records; re-exported here): nothing else spells them.
    reads    the hooks a site's writes are computed from (the mixer's `write_reads`; an MoE's chosen ids,
             routing weights and expert outputs): a bare run_with_cache() caches them all
    write    what each unit adds to its module's output [.. pos n d_out], the output projection's bias
             (and an MoE's shared MLP) left out, asked from the module (`unit_writes`: gated attention
             z . sigmoid(gate) . W_O, Mamba-2 its head's columns of out_proj, an expert its routing weight
             x output). `writer` is the block's Writer carrying the module's output into the residual
             (scale, post-norm), None for a side block's module (Zamba2's shared attention writes into
             its step's input, not the residual)
    mixing   a token mixer's unit x target x source matrix (the mixer's `mixing()`): the matrix hook
             (hook_pattern, hook_kernel), the value it mixes and the output it makes; None when the mixer
             has no such form. A site's cut is its module's `cut_edges`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from hooked.models.protocol import ExpertMixture, RecurrentCut, token_mixers
from hooked.models.site import TAGS, Site, Unit, label, label_layer, parse_label

__all__ = ["TAGS", "ModelMap", "Site", "Unit", "label", "label_layer", "model_map", "parse_label"]


def _mixer_tags(model: Any) -> dict[str, str]:
    """{mixer name: label letter} for every TokenMixer of the model: "H" for a block's own heads (attention,
    or the SSM mixer of a block without attention), "M" for SSM units beside attention in the same block
    (Falcon-H1), "SH" for a shared attention invocation (Zamba2); ModelMap gives units one feature wide "C"."""
    tags = {}
    for layer, block in enumerate(model.blocks):
        mixers = token_mixers(block)
        beside_attention = any(m.unit_tag == "H" for _, m in mixers)
        for name, m in mixers:
            tags[f"blocks.{layer}.{name}"] = "H" if m.unit_tag == "M" and not beside_attention else m.unit_tag
    return tags


class ModelMap:
    """Every site of a model in forward order (see the module glossary)."""

    def __init__(self, model: Any) -> None:
        self.sites: list[Site] = []
        tags = _mixer_tags(model)
        for layer, block in enumerate(model.blocks):
            writers = {id(w.module): w for w in block.writers()}
            for name, m in token_mixers(block):
                path = f"blocks.{layer}.{name}"
                own = m.heads()  # the mixer's units and cut hook; placed here
                tag = "C" if own.width == 1 else tags[path]
                self.sites.append(replace(own, layer=layer, path=path, tag=tag, module=m, reads=tuple(m.write_reads()),
                                          writer=writers.get(id(m)), recurrent=isinstance(m, RecurrentCut)))
            for w in block.writers():
                if isinstance(w.module, ExpertMixture):
                    path = w.out_hook.name.rsplit(".", 1)[0] + "." + w.kind
                    self.sites.append(Site(w.module.n_experts, 0, w.module.hook_routing_weights, "expert", None, layer,
                                           path, "E", w.module, tuple(w.module.write_reads()), w))
        self._by_path = {s.path: s for s in self.sites}
        self._by_key = {(s.layer, s.tag): s for s in self.sites}

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def site(self, path: str) -> Site:
        if path not in self._by_path:
            raise ValueError(f"{path!r} is no site of this model; known: {', '.join(list(self._by_path)[:6])}, ...")
        return self._by_path[path]

    def mixers(self) -> list[Site]:
        """The token mixers' sites (no experts), in forward order."""
        return [s for s in self.sites if s.mixes_tokens]

    def layer_sites(self, layer: int) -> list[Site]:
        return [s for s in self.sites if s.layer == layer]

    def unit(self, text: str) -> Unit:
        """The unit(s) a label names, checked against the model."""
        layer, tag, first, last = parse_label(text)
        site = self._by_key.get((layer, tag))
        if site is None:
            raise ValueError(f"unit {text!r}: layer {layer} has no {tag!r} units")
        if last >= site.n:
            raise ValueError(f"unit {text!r}: {site.path} has {site.n} units")
        return Unit(site.label(first, last), layer, site.path, tuple(range(first, last + 1)),
                    "head" if site.mixes_tokens else "expert", site)

    def units(self, group: int | None = None) -> list[Unit]:
        """Every token mixer's units, channels in runs of `group` (Site.units)."""
        return [u for s in self.mixers() for u in s.units(group)]

    def placed(self, units: Iterable[Unit]) -> list[Unit]:
        """`units` carrying this map's sites (a unit made by hand, or from a map before a block was replaced)."""
        return [replace(u, site=self.site(u.module)) for u in units]

    def experts(self) -> list[Unit]:
        return [u for s in self.sites if not s.mixes_tokens for u in s.units()]


_MAPS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], ModelMap]]" = weakref.WeakKeyDictionary()


def model_map(model: Any) -> ModelMap:
    """The model's map, built on first use and rebuilt when one of its blocks (or their mixers) was replaced."""
    key = tuple(id(m) for b in model.blocks for m in (b, *(m for _, m in token_mixers(b))))
    kept = _MAPS.get(model)
    if kept is None or kept[0] != key:
        kept = (key, ModelMap(model))
        _MAPS[model] = kept
    return kept[1]
