"""GPT-OSS's mixture of experts: a router with a bias, experts with biases and a clamped SwiGLU.

Glossary (moe.py's, and)
    alpha, limit   the clamped SwiGLU's constants [swiglu_alpha = 1.702, swiglu_limit = 7.0]
    gate_bias, up_bias [n_experts d_expert]; down_bias [n_experts d_model]; router.bias [n_experts]

    gate, up = x @ gate_proj[e]^T + gate_bias[e], x @ up_proj[e]^T + up_bias[e]
    gate     = min(gate, limit);  up = clamp(up, -limit, limit)
    hidden   = (up + 1) * gate * sigmoid(alpha * gate)
    expert_e(x) = hidden @ down_proj[e]^T + down_bias[e]

Routing is moe.py's SoftmaxTopK(renormalise=True) on router logits with the bias: top k logits, softmax
over them. Hooks are moe.py's; hook_expert_out holds each chosen expert's output with its down_bias, so
an expert's term in the residual decomposition (weight * expert_out) carries its bias, and zeroing an
expert's routing weight equals zeroing its down_proj and down_bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.models.moe import _GROUPED_MM, MoE


class ClampedSwiGLUMoE(MoE):
    """moe.py's MoE with GPT-OSS's experts (module docstring); `select` is the routing rule."""

    def __init__(self, d_model: int, d_expert: int, n_experts: int, select: nn.Module, alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__(d_model, d_expert, n_experts, select, "silu", gated=True, narrow_router=True)
        self.alpha, self.limit = float(alpha), float(limit)
        self.router = nn.Linear(d_model, n_experts, bias=True)
        self.gate_bias = nn.Parameter(torch.zeros(n_experts, d_expert))
        self.up_bias = nn.Parameter(torch.zeros(n_experts, d_expert))
        self.down_bias = nn.Parameter(torch.zeros(n_experts, d_model))

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        """The clamped SwiGLU of the expert's two branches."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e: int, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        hidden = self.glu(F.linear(x, self.gate_proj[e], self.gate_bias[e]), F.linear(x, self.up_proj[e], self.up_bias[e]))
        return F.linear(hidden, self.down_proj[e], self.down_bias[e])

    def _every_expert(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n n_experts d_model"]:
        gate = einsum(x, self.gate_proj, "n m, e f m -> n e f") + self.gate_bias
        up = einsum(x, self.up_proj, "n m, e f m -> n e f") + self.up_bias
        return einsum(self.glu(gate, up), self.down_proj, "n e f, e m f -> n e m") + self.down_bias

    def _grouped_experts(self, rows: Float[Tensor, "m d_model"],
                         ends: Int[Tensor, "n_experts"]) -> Float[Tensor, "m d_model"]:
        """moe.py's three grouped multiplies, each row's expert biases added (its expert found from `ends`)."""
        def linear(a: Tensor, weight: Tensor, bias: Tensor) -> Tensor:  # per group: a @ weight[e].T + bias[e]
            return _GROUPED_MM(a, weight.transpose(1, 2), offs=ends) + bias[expert]

        expert = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device, dtype=ends.dtype), right=True)
        hidden = self.glu(linear(rows, self.gate_proj, self.gate_bias), linear(rows, self.up_proj, self.up_bias))
        return linear(hidden, self.down_proj, self.down_bias)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, clamped SwiGLU alpha={self.alpha:g}, limit={self.limit:g}"
