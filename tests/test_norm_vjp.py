"""The norms' closed-form vector-Jacobian products (`input_grads_`, circuits' receivers pull gradients back
through them) equal autograd through the module, for a stack of output gradients."""

from __future__ import annotations

import pytest
import torch

from hooked.models.norms import LayerNorm, RMSNorm, UnitOffsetRMSNorm

NORMS = {
    "rms": lambda d: RMSNorm(d, 1e-6),
    "unit_offset_rms": lambda d: UnitOffsetRMSNorm(d, 1e-6),
    "layer": lambda d: LayerNorm(d, 1e-5),
    "layer_no_bias": lambda d: LayerNorm(d, 1e-5, bias=False),
}


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_input_grads_equal_autograd(kind, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    norm = NORMS[kind](16).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen))
    x = (3 * torch.randn(2, 5, 16, generator=gen) + 0.5).to(dtype).requires_grad_(True)
    grads = torch.randn(4, 2, 5, 16, generator=gen).to(dtype)
    out = norm(x)
    (expected,) = torch.autograd.grad(out, x, grads, is_grads_batched=True)
    with torch.no_grad():
        got = norm.input_grads_(x.detach(), grads.clone())
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
