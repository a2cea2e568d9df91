"""The unit records: a site (a module whose output is a sum of units' writes), a unit of it, and their labels.

The model map (model_map.py, its glossary) places every site of a model; a mixer describes its own site
(`TokenMixer.heads()`, protocol.py). `label` builds a unit's label and `parse_label` reads one: nothing
else spells them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

HookPoint = Any  # hooked.hook_points.HookPoint (not imported: protocol.py, which the hook engine reads, imports this file)


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



@dataclass(frozen=True)
class Site:
    """A module whose output is a sum of units' writes. A mixer's `heads()` gives its first five fields (its
    units and where each one's write is cut); the model map places it: layer, path, tag, module, reads, writer."""

    n: int  # units
    width: int  # features per unit at the cut hook (attention: d_head; Mamba-1: 1); experts: 0
    write_hook: HookPoint  # where a unit's write is cut (hook_z, hook_gated; experts: hook_routing_weights)
    kind: str  # "attn", "ssm" (a token mixer's units) or "expert"
    result_hook: HookPoint | None = None  # each unit's write after the output projection [.. pos n d_out] (lazy)
    layer: int = -1
    path: str = ""  # the module's full name
    tag: str = ""
    module: Any = None
    reads: tuple[HookPoint, ...] = ()
    writer: Any = None  # hooked.models.block.Writer, or None (writes into a side input)
    recurrent: bool = False  # a recurrent mixer (SSM, delta rule, short conv): it keeps a state across
    #                          positions, its mixing matrix is a kernel, its cut restricted to the units listed

    @property
    def mixes_tokens(self) -> bool:
        return self.kind != "expert"

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

    @property
    def hook(self) -> str:
        """The name of the hook where a unit's write is cut (hook_z [.. n width], hook_gated [.. n * width]);
        experts: the routing weights [.. top_k], which ablate_experts zeroes."""
        return self.write_hook.name

    def cut_mask(self, units: Sequence[int], device: Any = None) -> Tensor:
        """Bool mask over the cut hook's trailing axes selecting `units`: [n 1] when the hook keeps a unit
        axis (hook_z [.. n_heads d_head]), else [n * width] (hook_gated [.. d_inner])."""
        mask = torch.zeros(self.n, dtype=torch.bool, device=device)
        mask[list(units)] = True
        per_unit_axis = len(self.write_hook.axes) == 4
        return mask[:, None] if per_unit_axis else mask.repeat_interleave(self.width)

    def mixing(self) -> Any:  # protocol.Mixing, or None
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
