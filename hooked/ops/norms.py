"""Normalisations as pure functions (float32 inside, as Hugging Face computes them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor


def rms_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float) -> Float[Tensor, "... d"]:
    """weight * x / sqrt(mean(x^2) + eps); the statistic in at least float32 (float64 stays float64,
    where HF would drop to float32), the product in x's dtype."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_float32_product(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float) -> Float[Tensor, "... d"]:
    """weight * x / sqrt(mean(x^2) + eps) as OLMo 2/3 compute it: the product too in at least float32, then
    the cast to x's dtype (Llama's `rms_norm` casts first). Equal to `rms_norm` in float32 and float64."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(x32.dtype) * normed).to(x.dtype)


def rms_norm_unit_offset(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float) -> Float[Tensor, "... d"]:
    """(1 + weight) * x / sqrt(mean(x^2) + eps) as Gemma computes it: the weight is stored as an offset
    from 1, and the product too is taken in at least float32 before casting back to x's dtype
    (Llama's `rms_norm` casts first, then multiplies)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.to(x32.dtype))).to(x.dtype)


def layer_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], bias: Float[Tensor, "d"] | None,
               eps: float) -> Float[Tensor, "... d"]:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm_gated(x: Float[Tensor, "... d"], gate: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float,
                   gate_fn: Callable[[Tensor], Tensor]) -> Float[Tensor, "... d"]:
    """weight * x / sqrt(mean(x^2) + eps) * gate_fn(gate): normalise, then gate (the delta-rule families'
    output norm, per head over d_v: Qwen3-Next, Qwen3.5 and OLMo-hybrid with SiLU, Kimi Linear with sigmoid).

    Not Mamba-2's gated norm (models/gated_norm.py), which gates before normalising. As HF's
    Qwen3NextRMSNormGated: the statistic in at least float32, cast back to x's dtype before the weight
    multiplies it, the gate's activation in at least float32, the result cast to x's dtype. (Kimi's copy
    keeps the weight product in float32 too: the same number in float32 and float64.)
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * gate_fn(gate.to(compute))).to(x.dtype)


def rms_norm_vjp_(x: Float[Tensor, "... d"], gain: Float[Tensor, "d"], eps: float,
                  grads: Float[Tensor, "n ... d"]) -> Float[Tensor, "n ... d"]:
    """Vector-Jacobian products of y = gain * x / s, s = sqrt(mean(x^2) + eps), for a stack of output
    gradients g (written over `grads`, which is returned):

        dL/dx = gain * g / s  -  x * sum(gain * g * x) / (d * s^3)

    the statistic in at least float32, as the forward computes it (`gain`: the weight, or 1 + weight)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute)
    inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # 1 / s
    grads.mul_((gain.to(compute) * inv).to(grads.dtype))  # a = gain * g / s
    dot = (grads * x32.to(grads.dtype)).sum(-1, keepdim=True)  # sum(a * x) (an einsum here is 4x slower on CPU)
    return grads.addcmul_(x32.to(grads.dtype), dot * (inv * inv / x.shape[-1]).to(grads.dtype), value=-1.0)


def layer_norm_vjp_(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float,
                    grads: Float[Tensor, "n ... d"]) -> Float[Tensor, "n ... d"]:
    """Vector-Jacobian products of y = weight * (x - mean) / s + bias, s = sqrt(var(x) + eps), for a stack
    of output gradients g (written over `grads`, which is returned): with a = weight * g / s and
    x^ = (x - mean) / s,

        dL/dx = a - mean(a) - x^ * mean(a * x^)"""
    compute = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute)
    mean = x32.mean(-1, keepdim=True)
    inv = torch.rsqrt(x32.var(-1, keepdim=True, unbiased=False) + eps)
    xhat = ((x32 - mean) * inv).to(grads.dtype)
    grads.mul_((weight.to(compute) * inv).to(grads.dtype))
    dot = (grads * xhat).sum(-1, keepdim=True) / x.shape[-1]
    grads.sub_(grads.mean(-1, keepdim=True))
    return grads.addcmul_(xhat, dot, value=-1.0)
