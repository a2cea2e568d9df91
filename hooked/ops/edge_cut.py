"""Knockout's arithmetic: what a cut edge (target j <- source i) removes, as pure tensor functions.

Glossary
    target, source  bool masks [batch pos]; an edge (j, i) is cut when target[j] and source[i] and i <= j
    attention_cut   on hook_attn_scores ("scores": -inf, the row renormalises) or hook_pattern
                    ("pattern": zeroed after the softmax)
    kernel_cut      sum over cut sources of K[j, i] u_i: what an SSM's y_j loses (the D skip is never cut)
    conv_cut        sum over cut sources in the window of weight[:, w-1-(j-i)] * conv_in[i]: what the
                    causal conv's output at j loses
The mixers (hooked/models: attention.py, mamba.py, mamba2.py) turn these into hooks on their own
hook points (`TokenMixer.cut_edges`); analysis.interventions.knockout picks the layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from jaxtyping import Bool
from torch import Tensor

_PAIR_ELEMENTS = 2**22  # elements of the per-chunk [pair channel (d_head)] tensors


def edge_pairs(target: Tensor, source: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(batch row, target j, source i) of every causal cut edge (i <= j)."""
    batch, pos = target.shape
    if batch * pos * pos <= 2**22:  # small: one dense [batch pos pos] bool mask
        causal = torch.ones(pos, pos, dtype=torch.bool, device=target.device).tril()
        row, j, i = (target[:, :, None] & source[:, None, :] & causal).nonzero(as_tuple=True)
        return row, j, i
    rows, js, iss = [], [], []
    for b in range(batch):  # long sequences: row by row, |targets| x |sources| each
        j, i = target[b].nonzero()[:, 0], source[b].nonzero()[:, 0]
        jj, ii = torch.meshgrid(j, i, indexing="ij")
        keep = ii <= jj
        rows.append(torch.full((int(keep.sum()),), b, dtype=torch.long, device=target.device))
        js.append(jj[keep])
        iss.append(ii[keep])
    return torch.cat(rows), torch.cat(js), torch.cat(iss)


def attention_cut(scores_or_pattern: Tensor, cut: Bool[Tensor, "batch q k"], mode: str) -> tuple[Tensor, Tensor]:
    """Apply a cut to hook_attn_scores ("scores") or hook_pattern ("pattern"); see the module doc.

    Returns the edited tensor and, for "scores", the rows left with no visible key ([batch heads q]).
    """
    cut = cut[:, None]  # [batch 1 q k], every head
    x = scores_or_pattern
    if mode == "pattern":
        return x.masked_fill(cut, 0.0), cut.new_zeros(())
    live = x > torch.finfo(x.dtype).min / 2  # visible before the cut (causal, not padding)
    dead = (live & cut).any(-1) & ~(live & ~cut).any(-1)
    return x.masked_fill(cut, float("-inf")), dead


def kernel_cut(pairs_fn: Callable[..., Tensor], u: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor,
               target: Tensor, source: Tensor, channels: Tensor | None) -> Tensor:
    """sum_{i cut} K[j, i] u_i at every target j: the amount to subtract from y (same shape as u).

    `pairs_fn(dt, A, B, C, row, j, i) -> [pair c]` gives the kernel entries of the cut pairs (the
    mixer's: mamba1_kernel_pairs for u [batch pos d_inner], mamba2_kernel_pairs for u [batch pos
    n_heads d_head]); the pairs are cut into chunks, so memory is O(chunk * channels).
    """
    row, j, i = edge_pairs(target, source)
    out_dtype = u.dtype
    work = torch.promote_types(u.dtype, torch.float32)  # at least float32, as the scan computes
    u, dt, B, C, A = (x.to(work) for x in (u, dt, B, C, A))
    delta = torch.zeros_like(u)
    per_pair = math.prod(u.shape[2:]) * (A.shape[-1] if A.ndim == 2 else 1)
    chunk = max(1, _PAIR_ELEMENTS // per_pair)
    for s in range(0, len(row), chunk):
        r, jj, ii = row[s : s + chunk], j[s : s + chunk], i[s : s + chunk]
        entry = pairs_fn(dt, A, B, C, r, jj, ii)  # [pair c]
        term = entry.reshape(entry.shape + (1,) * (u.ndim - 3)) * u[r, ii]  # [pair c (d_head)]
        delta = delta.index_put((r, jj), term, accumulate=True)
    if channels is not None:
        delta = delta * channels.to(delta.device).reshape((-1,) + (1,) * (u.ndim - 3)).to(delta.dtype)
    return delta.to(out_dtype)


def conv_cut(conv_in: Tensor, weight: Tensor, target: Tensor, source: Tensor,
             conv_channels: Tensor | None) -> Tensor:
    """sum over sources i in the window of target j of weight[:, w-1-(j-i)] * conv_in[i]: to subtract."""
    width = weight.shape[1]
    delta = torch.zeros_like(conv_in)
    for lag in range(min(width, conv_in.shape[1])):
        shifted_src = torch.zeros_like(source)
        shifted_src[:, lag:] = source[:, : source.shape[1] - lag]  # source at j - lag, seen from j
        hit = (target & shifted_src)[..., None].to(conv_in.dtype)
        shifted_in = torch.zeros_like(conv_in)
        shifted_in[:, lag:] = conv_in[:, : conv_in.shape[1] - lag]
        delta = delta + hit * weight[:, width - 1 - lag].to(conv_in.dtype) * shifted_in
    if conv_channels is not None:
        delta = delta * conv_channels.to(delta.device, delta.dtype)
    return delta


def conv_channels(channels: Tensor | None, n_conv: int, d_inner: int) -> Tensor | None:
    """Conv channels of the cut channels/heads; channels past d_inner (shared B, C) only if all are cut."""
    if channels is None:
        return None
    mask = torch.zeros(n_conv, dtype=torch.bool)
    mask[:d_inner] = channels.repeat_interleave(d_inner // channels.shape[0])
    return mask
