"""row_sparse_linear (the unembedding's op): F.linear's forward bit for bit, and the dense backward's gradients
whatever rows carry gradient, under batched gradients, torch.func and double backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hooked.ops.row_sparse import row_sparse_linear


def _inputs(bias: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    return x, w, b


def _grads(fn, x, w, b, upstream):
    out = fn(x, w, b)
    wanted = [t for t in (x, w, b) if t is not None]
    return out, torch.autograd.grad(out, wanted, upstream)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ["last", "some", "all", "none"])
def test_gradients_equal_the_dense_backward(bias, rows):
    x, w, b = _inputs(bias)
    upstream = torch.randn(3, 5, 11, dtype=torch.float64)
    if rows == "last":
        upstream[:, :-1] = 0
    elif rows == "some":
        upstream[0, 1:] = 0
        upstream[2] = 0
    elif rows == "none":
        upstream.zero_()
    ours, g_ours = _grads(row_sparse_linear, x, w, b, upstream)
    dense, g_dense = _grads(F.linear, x, w, b, upstream)
    assert torch.equal(ours, dense)
    for a, e in zip(g_ours, g_dense):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    if rows == "last":  # the rows without gradient get exactly zero
        assert torch.equal(g_ours[0][:, :-1], torch.zeros_like(g_ours[0][:, :-1]))


def test_batched_gradients_and_torch_func():
    x, w, b = _inputs(True)
    out = row_sparse_linear(x, w, b)
    stack = torch.zeros(2, *out.shape, dtype=out.dtype)
    stack[0, :, -1] = 1.0
    stack[1, 0] = 2.0
    (batched,) = torch.autograd.grad(out, x, stack, is_grads_batched=True)
    expected = torch.stack([torch.autograd.grad(F.linear(x, w, b), x, s)[0] for s in stack])
    torch.testing.assert_close(batched, expected)
    via_func = torch.func.grad(lambda t: row_sparse_linear(t, w.detach(), b.detach())[:, -1].sum())(x.detach())
    torch.testing.assert_close(via_func, torch.func.grad(lambda t: F.linear(t, w.detach(), b.detach())[:, -1].sum())(x.detach()))


def test_double_backward():
    x, w, b = _inputs(True)

    def second(fn):
        out = fn(x, w, b)
        (gx,) = torch.autograd.grad((out[:, -1] ** 2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), w)[0]

    torch.testing.assert_close(second(row_sparse_linear), second(F.linear))


def test_the_unembedding_uses_it():
    from hooked.models.embed import Unembed

    unembed = Unembed(8, 11).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    logits = unembed(x)
    (g,) = torch.autograd.grad(logits[:, -1, 3].sum(), x)
    assert logits.grad_fn is not None and "RowSparse" in type(logits.grad_fn).__name__
    torch.testing.assert_close(g[:, -1], unembed.weight[3].expand(2, 8))
    assert torch.equal(g[:, :-1], torch.zeros_like(g[:, :-1]))


def test_weight_gradient_still_flows_to_training():
    """Skipping the weight's gradient when autograd.grad does not ask for it must not starve .backward()."""
    x, w, b = _inputs(True)
    upstream = torch.zeros(3, 5, 11, dtype=torch.float64)
    upstream[:, -1] = 1.0
    row_sparse_linear(x, w, b).backward(upstream)
    expected = upstream.reshape(-1, 11).T @ x.detach().reshape(-1, 8)
    torch.testing.assert_close(w.grad, expected)
    (gx,) = torch.autograd.grad(row_sparse_linear(x, w, b), x, upstream)  # the weight's left out: x's unchanged
    torch.testing.assert_close(gx, upstream @ w.detach())
