"""A linear map whose backward skips the output rows that receive no gradient.

The unembedding maps every position to d_vocab logits, but most metrics read a few positions (the last
token's logit difference): the gradient of the logits is zero on every other row, and a dense backward
spends a d_vocab x d_model product on each of them. `row_sparse_linear(x, weight, bias)` is
F.linear(x, weight, bias) bit for bit in the forward; its backward finds the rows of the output gradient
that are not all zero and takes the input, weight and bias gradients from those rows only (the others
contribute exactly zero). When most rows carry gradient (a language-modelling loss), it is the dense
backward. Under torch.func transforms (and batched gradients) it is plain F.linear.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

DENSE_FRACTION = 0.5  # above this share of live rows the dense backward is as cheap


class _RowSparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        need_w = need_w and _engine_wants(weight)
        g = grad.reshape(-1, grad.shape[-1])
        xs = x.reshape(-1, x.shape[-1])
        live = _live_rows(g)
        if live is None or len(live) > DENSE_FRACTION * g.shape[0]:
            gx = (g @ weight).view_as(x) if need_x else None
            gw = g.T @ xs if need_w else None
            gb = g.sum(0) if need_b and ctx.has_bias else None
            return gx, gw, gb
        g_live = g.index_select(0, live)
        gx = None
        if need_x:
            gx = xs.new_zeros(xs.shape)
            gx.index_copy_(0, live, g_live @ weight)
            gx = gx.view_as(x)
        gw = g_live.T @ xs.index_select(0, live) if need_w else None
        gb = g_live.sum(0) if need_b and ctx.has_bias else None
        return gx, gw, gb


def _engine_wants(leaf: Tensor) -> bool:
    """Whether this backward will use the gradient of `leaf` (a parameter): torch.autograd.grad of other
    inputs (circuits' receivers) leaves a tied unembedding's d_vocab x d_model gradient unused, which
    needs_input_grad cannot tell. True whenever the engine cannot say."""
    try:
        return bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(leaf).node))
    except (AttributeError, RuntimeError):  # a private call: absent, or refused inside autograd.grad(leaf)
        return True


def _live_rows(g: Tensor) -> Tensor | None:
    """Numbers of the rows of g [rows n] that are not all zero; None where shapes cannot depend on data
    (autograd's batched gradients run this backward under vmap, which has no rule for nonzero)."""
    if _transformed(g):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vmap's "no batching rule" notice before it raises
            return g.ne(0).any(-1).nonzero()[:, 0]
    except RuntimeError:
        return None


def row_sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) whose backward costs only the rows that get a gradient (module docstring)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad) or _transformed(x):
        return F.linear(x, weight, bias)
    return _RowSparseLinear.apply(x, weight, bias)


def _transformed(x: Tensor) -> bool:
    """Whether x is inside a torch.func transform (vmap, grad, jvp; autograd's batched gradients): the plain
    op then, which they understand."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x) or torch._C._functorch.is_batchedtensor(x)
