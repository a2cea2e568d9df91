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
             invocation (Zamba2), "C" units one feature wide (Mamba-1, short-conv channels), "E" experts.
             `label` builds one and `parse_label` reads one: nothing else spells them.
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

import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from hooked.models.protocol import ExpertMixture, HookPoint, TokenMixer, token_mixers, unit_tags

_LABEL = re.compile(r"L(\d+)(SH|H|M|C|E)(\d+)(?:-(\d+))?")
TAGS = ("H", "M", "SH", "C", "E")


def label(layer: int, tag: str, first: int, last: int | None = None) -> str:
    """The label of unit `first` of the site (layer, tag), or of its units first..last."""
    if last is None or last == first:
        return f"L{layer}{tag}{first}"
    return f"L{layer}{tag}{first}-{last}"


def parse_label(text: Any) -> tuple[int, str, int, int]:
    """(layer, tag, first, last) of a unit label "L3H5" (last = first) or "L2C0-63"; a ValueError otherwise."""
    m = _LABEL.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"a unit label looks like L3H5, L5SH3, L0M3, L2C7, L2C0-63 or L3E5, got {text!r}")
    first = int(m.group(3))
    last = first if m.group(4) is None else int(m.group(4))
    if last < first:
        raise ValueError(f"unit label {text!r}: the range {first}-{last} is empty")
    return int(m.group(1)), m.group(2), first, last


@dataclass(frozen=True)
class Site:
    layer: int
    path: str  # the module's full name
    tag: str
    module: nn.Module
    n: int  # units
    width: int  # features per unit at the cut hook (attention: d_head; Mamba-1: 1); experts: 0
    reads: tuple[HookPoint, ...]
    writer: Any  # hooked.models.block.Writer, or None (writes into a side input)

    @property
    def mixes_tokens(self) -> bool:
        return isinstance(self.module, TokenMixer)

    def label(self, first: int, last: int | None = None) -> str:
        return label(self.layer, self.tag, first, last)

    def labels(self) -> list[str]:
        return [self.label(i) for i in range(self.n)]

    def writes(self, *reads: Tensor) -> Tensor:
        """Each unit's write [.. pos n d_out] from the activations at `reads`, asked of the module."""
        return self.module.unit_writes(*reads)

    def writes_from(self, acts: Mapping[str, Tensor]) -> Tensor | None:
        """`writes` from a cache (or any {hook name: tensor}); None when it lacks one of the reads."""
        names = [h.name for h in self.reads]
        if any(n not in acts for n in names):
            return None
        return self.writes(*(acts[n] for n in names))

    def result_hook(self) -> HookPoint | None:
        """The lazy hook showing each unit's write in a forward (hook_result, hook_head_out); None for experts."""
        return self.module.heads().result_hook if self.mixes_tokens else None

    def cut_hook(self) -> HookPoint | None:
        """Where a unit's write is cut, [.. n width] or [.. n * width] (hook_z, hook_gated); None for experts."""
        return self.module.heads().write_hook if self.mixes_tokens else None

    def mixing(self) -> Any:
        return self.module.mixing() if self.mixes_tokens else None


@dataclass(frozen=True)
class Unit:
    """Units first..last of one site (one unit when first == last), by its label."""

    site: Site
    first: int
    last: int

    @property
    def label(self) -> str:
        return self.site.label(self.first, self.last)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.last + 1))


class ModelMap:
    """Every site of a model in forward order (see the module glossary)."""

    def __init__(self, model: Any) -> None:
        self.sites: list[Site] = []
        tags = unit_tags(model)
        for layer, block in enumerate(model.blocks):
            writers = {id(w.module): w for w in block.writers()}
            for name, m in token_mixers(block):
                path = f"blocks.{layer}.{name}"
                heads = m.heads()
                tag = "C" if heads.width == 1 else tags[path]
                self.sites.append(Site(layer, path, tag, m, heads.n, heads.width, tuple(m.write_reads()),
                                       writers.get(id(m))))
            for w in block.writers():
                if isinstance(w.module, ExpertMixture):
                    path = w.out_hook.name.rsplit(".", 1)[0] + "." + w.kind
                    self.sites.append(Site(layer, path, "E", w.module, w.module.n_experts, 0,
                                           tuple(w.module.write_reads()), w))
        self._by_path = {s.path: s for s in self.sites}
        self._by_key = {(s.layer, s.tag): s for s in self.sites}

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def site(self, path: str) -> Site:
        if path not in self._by_path:
            raise ValueError(f"{path!r} is no site of this model; known: {', '.join(list(self._by_path)[:6])}, ...")
        return self._by_path[path]

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
        return Unit(site, first, last)

    def units(self, group: int | None = None) -> list[Unit]:
        """Every token mixer's units, one each; with `group`, channel sites' (tag "C") in runs of `group`."""
        out = []
        for s in self.sites:
            if not s.mixes_tokens:
                continue
            size = group if group is not None and s.tag == "C" else 1
            out += [Unit(s, a, min(a + size, s.n) - 1) for a in range(0, s.n, size)]
        return out

    def experts(self) -> list[Unit]:
        return [Unit(s, e, e) for s in self.sites if not s.mixes_tokens for e in range(s.n)]


_MAPS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], ModelMap]]" = weakref.WeakKeyDictionary()


def model_map(model: Any) -> ModelMap:
    """The model's map, built on first use and rebuilt when one of its blocks (or their mixers) was replaced."""
    key = tuple(id(m) for b in model.blocks for m in (b, *(m for _, m in token_mixers(b))))
    kept = _MAPS.get(model)
    if kept is None or kept[0] != key:
        kept = (key, ModelMap(model))
        _MAPS[model] = kept
    return kept[1]
