"""Soft-capping: cap * tanh(x / cap), a smooth clamp of logits into (-cap, cap) (Gemma 2).

Glossary
    cap        the bound (HF `attn_logit_softcapping` for attention scores, `final_logit_softcapping`
               for the output logits); the map is ~identity for |x| << cap and saturates beyond it

Hooks, under the owner's `softcap.` (`blocks.{l}.attn.softcap.`, `unembed.softcap.`):
    hook_in    [*shape]  the values before the cap
    hook_out   [*shape]  cap * tanh(in / cap)

Attention caps the scaled scores before the mask: `attn.softcap.hook_out` still holds the future
and padding entries, `attn.hook_attn_scores` is the capped score with the mask applied (what the
softmax reads, the entry knockout edits). The operations are HF's, in HF's order (divide, tanh,
multiply), in the activations' dtype.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint


class SoftCap(nn.Module):
    def __init__(self, cap: float, axes: str) -> None:
        """`axes`: those of what is capped (the owner's scores or logits)."""
        super().__init__()
        if not cap > 0:
            raise ValueError(f"a soft-cap must be positive, got {cap}")
        self.cap = float(cap)
        self.hook_in = HookPoint(axes)
        self.hook_out = HookPoint(axes)

    def forward(self, x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        x = self.hook_in(x)
        out = torch.tanh(x / self.cap) * self.cap
        out = self.hook_out(out)
        return out

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}"
