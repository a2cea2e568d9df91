"""Grouped unit-offset RMSNorm (Qwen4-Exp's hyper-connection and PLE norms): one RMS per group of features.

    x [.. n_groups * group]  ->  (1 + w) * x_g / sqrt(mean(x_g^2) + eps)  for each group g of `group` features

Each of the n_groups residual streams of a hyper-connection (hyper_residual.py) is normalised on its own;
the weight w [n_groups * group] is stored as HF stores it (an offset from 1). With group = the whole width it
is norms.py's UnitOffsetRMSNorm; the arithmetic is ops.norms.rms_norm_unit_offset's (float32 or wider), per group.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn



class GroupedRMSNorm(nn.Module):
    def __init__(self, d: int, group: int, eps: float) -> None:
        super().__init__()
        if group < 1 or d % group:
            raise ValueError(f"a grouped RMSNorm's width ({d}) must be a multiple of its group size ({group})")
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: Float[Tensor, "*lead d"]) -> Float[Tensor, "*lead d"]:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, self.group))  # [.. n_groups group]
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(x32.dtype).view(-1, self.group))).flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group={self.group}, eps={self.eps}"
