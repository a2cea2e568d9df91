"""Grouped Mamba-1 (Zamba's mixer): the d_inner channels in G equal groups, each group with its own B and C.

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch     b
    pos       l     L   sequence position; kernel rows q_pos = target j, columns k_pos = source i
    d_inner   d     D   channel; group g holds channels [g P, (g + 1) P), P = d_inner / G
    n_groups  g     G   channel groups (HF Zamba's n_mamba_heads), each with its own x_proj and dt_proj
    d_state   n     N   state size per channel
    B, C      [batch pos n_groups d_state]: channel d of group g reads B[:, :, g] and C[:, :, g]

Recurrence, per channel d of group g (Mamba-1's, selective_scan.py, with the group's B and C):
    h_t[d] = exp(dt_t[d] A[d]) * h_{t-1}[d] + dt_t[d] B_t[g] u_t[d]        y_t[d] = C_t[g] . h_t[d]
Every function here is the Mamba-1 op run on each group's channels with that group's B and C, the results
concatenated along the channel axis; with G = 1 it is the Mamba-1 op itself (B[:, :, 0]). HF's Zamba
runs its scan the same way, one group at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import einsum, rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.fused import selective_scan_fused
from hooked.ops.scan_chunked import selective_scan_chunked
from hooked.ops.selective_kernel import mamba1_kernel_chunked, mamba1_kernel_cols, mamba1_kernel_rows
from hooked.ops.selective_scan import mamba1_kernel_discrete, mamba1_kernel_pairs, selective_scan


def _split(t: Tensor, groups: int, dim: int) -> tuple[Tensor, ...]:
    """The G equal channel blocks of t along dim."""
    return t.chunk(groups, dim=dim)


def _per_group(op: Callable[..., Tensor], dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *args, dim: int,
               **kwargs) -> Tensor:
    """op(dt_g, A_g, B_g, C_g, *args, **kwargs), a Mamba-1 kernel op, on each group g's channels with that
    group's B and C; the groups' results concatenated along `dim` (their channel axis)."""
    G = B.shape[2]
    return torch.cat([op(dt_g, A_g, B[:, :, g], C[:, :, g], *args, **kwargs)
                      for g, (dt_g, A_g) in enumerate(zip(_split(dt, G, -1), _split(A, G, 0)))], dim=dim)


def grouped_B_bar(
    dt: Float[Tensor, "batch pos d_inner"], B: Float[Tensor, "batch pos n_groups d_state"]
) -> Float[Tensor, "batch pos d_inner d_state"]:
    """B_bar = dt * B per channel, each channel reading its group's B (the Euler step, as Mamba-1)."""
    steps = rearrange(dt, "b l (g p) -> b l g p 1", g=B.shape[2])
    return rearrange(steps * B[:, :, :, None, :], "b l g p n -> b l (g p) n")


def grouped_read(
    h: Float[Tensor, "batch pos d_inner d_state"], C: Float[Tensor, "batch pos n_groups d_state"]
) -> Float[Tensor, "batch pos d_inner"]:
    """y = C . h per channel, each channel reading its group's C."""
    h = rearrange(h, "b l (g p) n -> b l g p n", g=C.shape[2])
    return rearrange(einsum(h, C, "b l g p n, b l g n -> b l g p"), "b l g p -> b l (g p)")


def grouped_scan(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    *,
    scan: Callable[..., tuple[Tensor, Tensor]] = selective_scan,
    **kwargs,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """(y, h_last) of `scan` (selective_scan, selective_scan_chunked or selective_scan_fused; kwargs go to it)
    run on each group with its B and C, from h0 (None: zeros)."""
    G = B.shape[2]
    h0s = _split(h0, G, 1) if h0 is not None else (None,) * G
    parts = [scan(u_g, dt_g, A_g, B[:, :, g], C[:, :, g], h0_g, **kwargs) for g, (u_g, dt_g, A_g, h0_g)
             in enumerate(zip(_split(u, G, -1), _split(dt, G, -1), _split(A, G, 0), h0s))]
    return torch.cat([y for y, _ in parts], dim=-1), torch.cat([h for _, h in parts], dim=1)


def grouped_scan_chunked(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    **kwargs,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """grouped_scan with the two-level scan (selective_scan_chunked)."""
    return grouped_scan(u, dt, A, B, C, h0, scan=selective_scan_chunked, **kwargs)


def grouped_kernel(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """The SSM as attention per channel (mamba1_kernel_chunked per group): y_j = sum_i kernel[:, :, j, i] u_i."""
    return _per_group(mamba1_kernel_chunked, dt, A, B, C, dim=1)


def grouped_kernel_discrete(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    B_bar: Float[Tensor, "batch pos d_inner d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """The kernel from discrete (possibly edited) A_bar, B_bar (mamba1_kernel_discrete per group)."""
    G = C.shape[2]
    return torch.cat([mamba1_kernel_discrete(a, b, C[:, :, g])
                      for g, (a, b) in enumerate(zip(_split(A_bar, G, 2), _split(B_bar, G, 2)))], dim=1)


def grouped_kernel_pairs(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    batch_idx: Int[Tensor, "pair"],
    target: Int[Tensor, "pair"],
    source: Int[Tensor, "pair"],
    chunk: int | None = None,
) -> Float[Tensor, "pair d_inner"]:
    """grouped_kernel(dt, A, B, C)[batch_idx, :, target, source] without the pos x pos matrix."""
    return _per_group(mamba1_kernel_pairs, dt, A, B, C, batch_idx, target, source, chunk, dim=-1)


def grouped_kernel_rows(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    rows: Int[Tensor, "row"],
    **kwargs,
) -> Float[Tensor, "batch d_inner row k_pos"]:
    """grouped_kernel(dt, A, B, C)[:, :, rows] without the pos x pos matrix (mamba1_kernel_rows per group)."""
    return _per_group(mamba1_kernel_rows, dt, A, B, C, rows, dim=1, **kwargs)


def grouped_kernel_cols(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    cols: Int[Tensor, "col"],
    **kwargs,
) -> Float[Tensor, "batch d_inner q_pos col"]:
    """grouped_kernel(dt, A, B, C)[..., cols] without the pos x pos matrix (mamba1_kernel_cols per group)."""
    return _per_group(mamba1_kernel_cols, dt, A, B, C, cols, dim=1, **kwargs)


def grouped_scan_fused(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    **kwargs,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """grouped_scan through mamba-ssm's selective_scan_fn (or its stand-in), one group at a time."""
    return grouped_scan(u, dt, A, B, C, h0, scan=selective_scan_fused, **kwargs)
