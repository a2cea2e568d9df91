"""Norm modules with `hook_normalized` (the norm's output, weight applied).

`apply_frozen(stack, reference)` applies the norm to a stack of residual components using the
normalisation factor of `reference` (the full residual), so that the map stays linear and the
components of a decomposition still sum to the normalised residual (bias left out).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.ops.norms import layer_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.hook_normalized = HookPoint()  # [batch pos d]

    def forward(self, x: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos d"]:
        return self.hook_normalized(rms_norm(x, self.weight, self.eps))

    def apply_frozen(self, stack: Float[Tensor, "comp batch pos d"], reference: Float[Tensor, "batch pos d"]):
        ref = reference.to(torch.promote_types(reference.dtype, torch.float32))
        scale = torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + self.eps).to(stack.dtype)
        return self.weight * stack * scale


class LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.hook_normalized = HookPoint()  # [batch pos d]

    def forward(self, x: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos d"]:
        return self.hook_normalized(layer_norm(x, self.weight, self.bias, self.eps))

    def apply_frozen(self, stack: Float[Tensor, "comp batch pos d"], reference: Float[Tensor, "batch pos d"]):
        var = reference.var(-1, keepdim=True, unbiased=False)
        centred = stack - stack.mean(-1, keepdim=True)
        return self.weight * centred * torch.rsqrt(var + self.eps)
