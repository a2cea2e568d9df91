"""An RMSNorm over every head of q (or k) at once: OLMo 2/3's q_norm and k_norm (one statistic per position).

    normalized[.., h, d] = weight[h, d] * x[.., h, d] / sqrt(mean over (h, d) of x^2 + eps)

Used as an attention's q_norm / k_norm on [batch pos heads d_head]. Hooks (norms.py's names, the shapes
attention.py declares for q/k norms):
    hook_scale       [batch pos heads 1]       the position's divisor, the same for every head (an edit
                                               may give each head its own)
    hook_normalized  [batch pos heads d_head]
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from hooked.hook_points import through_hook
from hooked.models.norms import Float32ProductRMSNorm
from hooked.ops.norms import rms_norm_float32_product


class HeadsRMSNorm(Float32ProductRMSNorm):
    """RMSNorm of the flattened heads (weight [heads * d_head], as HF stores it), the product in float32 as
    HF's OLMo norms take it."""

    def __init__(self, n_heads: int, d_head: int, eps: float) -> None:
        super().__init__(n_heads * d_head, eps)
        self.n_heads, self.d_head = n_heads, d_head

    def forward(self, x: Float[Tensor, "*lead heads d_head"]) -> Float[Tensor, "*lead heads d_head"]:
        if not self.hook_scale.is_active:
            return self.hook_normalized(rms_norm_float32_product(x.flatten(-2), self.weight, self.eps)
                                        .unflatten(-1, x.shape[-2:]))
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        scale = x32.pow(2).mean((-2, -1), keepdim=True).add(self.eps).sqrt().expand(*x.shape[:-1], 1)
        scale, scale_was = through_hook(self.hook_scale, scale)
        if scale_was is None:
            normed = rms_norm_float32_product(x.flatten(-2), self.weight, self.eps).unflatten(-1, x.shape[-2:])
        else:
            normed = (self.weight.view(self.n_heads, self.d_head).to(x32.dtype) * (x32 / scale)).to(x.dtype)
        return self.hook_normalized(normed)

    def normalize_with_scale(self, stack: Float[Tensor, "*comp heads d_head"],
                             scale: Float[Tensor, "*batch heads 1"]) -> Float[Tensor, "*comp heads d_head"]:
        return self.weight.view(self.n_heads, self.d_head) * (stack / scale.to(stack.dtype))

    def normalize_fresh(self, stack: Float[Tensor, "*comp heads d_head"]) -> Float[Tensor, "*comp heads d_head"]:
        return rms_norm_float32_product(stack.flatten(-2), self.weight, self.eps).unflatten(-1, stack.shape[-2:])
