"""Grouped Mamba-1 (Zamba's mixer, Glorioso et al. 2024): Mamba-1 whose channels form groups, each group with
its own x_proj and dt_proj, so its own Δ projection, B and C.

Glossary (mamba.py's, plus)
    n_groups  G   channel groups (HF Zamba's n_mamba_heads); group g holds channels [g P, (g + 1) P), P = d_inner / G
    x_proj    GroupedLinear, P -> R + 2N per group: [Δ input ; B ; C]_g = x_proj.weight[g] @ u[group g]
    dt_proj   GroupedLinear, R -> P per group: dt[group g] = softplus(dt_proj.weight[g] @ Δ input_g + dt_proj.bias[g])
    B, C      [batch pos n_groups d_state] (hook_B, hook_C): the channels of group g read B[:, :, g], C[:, :, g]

Everything else is mamba.py's MambaMixer, unchanged: in_proj, conv, D skip, SiLU gate, out_proj, and every hook
and promise (hook_A_bar, hook_B_bar, hook_h [b l d_inner d_state] per channel, hook_kernel [b d_inner q_pos k_pos],
state edits, knockout, decode state, kernel rows and columns). Its scan runs the per-group ops of
hooked/ops/grouped_selective.py (the Mamba-1 ops on each group's channels with that group's B and C).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.mamba import MambaMixer, MambaSpec
from hooked.ops import grouped_selective as ops


class GroupedLinear(nn.Module):
    """G independent linear maps, one per group: [.. G d_in] -> [.. G d_out]."""

    def __init__(self, groups: int, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = d_in, d_out
        self.weight = nn.Parameter(torch.empty(groups, d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(groups, d_out)) if bias else None
        if not self.weight.is_meta:
            bound = 1 / math.sqrt(d_in)
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Float[Tensor, "*batch groups d_in"]) -> Float[Tensor, "*batch groups d_out"]:
        out = einsum(x, self.weight, "... g i, g o i -> ... g o")
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"groups={self.weight.shape[0]}, in_features={self.in_features}, out_features={self.out_features}"


class GroupedMambaMixer(MambaMixer):
    """MambaMixer with n_groups channel groups, each selecting its own Δ, B and C (module docstring)."""

    kernel_pairs = staticmethod(ops.grouped_kernel_pairs)
    kernel_rows = staticmethod(ops.grouped_kernel_rows)
    kernel_cols = staticmethod(ops.grouped_kernel_cols)
    kernel_dense = staticmethod(ops.grouped_kernel)
    kernel_discrete = staticmethod(ops.grouped_kernel_discrete)
    scan_loop = staticmethod(ops.grouped_scan)
    scan_chunked = staticmethod(ops.grouped_scan_chunked)
    scan_fused = staticmethod(ops.grouped_scan_fused)
    B_bar = staticmethod(ops.grouped_B_bar)
    read = staticmethod(ops.grouped_read)

    def __init__(self, spec: MambaSpec, n_groups: int) -> None:
        if n_groups < 1 or spec.d_inner % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide d_inner ({spec.d_inner})")
        if spec.mixer_rms_eps is not None:
            raise ValueError("a grouped Mamba-1 mixer has no Δ/B/C norms (mixer_rms_eps must be None)")
        super().__init__(spec)
        d, n, r = spec.d_inner, spec.d_state, spec.dt_rank
        self.n_groups = n_groups
        self.x_proj = GroupedLinear(n_groups, d // n_groups, r + 2 * n, bias=False)  # [Δ input ; B ; C] per group
        self.dt_proj = GroupedLinear(n_groups, r, d // n_groups, bias=True)
        self.reset_parameters()
        self.dims = {"d_inner": d, "d_state": n, "n_groups": n_groups}
        self.hook_B = HookPoint("batch pos n_groups d_state")
        self.hook_C = HookPoint("batch pos n_groups d_state")

    def selection(self, ssm_in: Float[Tensor, "batch pos d_inner"]) -> tuple[Tensor, Tensor, Tensor]:
        """(dt [b l d_inner], B, C [b l n_groups d_state]) from u, each group through its own x_proj and dt_proj."""
        u = rearrange(ssm_in, "b l (g p) -> b l g p", g=self.n_groups)
        dt_in, B, C = self.x_proj(u).split([self.dt_proj.in_features, self.spec.d_state, self.spec.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt_in))
        return rearrange(dt, "b l g p -> b l (g p)"), B.contiguous(), C.contiguous()
