"""Gated RMSNorm: the norm between the SSM and out_proj in Mamba-2 and Zamba2's Mamba layers.

Glossary
    d           channels (d_inner of the mixer)
    gate        z, the gate branch of in_proj (before SiLU)
    group_size  channels normalised together; d_inner // n_groups in HF's Mamba-2 and Zamba2
                (one statistic per group of SSM heads, not per head)
    eps         added to the mean square (Mamba-2: config.layer_norm_epsilon; Zamba2: 1e-5)

    gated_rms_norm(x, z) = weight * g / sqrt(mean_group(g^2) + eps),   g = x * SiLU(z)

The gate is applied BEFORE the normalisation (mamba-ssm's norm_before_gate=False, what HF does).
The statistic and the product are computed in float32 (float64 for float64 inputs), the result cast back to x's dtype before
the weight multiplies it, as HF's MambaRMSNormGated does. The module holds no hook: the mixer
that owns it names its output (`hook_gated`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor, nn


def gated_rms_norm(
    x: Float[Tensor, "*batch d"],
    gate: Float[Tensor, "*batch d"],
    weight: Float[Tensor, "d"],
    group_size: int,
    eps: float,
) -> Float[Tensor, "*batch d"]:
    """weight * g / sqrt(mean(g^2 over each group of `group_size` channels) + eps), g = x * SiLU(gate).

    Args:
        x: the SSM output (y + D u), flattened over heads.
        gate: z, before SiLU.
        weight: per-channel scale.
        group_size: channels per normalisation group; must divide d.
        eps: added to the mean square.
    Returns:
        the normalised, gated tensor in x's dtype (times weight, which may promote it).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    g = x.to(compute) * F.silu(gate.to(compute))
    grouped = rearrange(g, "... (k s) -> ... k s", s=group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * rearrange(grouped, "... k s -> ... (k s)").to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * SiLU(gate) over groups of channels (HF MambaRMSNormGated / Zamba2RMSNormGated).

    Args:
        d: channels (d_inner).
        group_size: channels per statistic (HF: d_inner // n_groups).
        eps: epsilon of the mean square.
    """

    def __init__(self, d: int, group_size: int, eps: float) -> None:
        super().__init__()
        if group_size <= 0 or d % group_size:
            raise ValueError(f"group_size {group_size} must divide the {d} channels")
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Float[Tensor, "*batch d"], gate: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={self.eps}"


class NormThenGate(nn.Module):
    """weight * rmsnorm_groups(x) * SiLU(gate): the norm BEFORE the gate (Falcon-H1's mamba_norm_before_gate).

    float32 (float64 for float64 inputs) throughout, cast back to x's dtype at the end, as HF's
    FalconH1RMSNormGated does.
    """

    def __init__(self, d: int, group_size: int, eps: float) -> None:
        super().__init__()
        if group_size <= 0 or d % group_size:
            raise ValueError(f"group_size {group_size} must divide the {d} channels")
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Float[Tensor, "*batch d"], gate: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        compute = torch.promote_types(x.dtype, torch.float32)
        grouped = rearrange(x.to(compute), "... (k s) -> ... k s", s=self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight.to(compute) * rearrange(grouped, "... k s -> ... (k s)")
        return (normed * F.silu(gate.to(compute))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={self.eps}"


class SiluGate(nn.Module):
    """x * SiLU(gate), no norm and no weight (Falcon-H1 with mamba_rms_norm=False, Mamba-1's gate)."""

    def forward(self, x: Float[Tensor, "*batch d"], gate: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        return x * F.silu(gate.to(x.dtype))
