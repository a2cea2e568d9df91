"""Lightning attention (MiniMax-01): linear attention with one constant exponential decay per head.

Glossary (shape word, einops letter, symbol)
    batch      b
    pos        l     t    position; kernel rows q_pos = target j, columns k_pos = source i
    n_heads    h          heads: each has its own state and decay
    d_key      c          the state's rows (key channels; = d_head in MiniMax)
    d_value    v          the state's columns (value channels; = d_head in MiniMax)
    slope      s_h > 0    the head's decay rate: lambda_h = exp(-s_h), the same at every position
    h          S_t [d_key d_value] per head, never called x

The recurrence, per head (HF's decoding loop; hook_h holds S_t):
    S_t = lambda S_{t-1} + k_t v_t^T,      y_t = S_t^T q_t
As attention, from a zero state (DESIGN.md section 4's convention, zero for i > j):
    y_j = sum_{i <= j} K[j, i] v_i,        K[h, j, i] = lambda_h^(j - i) (q_j . k_i)
An initial state S0 adds lambda^(j+1) S0^T q_j to y_j, which is not in the kernel (as the D skip is not in
the SSM kernel).

`lightning_sequential` is the loop (the oracle); `lightning_chunked` is HF's block algorithm: inside a
block of `block_size` positions the kernel times v, between blocks the state, decayed (HF's query_decay,
key_decay, diagonal_decay and block_decay). Both return (y, S_last) in the inputs' dtype.
"""

from __future__ import annotations

import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.pair_cut import pair_cut
from hooked.ops.ssd import _check_positions, _linear_recurrence



def _decay(slope: Float[Tensor, "n_heads"], steps: Tensor) -> Tensor:
    """lambda^steps = exp(-slope * steps), steps broadcast after the head axis; zero where steps < 0."""
    s = slope.reshape(slope.shape + (1,) * steps.ndim)
    return torch.exp(-s * steps.clamp_min(0)).masked_fill(steps < 0, 0.0)


def lightning_sequential(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    v: Float[Tensor, "batch pos n_heads d_value"],
    slope: Float[Tensor, "n_heads"],
    h0: Float[Tensor, "batch n_heads d_key d_value"] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_value"], Float[Tensor, "batch n_heads d_key d_value"]]:
    """The recurrence one position at a time: the test oracle. Returns (y, S after the last position)."""
    lam = torch.exp(-slope)[:, None, None]
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0
    ys = []
    for t in range(q.shape[1]):
        S = lam * S + einsum(k[:, t], v[:, t], "b h c, b h v -> b h c v")
        ys.append(einsum(S, q[:, t], "b h c v, b h c -> b h v"))
    return torch.stack(ys, dim=1), S


def lightning_chunked(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    v: Float[Tensor, "batch pos n_heads d_value"],
    slope: Float[Tensor, "n_heads"],
    block_size: int,
    h0: Float[Tensor, "batch n_heads d_key d_value"] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_value"], Float[Tensor, "batch n_heads d_key d_value"]]:
    """Same result as lightning_sequential, by HF's blocks (module docstring). Returns (y, S_last)."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0
    ys = []
    for start in range(0, q.shape[1], block_size):
        qb, kb, vb = (x[:, start:start + block_size] for x in (q, k, v))
        n = qb.shape[1]
        r = torch.arange(n, device=q.device, dtype=slope.dtype)
        # 1. inside the block: (q_j . k_i) lambda^(j - i) v_i, the kernel's diagonal block
        intra = einsum(qb, kb, "b j h c, b i h c -> b h j i") * _decay(slope, r[:, None] - r[None, :])
        y = einsum(intra, vb, "b h j i, b i h v -> b j h v")
        # 2. from the state entering the block: lambda^(j+1) S^T q_j (j counted from the block start)
        y = y + einsum(qb * _decay(slope, r + 1).T[None, :, :, None], S, "b j h c, b h c v -> b j h v")
        ys.append(y)
        # 3. the state leaving the block: lambda^n S + sum_i lambda^(n-1-i) k_i v_i^T
        kd = kb * _decay(slope, n - 1 - r).T[None, :, :, None]
        block_decay = _decay(slope, r.new_tensor(float(n)))[None, :, None, None]
        S = block_decay * S + einsum(kd, vb, "b i h c, b i h v -> b h c v")
    y = torch.cat(ys, dim=1) if ys else v.new_zeros(v.shape)
    return y, S


def lightning_states(
    k: Float[Tensor, "batch pos n_heads d_key"],
    v: Float[Tensor, "batch pos n_heads d_value"],
    slope: Float[Tensor, "n_heads"],
    h0: Float[Tensor, "batch n_heads d_key d_value"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_key d_value"]:
    """Every state S_t (hook_h): the scan S_t = lambda S_{t-1} + k_t v_t^T, from h0 (zeros when None)."""
    return _linear_recurrence(lightning_decays(slope, k.shape[0], k.shape[1]),
                              einsum(k, v, "b l h c, b l h v -> b l h c v"), h0)


def lightning_decays(slope: Float[Tensor, "n_heads"], batch: int, pos: int) -> Float[Tensor, "batch pos n_heads 1 1"]:
    """lambda = exp(-slope) at every position, broadcast against the states (set_scan's decay)."""
    return torch.exp(-slope)[None, None, :, None, None].expand(batch, pos, -1, 1, 1)


def lightning_kernel(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    slope: Float[Tensor, "n_heads"],
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """K[b, h, j, i] = lambda_h^(j - i) (q_j . k_i), zero for i > j."""
    r = torch.arange(q.shape[1], device=q.device, dtype=slope.dtype)
    return einsum(q, k, "b j h c, b i h c -> b h j i") * _decay(slope, r[:, None] - r[None, :])


def lightning_kernel_rows(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    slope: Float[Tensor, "n_heads"],
    rows: Int[Tensor, "row"],
) -> Float[Tensor, "batch n_heads row k_pos"]:
    """lightning_kernel(q, k, slope)[:, :, rows, :] without the pos x pos matrix."""
    _check_positions(rows, q.shape[1], "rows")
    i = torch.arange(q.shape[1], device=q.device, dtype=slope.dtype)
    return einsum(q[:, rows], k, "b r h c, b i h c -> b h r i") * _decay(slope, rows.to(slope.dtype)[:, None] - i)


def lightning_kernel_cols(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    slope: Float[Tensor, "n_heads"],
    cols: Int[Tensor, "col"],
) -> Float[Tensor, "batch n_heads q_pos col"]:
    """lightning_kernel(q, k, slope)[:, :, :, cols] without the pos x pos matrix."""
    _check_positions(cols, q.shape[1], "cols")
    j = torch.arange(q.shape[1], device=q.device, dtype=slope.dtype)
    return einsum(q, k[:, cols], "b j h c, b n h c -> b h j n") * _decay(slope, j[:, None] - cols.to(slope.dtype))


def lightning_knockout(
    q: Float[Tensor, "batch pos n_heads d_key"],
    k: Float[Tensor, "batch pos n_heads d_key"],
    v: Float[Tensor, "batch pos n_heads d_value"],
    slope: Float[Tensor, "n_heads"],
    row: Int[Tensor, "pair"],
    j: Int[Tensor, "pair"],
    i: Int[Tensor, "pair"],
    heads: Int[Tensor, "head"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_value"]:
    """sum over the cut pairs (row, j <- i) of K[row, h, j, i] v[row, i] at (row, j), on `heads` (None: all):
    what y loses when those edges are cut (pair_cut.py). No pos x pos tensor."""

    def entries(r: Tensor, jj: Tensor, ii: Tensor) -> Tensor:  # [pair h]: lambda^(j - i) (q_j . k_i)
        return (q[r, jj] * k[r, ii]).sum(-1) * torch.exp(-slope * (jj - ii).to(slope.dtype)[:, None])

    return pair_cut(entries, v, row, j, i, heads, width=max(q.shape[3], v.shape[3]))
