"""The RG-LRU's recurrence (Griffin, De et al. 2024) and its kernel: a diagonal linear recurrence, one state
per channel, as pure tensor functions.

Glossary (shape word in annotations, paper symbol)
    batch, pos       b, t; kernel rows q_pos = target j, columns k_pos = source i
    lru_width        d, the channels; each has one scalar state
    a                a_t in (0, 1], the decay exp(log_a) (0 at a reset: the sequence's first token)
    log_a            -c softplus(Lambda) r_t (c = 8, r_t the recurrence gate), -inf at a reset
    w                sqrt(1 - a_t^2) i_t, what multiplies the input x_t (i_t the input gate; 1 at a reset)
    h                h_t = a_t h_{t-1} + w_t x_t   (h_{-1} = h0, zero by default); the block reads h itself

    kernel[b, d, j, i] = (prod_{t=i+1..j} a_t[d]) * w_i[d] for i <= j, else 0;   h_j = sum_i kernel[j, i] x_i

The kernel is Mamba-1's with d_state = 1, C = 1 and B_bar = w (ops/selective_kernel.py's chunked
factorisation on log_a: every factor <= 1, no exp(+S), no pos x pos tensor for rows or columns).
`rg_lru_sequential` is the oracle the tests hold the others to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.scan_chunked import linear_scan_chunked
from hooked.ops.selective_kernel import _full_by_chunks, _full_chunk, _rows_by_chunks, _sorted_rows, _unsort
from hooked.ops.selective_kernel import CHUNK_ROWS
from hooked.ops.selective_scan import linear_scan


MAX_SQRT_GRADIENT = 1000.0  # d sqrt(x) / dx is clipped here (Griffin's and HF's SqrtBoundDerivative)


class _BoundedSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1 / MAX_SQRT_GRADIENT**2))


def bounded_sqrt(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """sqrt(x) whose gradient 1 / (2 sqrt(x)) is at most MAX_SQRT_GRADIENT: the multiplier sqrt(1 - a^2) at
    a = 1 (a decay that rounds to 1) would otherwise send an infinite gradient, and NaN, through training."""
    return _BoundedSqrt.apply(x)


def rg_lru_sequential(
    a: Float[Tensor, "batch pos lru_width"],
    wx: Float[Tensor, "batch pos lru_width"],
    h0: Float[Tensor, "batch lru_width"] | None = None,
) -> Float[Tensor, "batch pos lru_width"]:
    """Every state h_t = a_t h_{t-1} + wx_t, one position at a time (the oracle; wx = w * x)."""
    h = wx.new_zeros(wx.shape[0], wx.shape[2]) if h0 is None else h0
    states = []
    for t in range(wx.shape[1]):
        h = a[:, t] * h + wx[:, t]
        states.append(h)
    return torch.stack(states, dim=1)


def rg_lru_scan(
    a: Float[Tensor, "batch pos lru_width"],
    wx: Float[Tensor, "batch pos lru_width"],
    h0: Float[Tensor, "batch lru_width"] | None = None,
    *,
    chunked: bool = False,
) -> Float[Tensor, "batch pos lru_width"]:
    """rg_lru_sequential by ops.selective_scan.linear_scan (chunked: its two-level form)."""
    scan = linear_scan_chunked if chunked else linear_scan
    return scan(a[..., None], wx[..., None], None if h0 is None else h0[..., None])[..., 0]


def rg_lru_kernel(
    log_a: Float[Tensor, "batch pos lru_width"],
    w: Float[Tensor, "batch pos lru_width"],
) -> Float[Tensor, "batch lru_width q_pos k_pos"]:
    """The whole kernel (module glossary), by chunks; log_a may hold -inf (a reset)."""
    seq_len = log_a.shape[1]
    ones_A, ones_C = log_a.new_ones(log_a.shape[2], 1), log_a.new_ones(log_a.shape[0], seq_len, 1)
    B_bar = lambda s: w[:, s, :, None]  # noqa: E731
    if torch.is_grad_enabled() and (log_a.requires_grad or w.requires_grad):
        rows = torch.arange(seq_len, device=log_a.device)
        return _rows_by_chunks(log_a[..., None], ones_A, B_bar, ones_C, rows, list(range(seq_len)),
                               _full_chunk(seq_len))
    return _full_by_chunks(log_a[..., None], ones_A, B_bar, ones_C, _full_chunk(seq_len))


def rg_lru_kernel_rows(
    log_a: Float[Tensor, "batch pos lru_width"],
    w: Float[Tensor, "batch pos lru_width"],
    rows: Int[Tensor, "row"],
    *,
    chunk_size: int = CHUNK_ROWS,
) -> Float[Tensor, "batch lru_width row k_pos"]:
    """rg_lru_kernel(log_a, w)[:, :, rows, :] without the pos x pos matrix (rows in any order, repeats ok)."""
    seq_len = log_a.shape[1]
    sorted_rows, order, wanted = _sorted_rows(rows, seq_len, "rows")
    out = _rows_by_chunks(log_a[..., None], log_a.new_ones(log_a.shape[2], 1), lambda s: w[:, s, :, None],
                          log_a.new_ones(log_a.shape[0], seq_len, 1), sorted_rows, wanted, chunk_size)
    return _unsort(out, order, dim=2)


def rg_lru_kernel_cols(
    log_a: Float[Tensor, "batch pos lru_width"],
    w: Float[Tensor, "batch pos lru_width"],
    cols: Int[Tensor, "col"],
    *,
    chunk_size: int = CHUNK_ROWS,
) -> Float[Tensor, "batch lru_width q_pos col"]:
    """rg_lru_kernel(log_a, w)[..., cols] without the pos x pos matrix: the columns are rows of the
    time-reversed decay products (ops.selective_kernel.mamba1_kernel_cols' trick), times w at the column."""
    batch, seq_len, width = log_a.shape
    sorted_cols, order, wanted = _sorted_rows(cols, seq_len, "cols")
    log_rev = F.pad(log_a.flip(1)[:, :-1], (0, 0, 1, 0))  # log_a''_s = log_a_{L-s}; s = 0 is never summed
    ones = log_a.new_ones(batch, seq_len, 1)
    out = _rows_by_chunks(log_rev[..., None], log_a.new_ones(width, 1), lambda s: ones[:, s, None, :], ones,
                          (seq_len - 1 - sorted_cols).flip(0), [seq_len - 1 - i for i in reversed(wanted)], chunk_size)
    out = rearrange(out.flip(2, 3), "b d c j -> b d j c")  # forward time, sorted columns ascending
    out = out * rearrange(w[:, sorted_cols], "b c d -> b d 1 c")
    return _unsort(out, order, dim=3)
