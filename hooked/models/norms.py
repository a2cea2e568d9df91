"""Norm modules with `hook_scale` and `hook_normalized`.

Hooks (one rule for every norm kind):
    hook_scale       [batch pos 1]  the divisor: sqrt(mean(x^2) + eps) (RMSNorm) or
                                    sqrt(var(x) + eps) (LayerNorm), as TransformerLens names it
    hook_normalized  [batch pos d]  the norm's OUTPUT, weight (and bias) applied. TransformerLens's
                                    hook_normalized sits before the weight; ours is what the next
                                    layer reads. With `fold_ln` processing the weight is 1 and the
                                    two agree.
An edited scale is what the norm divides by. An unhooked (or unedited) scale leaves the output
bit-identical to the plain norm.

`normalize_with_scale(stack, scale)` applies the norm to a stack of residual components with the
scale of the full residual (a cached hook_scale), so that the map stays linear and the components
of a decomposition still sum to the normalised residual (bias left out); `normalize_fresh(stack)`
normalises each component with its own statistics (the logit lens).

`input_grads_(x, grads)` gives the plain norm's vector-Jacobian products at x for a stack of output
gradients [n *x.shape] (written over grads; hooks left out): what autograd would give through the
unhooked norm, in one pass instead of a graph per gradient (circuits' receivers use it).

`UnitOffsetRMSNorm` is Gemma's RMSNorm: its stored weight w acts as (1 + w). `Float32ProductRMSNorm` is
OLMo's: the weight multiplies before the cast to the activations' dtype. RMSNorms also serve as
per-head q/k norms (Qwen3, Gemma 3), on [batch pos heads d_head] (hook_scale [batch pos heads 1]):
any leading axes are accepted.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook
from hooked.ops.norms import (layer_norm, layer_norm_vjp_, rms_norm, rms_norm_float32_product, rms_norm_unit_offset,
                              rms_norm_vjp_)


def _scale_in_graph(fast: Tensor, explicit: Tensor, scale: Tensor) -> Tensor:
    """`fast`'s value bit for bit, with the gradient of `explicit` (the norm written through the hooked
    scale) when one is taken: backward hooks on hook_scale then see d loss / d scale, as in TL."""
    if not (torch.is_grad_enabled() and scale.requires_grad):
        return fast
    return fast.detach() + (explicit - explicit.detach())


class Norm(nn.Module):
    """What every norm of the residual answers (a block's `norm`, ln_final): `input_grads_`."""

    def input_grads_(self, x: Float[Tensor, "*lead d"], grads: Float[Tensor, "n *lead d"]) -> Tensor | None:
        """The plain norm's vector-Jacobian products at x for the output gradients `grads` (written over them),
        or None where the norm has no closed form (the caller then takes autograd's)."""
        return None


class NoNorm(Norm):
    """No norm before a sublayer (OLMo 2's post-norm blocks): the residual as it is."""

    def forward(self, x: Tensor) -> Tensor:
        return x

    def input_grads_(self, x: Tensor, grads: Tensor) -> Tensor:
        return grads


class RMSNorm(Norm):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.dims = {"d_norm": d}
        self.hook_scale = HookPoint("batch pos 1", element="wide")  # ([batch pos heads 1] as a q/k norm)
        self.hook_normalized = HookPoint("batch pos d_norm")  # ([batch pos heads d_head] as a q/k norm)

    def forward(self, x: Float[Tensor, "*lead d"]) -> Float[Tensor, "*lead d"]:
        if not self.hook_scale.is_active:
            return self.hook_normalized(rms_norm(x, self.weight, self.eps))
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        scale = x32.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        scale, scale_was = through_hook(self.hook_scale, scale)
        explicit = self.weight * (x32 / scale).to(x.dtype)
        normed = _scale_in_graph(rms_norm(x, self.weight, self.eps), explicit, scale) if scale_was is None else explicit
        return self.hook_normalized(normed)

    def normalize_with_scale(self, stack: Float[Tensor, "*comp d"], scale: Float[Tensor, "*batch 1"]) -> Float[Tensor, "*comp d"]:
        """weight * stack / scale: the norm as the linear map it was on the residual with that scale."""
        return self.weight * (stack / scale.to(stack.dtype))

    def normalize_fresh(self, stack: Float[Tensor, "*comp d"]) -> Float[Tensor, "*comp d"]:
        """The norm applied to each component with its own statistics (no hooks fire)."""
        return rms_norm(stack, self.weight, self.eps)

    def input_grads_(self, x: Float[Tensor, "*lead d"], grads: Float[Tensor, "n *lead d"]) -> Float[Tensor, "n *lead d"]:
        return rms_norm_vjp_(x, self.weight + getattr(self, "weight_offset", 0.0), self.eps, grads)


class Float32ProductRMSNorm(RMSNorm):
    """OLMo 2/3's RMSNorm: weight * x / rms(x) with the product in float32 before the cast
    (`ops.norms.rms_norm_float32_product`); the same numbers as RMSNorm in float32 and float64."""

    def forward(self, x: Float[Tensor, "*lead d"]) -> Float[Tensor, "*lead d"]:
        if not self.hook_scale.is_active:
            return self.hook_normalized(rms_norm_float32_product(x, self.weight, self.eps))
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        scale = x32.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        scale, scale_was = through_hook(self.hook_scale, scale)
        explicit = (self.weight.to(x32.dtype) * (x32 / scale)).to(x.dtype)
        if scale_was is None:
            return self.hook_normalized(_scale_in_graph(rms_norm_float32_product(x, self.weight, self.eps), explicit,
                                                        scale))
        return self.hook_normalized(explicit)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: (1 + w) * x / rms(x), the product in float32 (`ops.norms.rms_norm_unit_offset`).

    The parameter keeps HF's name and value (`weight` = w, zero at initialisation): loading is a copy.
    `weight_offset` tells weight processing (fold_ln) that the gain is weight + 1.
    """

    weight_offset = 1.0

    def __init__(self, d: int, eps: float) -> None:
        super().__init__(d, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: Float[Tensor, "*lead d"]) -> Float[Tensor, "*lead d"]:
        if not self.hook_scale.is_active:
            return self.hook_normalized(rms_norm_unit_offset(x, self.weight, self.eps))
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        scale = x32.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        scale, scale_was = through_hook(self.hook_scale, scale)
        explicit = ((x32 / scale) * (1.0 + self.weight.to(x32.dtype))).to(x.dtype)
        if scale_was is None:
            return self.hook_normalized(_scale_in_graph(rms_norm_unit_offset(x, self.weight, self.eps), explicit, scale))
        return self.hook_normalized(explicit)

    def normalize_with_scale(self, stack: Float[Tensor, "*comp d"],
                             scale: Float[Tensor, "*batch 1"]) -> Float[Tensor, "*comp d"]:
        return (1.0 + self.weight) * (stack / scale.to(stack.dtype))

    def normalize_fresh(self, stack: Float[Tensor, "*comp d"]) -> Float[Tensor, "*comp d"]:
        return rms_norm_unit_offset(stack, self.weight, self.eps)


class LayerNorm(Norm):
    def __init__(self, d: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.dims = {"d_norm": d}
        self.hook_scale = HookPoint("batch pos 1")
        self.hook_normalized = HookPoint("batch pos d_norm")

    def forward(self, x: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos d"]:
        if not self.hook_scale.is_active:
            return self.hook_normalized(layer_norm(x, self.weight, self.bias, self.eps))
        scale = x.var(-1, keepdim=True, unbiased=False).add(self.eps).sqrt()
        scale, scale_was = through_hook(self.hook_scale, scale)
        normed = (x - x.mean(-1, keepdim=True)) / scale * self.weight
        explicit = normed if self.bias is None else normed + self.bias
        if scale_was is None:
            return self.hook_normalized(_scale_in_graph(layer_norm(x, self.weight, self.bias, self.eps), explicit, scale))
        return self.hook_normalized(explicit)

    def normalize_with_scale(self, stack: Float[Tensor, "*comp d"], scale: Float[Tensor, "*batch 1"]) -> Float[Tensor, "*comp d"]:
        """weight * (stack - mean) / scale (bias left out: it belongs to no component)."""
        return self.weight * ((stack - stack.mean(-1, keepdim=True)) / scale.to(stack.dtype))

    def normalize_fresh(self, stack: Float[Tensor, "*comp d"]) -> Float[Tensor, "*comp d"]:
        """The norm applied to each component with its own statistics, bias included (no hooks fire)."""
        return layer_norm(stack, self.weight, self.bias, self.eps)

    def input_grads_(self, x: Float[Tensor, "batch pos d"], grads: Float[Tensor, "n batch pos d"]) -> Float[Tensor, "n batch pos d"]:
        return layer_norm_vjp_(x, self.weight, self.eps, grads)
