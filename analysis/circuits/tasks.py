"""Clean / corrupt prompt pairs for circuits, with their metric.

Glossary
    kv pair    the organisms' key-value task (analysis.tasks.token_kv): clean = a context of n pairs and a
               query; the corrupt prompt differs so that its answer is another pair's value:
               "swap"   the queried pair's key and another pair's key trade places (the context's layout
                        changes where the queried key sits: what gathers keys into their pairs matters)
               "query"  the query asks for the other pair's key (what carries the query matters)
    metric     AnswerDiff: logit(clean answer) - logit(corrupt answer) at the last position, mean over prompts
"""

from __future__ import annotations

import torch
from torch import Tensor

from analysis.circuits.metrics import AnswerDiff
from analysis.tasks import token_kv as kv

CORRUPTIONS = ("swap", "query")


def kv_pairs(n: int = 8, n_samples: int = 32, seed: int = 0, fmt: str = "?k",
             corrupt: str = "swap") -> tuple[Tensor, Tensor, AnswerDiff]:
    """(clean, corrupt, metric) on `n_samples` seeded prompts with `n` pairs (see the glossary)."""
    if corrupt not in CORRUPTIONS:
        raise ValueError(f"corrupt must be one of {CORRUPTIONS}, got {corrupt!r}")
    if n < 2:
        raise ValueError(f"a corrupt prompt needs another pair: n >= 2, got {n}")
    p = kv.prompts(n, n_samples, seed, fmt)
    gen = torch.Generator().manual_seed(seed + 1)
    other = (p.answer + torch.randint(1, n, (n_samples,), generator=gen)) % n
    rows = torch.arange(n_samples)
    clean, bad = p.tokens, p.tokens.clone()
    key_of = lambda pair: 1 + 4 * pair  # noqa: E731  the pair's key position (after <bos>)
    if corrupt == "swap":
        bad[rows, key_of(p.answer)] = clean[rows, key_of(other)]
        bad[rows, key_of(other)] = clean[rows, key_of(p.answer)]
    else:
        bad[:, -2 if fmt == "k?" else -1] = clean[rows, key_of(other)]
    metric = AnswerDiff(p.choices[rows, p.answer], p.choices[rows, other])
    return clean, bad, metric
