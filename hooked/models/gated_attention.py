"""Gated attention (Qwen3-Next, Qwen3.5): each head's output times sigmoid of a gate projection of the input.

    z_h   = pattern_h @ v              hook_z (attention.py)
    gate  = gate_proj(x)               hook_gate [batch pos n_heads d_head], before the sigmoid
    out   = o_proj(z * sigmoid(gate))  hook_result holds each head's gated write

HF fuses the gate into q_proj ([query_h | gate_h] per head, 2 d_head rows each); the loader splits
those rows into q_proj and gate_proj, so every other part is attention.py's. Zeroing a head's z still
zeroes its write (the gate multiplies it). A head's write from a cache is o_proj's columns times
z * sigmoid(gate) (`write_reads` names both hooks, `unit_inputs` gates), never z alone.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention


class GatedAttention(Attention):
    """attention.py's Attention with a sigmoid output gate per head and channel (same arguments)."""

    def __init__(self, d_in: int, n_heads: int, n_kv_heads: int, d_head: int, **kwargs) -> None:
        super().__init__(d_in, n_heads, n_kv_heads, d_head, **kwargs)
        self.gate_proj = nn.Linear(d_in, n_heads * d_head, bias=self.q_proj.bias is not None)
        self.hook_gate = HookPoint("batch pos n_heads d_head")

    def gate_heads(self, z: Float[Tensor, "batch pos n_heads d_head"],
                   x: Float[Tensor, "batch pos d_in"]) -> Float[Tensor, "batch pos n_heads d_head"]:
        gate = rearrange(self.gate_proj(x), "batch pos (n_heads d_head) -> batch pos n_heads d_head", d_head=self.d_head)
        gate = self.hook_gate(gate)
        return self.unit_inputs(z, gate)

    def write_reads(self) -> tuple[HookPoint, ...]:
        """A head's write needs its gate too: hook_z and hook_gate (both in a bare cache)."""
        return (self.hook_z, self.hook_gate)

    def unit_inputs(self, z: Float[Tensor, "*batch pos n_heads d_head"],
                    gate: Float[Tensor, "*batch pos n_heads d_head"]) -> Float[Tensor, "*batch pos n_heads d_head"]:
        """What each head gives o_proj: z times the sigmoid of its gate."""
        return z * torch.sigmoid(gate)

    def input_linears(self) -> list[nn.Module]:
        return [*super().input_linears(), self.gate_proj]
