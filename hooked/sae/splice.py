"""SAESplice: an SAE run on one hook point's activation, its output spliced back into the forward.

Glossary
    x           the hook point's activation after its own hooks, [batch pos *rest]
    slice       the trailing axes of x the SAE reads: the shortest tail of `rest` whose size is the
                SAE's d_in. The whole [n_heads d_head] of hook_z (d_in = n_heads*d_head) is one slice;
                with d_in = d_head each head is a slice, encoded and decoded on its own (the per-head
                SAEs of SAELens's hook_z, and of Mamba-2's hook_h with d_in = d_head*d_state)
    lead        the axes before the slice ([batch pos] or [batch pos n_heads])
    acts        the SAE's feature activations, [*lead d_sae]
    recons      decode(acts), x's shape
    error       x - recons of the unedited SAE (use_error_term=True)

Hook points, under `{hook}.sae.` (a tap of the hook point: hook_points.py):
    hook_sae_input      [*lead d_sae_in]  the slice the SAE reads
    hook_sae_acts_post  [*lead d_sae]     the features (edit them to ablate or steer a feature)
    hook_sae_recons     x's axes          decode(acts)
    hook_sae_error      x's axes          x - recons (only with use_error_term=True)
    hook_sae_output     x's axes          what replaces x: recons, or recons + error (x outside `positions` / `head`)

use_error_term=False replaces x by the reconstruction (the model runs through the SAE; gradients
go through the SAE). use_error_term=True keeps the model exact: with no edit at the SAE's hook
points the output is x itself (the same tensor: logits bit-identical), and an edit changes x by
what the edit changes in recons (out = recons' + error). The SAE then reads a detached x, so the
gradient of the model is the model's own (identity through the splice) and the features' gradient
is d metric / d out through the decoder, as in SAELens's error-term runs.

`positions` (ints, negatives from the end, or a bool mask [pos] / [batch pos]) keeps x at the other
positions; the SAE is still run there (its hook points show every position). On an SSM state
(hook_h) the spliced value is what the recurrence continues from, so a splice at position t
changes every later position and none before (the models' through_hook). `head` (SAELens's
hook_head_index) keeps x outside that head when the slice is one head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hooked.hook_points import HookPoint, is_recording, through_hook
from hooked.validate import Flag, check, check_positions, head_index, position_mask


def sae_hook_name(sae: Any) -> str | None:
    """The hook an SAE was trained on, from its metadata (SAELens 6: cfg.metadata.hook_name; older: cfg.hook_name)."""
    cfg = getattr(sae, "cfg", None)
    for owner in (getattr(cfg, "metadata", None), cfg, sae):
        name = getattr(owner, "hook_name", None)
        if isinstance(name, str):
            return name
    return None


def _head_index(sae: Any) -> int | None:
    cfg = getattr(sae, "cfg", None)
    for owner in (getattr(cfg, "metadata", None), cfg):
        head = getattr(owner, "hook_head_index", None)
        if head is not None:
            return int(head)
    return None


def sae_sizes(sae: Any) -> tuple[int, int]:
    """(d_in, d_sae) from the SAE's config, attributes or weights (W_enc [d_in d_sae], W_dec [d_sae d_in])."""
    cfg = getattr(sae, "cfg", None)
    sizes = []
    for word, weight, axis in (("d_in", "W_enc", 0), ("d_sae", "W_dec", 0)):
        value = getattr(cfg, word, None) or getattr(sae, word, None)
        if value is None and torch.is_tensor(getattr(sae, weight, None)):
            value = getattr(sae, weight).shape[axis]
        if value is None:
            raise ValueError(f"cannot tell the SAE's {word}: give it a cfg.{word}, a {word} attribute or {weight}")
        sizes.append(int(value))
    return sizes[0], sizes[1]


def _slice_start(point: HookPoint, d_in: int) -> int:
    """Index of the first axis of the slice: the shortest tail of x's axes (after batch pos) of size d_in."""
    if len(point.axes) < 3 or point.axes[1] != "pos":
        raise ValueError(f"an SAE needs a [batch pos ...] hook; {point.name!r} is [{' '.join(point.axes)}]")
    shape = point.shape(1, 1)
    for start in range(len(shape) - 1, 1, -1):
        if math.prod(shape[start:]) == d_in:
            return start
    tails = {" ".join(point.axes[s:]): math.prod(shape[s:]) for s in range(2, len(shape))}
    raise ValueError(f"the SAE's d_in={d_in} fits no trailing axes of {point.name!r} "
                     f"[{' '.join(point.axes)}]: sizes {tails}")


class SAESplice(nn.Module):
    """Runs `sae` (SAELens `SAE`, or any module with encode/decode) on `point`'s activation (see module doc)."""

    def __init__(self, sae: Any, point: HookPoint, use_error_term: bool = False,
                 positions: Sequence[int] | Tensor | None = None, head: int | None = None) -> None:
        super().__init__()
        for method in ("encode", "decode"):
            if not callable(getattr(sae, method, None)):
                raise TypeError(f"an SAE needs encode() and decode(); {type(sae).__name__} has no {method}()")
        if point.element == "int64":
            raise ValueError(f"add_sae: hook_name={point.name!r} holds int64 indices (e.g. expert ids), not "
                             "activations: an SAE reads a floating-point activation")
        self.__dict__["module"] = sae  # not a submodule: its parameters stay out of the model's
        self.d_in, self.d_sae = sae_sizes(sae)
        self.start = _slice_start(point, self.d_in)
        self.use_error_term = check(use_error_term, "add_sae: use_error_term", Flag())
        self.positions = check_positions(positions, "add_sae: positions")  # their range: at the forward
        self.head = _head_index(sae) if head is None else head
        if self.head is not None and (self.start != 3 or point.axes[2] not in ("n_heads", "n_kv_heads", "d_inner")):
            raise ValueError(f"hook_head_index={self.head} needs an SAE of one head's size on a head-indexed hook; "
                             f"{point.name!r} is [{' '.join(point.axes)}] and the SAE reads [{' '.join(point.axes[self.start:])}]")
        if self.head is not None:
            self.head = head_index(self.head, point.shape(1, 1)[2], "add_sae: head")
        self.dims = {"d_sae": self.d_sae, "d_sae_in": self.d_in}
        lead = " ".join(point.axes[:self.start])
        axes = " ".join(point.axes)
        self.hook_sae_input = HookPoint(f"{lead} d_sae_in", lazy=point.lazy, element="wide")
        self.hook_sae_acts_post = HookPoint(f"{lead} d_sae", lazy=point.lazy, element="wide")
        self.hook_sae_recons = HookPoint(axes, lazy=point.lazy, element=point.element)
        self.hook_sae_error = HookPoint(axes, lazy=point.lazy, element=point.element)
        self.hook_sae_output = HookPoint(axes, lazy=point.lazy, element=point.element)

    @property
    def sae(self) -> Any:
        return self.__dict__["module"]

    @property
    def is_active(self) -> bool:
        """An error-term splice with nothing listening at its points is the identity: the hook point
        then stays inactive (lazy quantities are not built for it)."""
        if not self.use_error_term:
            return True
        points = (self.hook_sae_input, self.hook_sae_acts_post, self.hook_sae_recons, self.hook_sae_error,
                  self.hook_sae_output)
        return any(p.is_active for p in points)

    # ------------------------------------------------------------------------------------------- forward
    def _device(self) -> tuple[torch.device | None, torch.dtype | None]:
        p = next(iter(getattr(self.sae, "parameters", lambda: iter(()))()), None)
        return (p.device, p.dtype) if p is not None else (None, None)

    def _encode(self, flat: Tensor, shape: torch.Size) -> Tensor:
        device, dtype = self._device()
        sae_in = flat.to(device=device or flat.device, dtype=dtype or flat.dtype)
        if getattr(self.sae, "hook_z_reshaping_mode", False):  # SAELens flattens [.. n_heads d_head] itself
            sae_in = sae_in.unflatten(-1, (-1, shape[-1]))
        return self.sae.encode(sae_in)

    def _decode(self, acts: Tensor, like: Tensor) -> Tensor:
        return self.sae.decode(acts).reshape(like.shape).to(device=like.device, dtype=like.dtype)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(*x.shape[:self.start], self.d_in)
        if self.use_error_term:
            flat = flat.detach()
        sae_in, in_was = through_hook(self.hook_sae_input, flat)
        acts = self._encode(sae_in, x.shape)
        if self.use_error_term and torch.is_grad_enabled() and not acts.requires_grad:
            acts = acts.detach().requires_grad_()  # so that backward hooks on the features see a gradient
        acts, acts_was = through_hook(self.hook_sae_acts_post, acts, lambda: self._encode(sae_in, x.shape))
        recons, recons_was = through_hook(self.hook_sae_recons, self._decode(acts, x), lambda: self._decode(acts, x))
        if not self.use_error_term:
            return self.hook_sae_output(self._keep_outside(recons, x))
        edited = in_was is not None or acts_was is not None or recons_was is not None
        with torch.no_grad():
            clean = self._decode(self._encode(flat, x.shape), x) if edited else recons.detach()
        error, error_was = through_hook(self.hook_sae_error, x - clean, lambda: x - clean)
        if not edited and error_was is None:
            out = x if not acts.requires_grad else x + (recons - recons.detach())  # exactly x; the features get gradients
        else:
            out = recons + error
        return self.hook_sae_output(self._keep_outside(out, x))

    def _keep_outside(self, out: Tensor, x: Tensor) -> Tensor:
        """x where the splice does not apply (other positions, other heads); `out` elsewhere."""
        if out is x or (self.positions is None and self.head is None) or is_recording():
            return out
        keep = torch.ones(x.shape[:3] if self.head is not None else x.shape[:2], dtype=torch.bool, device=x.device)
        if self.positions is not None:
            keep = keep & self._position_mask(x.shape[0], x.shape[1], x.device).reshape(
                (x.shape[0], x.shape[1]) + (1,) * (keep.ndim - 2))
        if self.head is not None:
            heads = torch.zeros(x.shape[2], dtype=torch.bool, device=x.device)
            heads[self.head] = True
            keep = keep & heads
        return torch.where(keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim)), out, x)

    def _position_mask(self, batch: int, pos: int, device: torch.device) -> Tensor:
        return position_mask(self.positions, batch, pos, device, "add_sae: positions")

    def extra_repr(self) -> str:
        where = [] if self.positions is None else [f"positions={self.positions}"]
        where += [] if self.head is None else [f"head={self.head}"]
        return ", ".join([f"{type(self.sae).__name__}", f"d_in={self.d_in}", f"d_sae={self.d_sae}",
                          f"use_error_term={self.use_error_term}", *where])
