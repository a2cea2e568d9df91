"""Hashed n-gram ids (Qwen4-Exp's per-layer embeddings, HF Qwen4ExpTextNGramEmbedding): pure functions.

Glossary
    ngram_size  N: the n-grams of orders 2..N of the tokens ending at each position
    heads       heads_per_ngram hashed tables per order; n_heads = (N - 1) * heads_per_ngram in all
    ple_index   which PLE layer (0, 1, ..: its rank among ple_layer_ids): its seeds and table sizes
    eos         the end-of-sequence id: a document boundary. The tokens before a position, counted back
                within its document only, make its n-gram; where the document (or the sequence) is too short,
                eos stands in. Padding is read as eos.

    shifted_k[t]   = tokens[t - k] if t - k is in t's document, else eos              (k = 0 .. N-1)
    mixed_n[t]     = xor_{k < n} shifted_k[t] * multiplier_k                          (int64, exact)
    id[t, head]    = offset_head + mixed_n[t] mod size_head    (head of order n; size_head a prime >= base)

Multipliers come from splitmix64 of (seed + 10007 * ple_index); the sizes are the consecutive primes after
`base - 1`, numbered across the PLE layers' heads, so every head of every layer has its own table.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Int
from torch import Tensor

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multiplier of each of the N positions of an n-gram, below 2^63 / vocab (so products fit int64)."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (k + 1)) & _MASK64) % half) + 1 for k in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def table_sizes(base: int, n_heads: int, ple_index: int) -> list[int]:
    """The prime table size of each head of PLE layer `ple_index`: primes number ple_index * n_heads + 1, ..
    after base - 1."""
    sizes, prime, count = [], base - 1, 0
    while len(sizes) < n_heads:
        prime += 1
        while not _is_prime(prime):
            prime += 1
        count += 1
        if count > ple_index * n_heads:
            sizes.append(prime)
    return sizes


def shifted(tokens: Int[Tensor, "batch pos"], shift: int, eos: int) -> Int[Tensor, "batch pos"]:
    """tokens[t - shift] where that token is in t's document (no eos between them, t - shift >= 0), else eos."""
    if shift == 0:
        return tokens
    batch, pos = tokens.shape
    t = torch.arange(pos, device=tokens.device)
    last_eos = torch.where(tokens == eos, t, -1).cummax(dim=1).values  # the latest eos at or before t
    start = torch.cat([last_eos.new_full((batch, 1), -1), last_eos[:, :-1]], dim=1) + 1  # t's document start
    source = t - shift
    out = tokens.gather(1, source.clamp_min(0).expand(batch, pos))
    return torch.where((t - start >= shift) & (source >= 0), out, torch.full_like(tokens, eos))


def ngram_ids(history: Int[Tensor, "batch hist"], mults: Tensor, sizes: Tensor, offsets: Tensor, ngram_size: int,
              heads_per_ngram: int, eos: int) -> Int[Tensor, "batch hist n_heads"]:
    """Each position's row in the concatenated tables, per head (orders 2..N, heads_per_ngram heads each)."""
    shifts = [shifted(history, k, eos) for k in range(ngram_size)]
    blocks = []
    for n in range(2, ngram_size + 1):
        mixed = shifts[0] * mults[0]
        for k in range(1, n):
            mixed = torch.bitwise_xor(mixed, shifts[k] * mults[k])
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[..., None], sizes[heads]) + offsets[heads])
    return torch.cat(blocks, dim=-1)
