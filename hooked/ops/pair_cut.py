"""What a linear-attention mixer's output loses when kernel edges are cut, pair by pair (no pos x pos tensor).

Glossary (shape word, einops letter, symbol)
    batch      b
    pos        l          position; an edge is target j <- source i (i <= j), of one batch row
    n_heads    h          heads: an edge is cut on every head or on the listed ones
    d_v        v          value channels
    pair                  one cut edge: (row, j, i)
    entries               K[row, h, j, i] for a chunk of pairs: [pair n_heads] (the mixer's own kernel entries)

For a mixer whose output is y_j = sum_{i <= j} K[h, j, i] v_i + (the initial state's read, not a kernel term)
(lightning attention, the mLSTM with its normaliser N_j held), cutting the edges removes
    loss[row, j, h] = sum over the cut pairs (row, j <- i) of K[row, h, j, i] v[row, i, h]
and y - loss is the cut output. Repeated pairs are removed once per repeat.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

PAIR_ELEMENTS = 2**22  # elements of one chunk's [pair n_heads width] tensors


def pair_cut(
    entries: Callable[[Tensor, Tensor, Tensor], Tensor],
    v: Float[Tensor, "batch pos n_heads d_v"],
    row: Int[Tensor, "pair"],
    j: Int[Tensor, "pair"],
    i: Int[Tensor, "pair"],
    heads: Int[Tensor, "head"] | None = None,
    width: int = 1,
) -> Float[Tensor, "batch pos n_heads d_v"]:
    """sum over the pairs (row, j <- i) of entries(row, j, i) [pair n_heads] times v[row, i] at (row, j), on
    `heads` (None: all). Pairs in chunks of at most PAIR_ELEMENTS / (n_heads width) (width: the widest
    per-head vector `entries` forms, e.g. max(d_qk, d_v))."""
    out = torch.zeros_like(v)
    step = max(1, PAIR_ELEMENTS // max(1, v.shape[2] * width))
    for a in range(0, len(row), step):
        r, jj, ii = row[a:a + step], j[a:a + step], i[a:a + step]
        out.index_put_((r, jj), entries(r, jj, ii)[..., None] * v[r, ii], accumulate=True)
    if heads is not None:
        keep = torch.zeros(v.shape[2], dtype=torch.bool, device=v.device)
        keep[heads] = True
        out = out * keep[:, None].to(out.dtype)
    return out
