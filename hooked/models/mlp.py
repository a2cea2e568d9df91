"""The feed-forward half of a transformer block: a plain MLP (GPT-2) and a gated MLP (Llama).

Glossary
    d_model     residual width (input and output of the MLP)
    d_mlp       hidden width (HF `n_inner` / `intermediate_size`)
    act_fn      activation name as HF configs spell it (`ACTIVATIONS` below)
    up_proj     d_model -> d_mlp (GPT-2 `c_fc`; Llama `up_proj`, the linear branch)
    gate_proj   d_model -> d_mlp, the branch that goes through the activation (gated MLP only)
    down_proj   d_mlp -> d_model (GPT-2 `mlp.c_proj`; Llama `down_proj`)

Hooks, under `blocks.{l}.mlp.`:
    hook_pre         [batch pos d_mlp]  MLP: up_proj(x), before the activation;
                                        gated: gate_proj(x), before the activation
    hook_pre_linear  [batch pos d_mlp]  gated only: up_proj(x)
    hook_post        [batch pos d_mlp]  MLP: act(pre); gated: act(pre) * pre_linear
"""

from __future__ import annotations

from typing import Any

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.weights import MLPWeights


def gelu_new(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """GPT-2's tanh approximation of GELU, written as HF's `NewGELUActivation` writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """The same approximation through PyTorch's kernel (HF `gelu_pytorch_tanh`)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (NemotronH)
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function HF configs call `name`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(MLPWeights, nn.Module):
    """down_proj(act(up_proj(x))), as in GPT-2."""

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, bias: bool = True) -> None:
        super().__init__()
        self.act_fn = act_fn
        self.act = activation(act_fn)
        self.up_proj = nn.Linear(d_model, d_mlp, bias=bias)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=bias)
        self.dims = {"d_mlp": d_mlp}
        self.hook_pre = HookPoint("batch pos d_mlp")
        self.hook_post = HookPoint("batch pos d_mlp")

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Any = None) -> Float[Tensor, "batch pos d_model"]:
        pre = self.up_proj(x)
        pre = self.hook_pre(pre)
        post = self.act(pre)
        post = self.hook_post(post)
        return self.down_proj(post)

    def input_linears(self) -> list[nn.Module]:
        return [self.up_proj]

    def output_bias(self) -> Tensor | None:
        return self.down_proj.bias

    def extra_repr(self) -> str:
        return f"act_fn={self.act_fn}"


class GatedMLP(MLPWeights, nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), as in Llama (SwiGLU when act_fn is silu)."""

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, bias: bool = False, *, gate_multiplier: float = 1.0,
                 out_multiplier: float = 1.0) -> None:
        super().__init__()
        self.act_fn = act_fn
        self.act = activation(act_fn)
        # muP scales (Falcon-H1's mlp_multipliers): hook_pre = gate_multiplier * gate_proj(x); out * out_multiplier
        self.gate_multiplier, self.out_multiplier = float(gate_multiplier), float(out_multiplier)
        self.gate_proj = nn.Linear(d_model, d_mlp, bias=bias)
        self.up_proj = nn.Linear(d_model, d_mlp, bias=bias)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=bias)
        self.dims = {"d_mlp": d_mlp}
        self.hook_pre = HookPoint("batch pos d_mlp")
        self.hook_pre_linear = HookPoint("batch pos d_mlp")
        self.hook_post = HookPoint("batch pos d_mlp")

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Any = None) -> Float[Tensor, "batch pos d_model"]:
        pre = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            pre = pre * self.gate_multiplier
        pre = self.hook_pre(pre)
        pre_linear = self.up_proj(x)
        pre_linear = self.hook_pre_linear(pre_linear)
        post = self.act(pre) * pre_linear
        post = self.hook_post(post)
        out = self.down_proj(post)
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier

    def input_linears(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def output_bias(self) -> Tensor | None:
        b = self.down_proj.bias
        return b if b is None or self.out_multiplier == 1.0 else b * self.out_multiplier

    def extra_repr(self) -> str:
        return f"act_fn={self.act_fn}"
