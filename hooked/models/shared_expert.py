"""A shared expert with a sigmoid gate (Qwen3-Next, Qwen3.5-MoE): the MoE's always-on MLP, scaled per token.

    out = sigmoid(out_gate(x)) * down_proj(act(gate_proj(x)) * up_proj(x))

Hooks, under blocks.{l}.mlp.shared. (moe.py's `shared`): the gated MLP's (mlp.py), and
    hook_out_gate [batch pos 1]   out_gate(x), before the sigmoid
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.mlp import GatedMLP


class SigmoidGatedMLP(GatedMLP):
    """mlp.py's GatedMLP (no biases) times a per-token sigmoid gate `out_gate` (d_model -> 1)."""

    def __init__(self, d_model: int, d_mlp: int, act_fn: str) -> None:
        super().__init__(d_model, d_mlp, act_fn)
        self.out_gate = nn.Linear(d_model, 1, bias=False)
        self.hook_out_gate = HookPoint("batch pos 1")

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Any = None) -> Float[Tensor, "batch pos d_model"]:
        out_gate = self.hook_out_gate(self.out_gate(x))
        return torch.sigmoid(out_gate) * super().forward(x, ctx)

    def input_linears(self) -> list[nn.Module]:
        return [*super().input_linears(), self.out_gate]

    def output_bias(self) -> Tensor | None:
        return None  # no biases; the gate scales whatever the MLP writes
