"""Mamba-1 selective scan in O(sqrt(pos)) tensor ops: a two-level scan for launch-bound devices.

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch     b
    pos       l     L   sequence position
    d_inner   d     D   channel
    d_state   n     N   state size per channel
    chunk     c         positions [c Q, (c+1) Q) for the chunk length Q; p: position inside it
    slab                the positions whose [b l d n] quantities are held at once (memory bound)

The recurrence is selective_scan.py's: h_t = A_bar_t * h_{t-1} + X_t with X_t = B_bar_t * u_t.
The sequential loop costs a few tensor ops per position; on a GPU each op is a kernel launch of
5-10 us, so the loop is launch-bound (about 1.75 L launches per layer). Here the positions are
cut into chunks of Q and the recurrence is split in two levels:
    1. inside every chunk at once: the local states s_t (the recurrence started from zero at the
       chunk's start), one fused multiply-add per position of a chunk (Q ops over all chunks), and
       the decay from the chunk's start P_t = prod_{t' = start..t} A_bar_t' (one cumprod);
    2. across chunks: the state entering chunk c+1 is P_end(c) * h_in(c) + s_end(c) (one op per
       chunk), then every state is h_t = s_t + P_t * h_in(chunk of t) (one op).
About Q + L / Q + 15 ops per slab (Q ~ sqrt(slab)), against 1.75 L. Exact in the sense the scan is:
the local states are the loop's own products and sums; P is a product of factors <= 1 (no
exp(-cumsum) rescaling, nothing overflows), so the result differs from the loop only by rounding.
Memory: two [b l d n] buffers per slab, bounded by `max_bytes`; the states of one slab at a time.
On CPU the plain loop (selective_scan) stays faster: it keeps one chunk in cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum
from jaxtyping import Float
from torch import Tensor

SLAB_BYTES = 2**30  # the two [b l d n] buffers of one slab (A_bar, states), at most this many bytes
MIN_CHUNK, MAX_CHUNK = 4, 128


def default_chunk(positions: int) -> int:
    """A power of two near sqrt(positions) in [MIN_CHUNK, MAX_CHUNK]: minimises Q + positions / Q."""
    return min(MAX_CHUNK, max(MIN_CHUNK, 2 ** round(math.log2(max(positions, 1)) / 2)))


def _grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _padded(t: Tensor, pad: int, value: float) -> Tensor:
    """A new contiguous tensor: t with `pad` positions of `value` appended along axis 1."""
    out = t.new_full((t.shape[0], t.shape[1] + pad, *t.shape[2:]), value)
    out[:, : t.shape[1]] = t
    return out


def _two_level(
    A_bar: Float[Tensor, "batch chunk p d_inner d_state"],
    X: Float[Tensor, "batch chunk p d_inner d_state"],
    h: Float[Tensor, "batch d_inner d_state"] | None,
) -> tuple[Float[Tensor, "batch chunk p d_inner d_state"], Float[Tensor, "batch d_inner d_state"]]:
    """(every state, the state after the last position) of h_t = A_bar_t h_{t-1} + X_t, h_{-1} = h.

    Without autograd the states are written into X and the decays into A_bar (both overwritten).
    """
    batch, n_chunks, Q = X.shape[:3]
    grad = _grad(A_bar, X, h)
    # 1. local states s_t inside every chunk at once, and the decays P_t from each chunk's start
    if grad:
        local = [X[:, :, 0]]
        for p in range(1, Q):
            local.append(torch.addcmul(X[:, :, p], A_bar[:, :, p], local[-1]))
        states, decay = torch.stack(local, dim=2), torch.cumprod(A_bar, dim=2)
    else:
        for p in range(1, Q):
            X[:, :, p].addcmul_(A_bar[:, :, p], X[:, :, p - 1])
        states, decay = X, A_bar.cumprod_(dim=2)
    # 2. the state entering each chunk, chunk by chunk (one op each), then every state corrected
    entering, carry = [], h
    for c in range(n_chunks):
        entering.append(carry)
        end = states[:, c, -1]
        # a copy, not a view: the state handed back must not keep the slab's buffers alive
        carry = end.clone() if carry is None else torch.addcmul(end, decay[:, c, -1], carry)
    first = 0 if h is not None else 1  # chunk 0 enters with zeros when there is no h
    if first < n_chunks:
        h_in = torch.stack(entering[first:], dim=1)[:, :, None]  # [b c 1 d n]
        if grad:
            states = torch.cat([states[:, :first], states[:, first:] + decay[:, first:] * h_in], dim=1)
        else:
            states[:, first:].addcmul_(decay[:, first:], h_in)
    return states, carry


def linear_scan_chunked(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    X: Float[Tensor, "batch pos d_inner d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    *,
    chunk_size: int | None = None,
) -> Float[Tensor, "batch pos d_inner d_state"]:
    """Same result as selective_scan.linear_scan (every state h_t), in O(Q + pos / Q) tensor ops.

    For hook_h on a launch-bound device: A_bar and X are discrete, possibly edited, quantities of
    any sign (the products are taken as they come).

    Args:
        A_bar: decay per position. X: input added to the state at each position.
        h0: state before position 0 (zeros when None). chunk_size: Q (None: about sqrt(pos)).
    Returns:
        states: h_t for every position t.
    """
    batch, seq_len = X.shape[:2]
    Q = chunk_size or default_chunk(seq_len)
    pad = (-seq_len) % Q  # padded positions: decay 1, no input (the last state is unchanged)
    # fresh buffers, which the scan may overwrite: never the caller's tensors
    A_bar, X = _padded(A_bar.expand_as(X), pad, 1.0), _padded(X, pad, 0.0)
    shape = (batch, (seq_len + pad) // Q, Q, *X.shape[2:])
    states, _ = _two_level(A_bar.view(shape), X.view(shape), h0)
    return states.reshape(batch, seq_len + pad, *X.shape[2:])[:, :seq_len]


def selective_scan_chunked(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    *,
    chunk_size: int | None = None,
    max_bytes: int = SLAB_BYTES,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """Same result as selective_scan (y without the D skip, and the last state), two-level.

    The positions are taken a slab at a time (as many as fit two [b slab d n] buffers in
    max_bytes, a multiple of the chunk length), the state carried between slabs.

    Args:
        as selective_scan; chunk_size: Q (None: about sqrt(slab)); max_bytes: the slab's bound.
    Returns:
        y (no D skip) and h_last, the state after the last position.
    """
    batch, seq_len, d_inner = u.shape
    d_state = A.shape[1]
    per_pos = 2 * batch * d_inner * d_state * max(u.element_size(), A.element_size())
    slab = max(1, min(seq_len, max_bytes // per_pos))
    Q = chunk_size or default_chunk(slab)
    slab = max(Q, slab // Q * Q)
    h = h0
    ys = []
    for start in range(0, seq_len, slab):
        pos = slice(start, min(start + slab, seq_len))
        n = pos.stop - start
        pad = (-n) % Q  # padded positions: dt = 0 gives decay 1 and no input
        dt_s, u_s, B_s = (F.pad(t[:, pos], (0, 0, 0, pad)) for t in (dt, u, B))
        A_bar = torch.exp(dt_s[..., None] * A)  # [b l d n]
        X = (dt_s * u_s)[..., None] * B_s[:, :, None, :]  # [b l d n], B_bar_t u_t
        shape = (batch, (n + pad) // Q, Q, d_inner, d_state)
        states, h = _two_level(A_bar.view(shape), X.view(shape), h)
        states = states.reshape(batch, n + pad, d_inner, d_state)[:, :n]
        ys.append(einsum(states, C[:, pos], "b l d n, b l n -> b l d"))
    if not ys:
        return u.new_zeros(u.shape), (u.new_zeros(batch, d_inner, d_state) if h0 is None else h0)
    return torch.cat(ys, dim=1) if len(ys) > 1 else ys[0], h
