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
             "N" MLP neurons (the cache's neuron stacks). `label` builds one and `parse_label` reads one:
             nothing else spells them.
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from hooked.models.protocol import ExpertMixture, HookPoint, Mixing, RecurrentCut, TokenMixer, token_mixers

_LABEL = re.compile(r"L(\d+)(SH|H|M|C|E|N)(\d+)(?:-(\d+))?")
TAGS = ("H", "M", "SH", "C", "E", "N")


def label(layer: int, tag: str, first: int | None = None, last: int | None = None) -> str:
    """The label of unit `first` of the site (layer, tag), of its units first..last, or (first None) the
    prefix the site's labels share ("L3H"; "L3shared" for a mixture's always-on MLP, "L0Hg" for SSM groups)."""
    if first is None:
        return f"L{layer}{tag}"
    if last is None or last == first:
        return f"L{layer}{tag}{first}"
    return f"L{layer}{tag}{first}-{last}"


def parse_label(text: Any) -> tuple[int, str, int, int]:
    """(layer, tag, first, last) of a unit label "L3H5" (last = first) or "L2C0-63"; a ValueError otherwise."""
    m = _LABEL.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"a unit label looks like L3H5, L5SH3, L0M3, L2C7, L2C0-63, L3E5 or L1N7, got {text!r}")
    first = int(m.group(3))
    last = first if m.group(4) is None else int(m.group(4))
    if last < first:
        raise ValueError(f"unit label {text!r}: the range {first}-{last} is empty")
    return int(m.group(1)), m.group(2), first, last


def label_layer(text: str) -> int | None:
    """The layer of any label `label` builds ("L3H5", "L2C0-63", "L0Hg1", "L4shared"), None for another name."""
    digits = text[1:len(text) - len(text[1:].lstrip("0123456789"))]
    rest = text[1 + len(digits):]
    return int(digits) if text.startswith("L") and digits and rest[:1].isalpha() else None


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

    @property
    def recurrent(self) -> bool:
        """A recurrent mixer (SSM, delta rule, short conv): it keeps a state across positions, its mixing
        matrix is a kernel, and its cut is restricted to the units listed (protocol.RecurrentCut)."""
        return isinstance(self.module, RecurrentCut)

    def label(self, first: int, last: int | None = None) -> str:
        return label(self.layer, self.tag, first, last)

    def labels(self) -> list[str]:
        return [self.label(i) for i in range(self.n)]

    def units(self, group: int | None = None) -> list[Unit]:
        """The site's units one by one; units one feature wide (channels) in runs of `group` (default n / 16)."""
        size = 1 if self.width != 1 else (group or max(1, self.n // 16))
        role = "head" if self.mixes_tokens else "expert"
        return [Unit(self.label(a, min(a + size, self.n) - 1), self.layer, self.path,
                     tuple(range(a, min(a + size, self.n))), role, self) for a in range(0, self.n, size)]

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

    @property
    def hook(self) -> str:
        """The hook where a unit's write is cut (hook_z [.. n width], hook_gated [.. n * width]); experts: the
        routing weights [.. top_k], which ablate_experts zeroes."""
        return (self.module.heads().write_hook if self.mixes_tokens else self.module.hook_routing_weights).name

    def cut_mask(self, units: Sequence[int], device: Any = None) -> Tensor:
        """Bool mask over the cut hook's trailing axes selecting `units`: [n 1] when the hook keeps a unit
        axis (hook_z [.. n_heads d_head]), else [n * width] (hook_gated [.. d_inner])."""
        mask = torch.zeros(self.n, dtype=torch.bool, device=device)
        mask[list(units)] = True
        per_unit_axis = len(self.module.heads().write_hook.axes) == 4
        return mask[:, None] if per_unit_axis else mask.repeat_interleave(self.width)

    def mixing(self) -> Mixing | None:
        return self.module.mixing() if self.mixes_tokens else None

    # the names head_layout's records had (analysis.interventions.ablation)
    prefix = property(lambda self: self.path)
    n_heads = property(lambda self: self.n)


@dataclass(frozen=True)
class Unit:
    """Units `heads` of the site at `module`, by its label: one head, a run of channels, or one expert."""

    label: str  # "L3H5", "L5SH3", "L2C0-63", "L3E5" (the grammar above)
    layer: int
    module: str  # the site's path
    heads: tuple[int, ...]  # unit indices inside the site (head, channel or expert ids)
    kind: str = "head"  # "head" (a token mixer's: ablate_heads) or "expert" (ablate_experts)
    site: Site | None = field(default=None, compare=False, repr=False)  # its site; None for a Unit made by hand

    def placed(self) -> Site:
        """Its site, which the analyses given units work on instead of asking the map again."""
        if self.site is None:
            raise ValueError(f"unit {self.label}: made by hand, it carries no site; take units from the model map "
                             "(head_units, expert_units, model_map(model).unit(label))")
        return self.site

    def specs(self) -> list[tuple[str, int]]:
        return [(self.module, h) for h in self.heads]


class ModelMap:
    """Every site of a model in forward order (see the module glossary)."""

    def __init__(self, model: Any) -> None:
        self.sites: list[Site] = []
        tags = _mixer_tags(model)
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
