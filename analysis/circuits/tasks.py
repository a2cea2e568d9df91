"""Clean / corrupt prompt pairs for circuits, with their metric.

Glossary
    kv pair    the organisms' key-value task (analysis.tasks.token_kv): clean = a context of n pairs and a
               query; the corrupt prompt differs so that its answer is another pair's value:
               "swap"   the queried pair's key and another pair's key trade places (the context's layout
                        changes where the queried key sits: what gathers keys into their pairs matters)
               "query"  the query asks for the other pair's key (what carries the query matters)
    fact pair  two known facts (analysis.tasks.known_facts) of one relation template and token length with
               different answers: clean = one, corrupt = the other (the subject swapped)
    metric     AnswerDiff: logit(clean answer) - logit(corrupt answer) at the last position, mean over prompts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.metrics import AnswerDiff
from analysis.tasks import token_kv as kv
from analysis.tasks.text import tokenizer_of
from hooked.validate import Integer, check

CORRUPTIONS = ("swap", "query")


def kv_pairs(n: int = 8, n_samples: int = 32, seed: int = 0, fmt: str = "?k",
             corrupt: str = "swap") -> tuple[Tensor, Tensor, AnswerDiff]:
    """(clean, corrupt, metric) on `n_samples` seeded prompts with `n` pairs (see the glossary)."""
    if corrupt not in CORRUPTIONS:
        raise ValueError(f"corrupt must be one of {CORRUPTIONS}, got {corrupt!r}")
    check(n, "kv_pairs: n", Integer(ge=2))  # a corrupt prompt needs another pair
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


def fact_pairs(model: Any, facts: Sequence[dict[str, Any]] | None = None, n: int = 32,
               require_correct: bool = True, batch_size: int = 16) -> tuple[Tensor, Tensor, AnswerDiff, list[dict]]:
    """(clean, corrupt, metric, the clean facts) for known facts (analysis.tasks.known_facts): clean = a fact's
    prompt, corrupt = another fact of the same relation template whose prompt has as many tokens and another
    answer token (the subject swapped: what carries the subject to the last token matters). Metric: logit of
    the clean answer's first token minus the corrupt one's. Facts are paired within the token length that
    pairs the most; with require_correct, both facts of a pair are answered right (top-1) by the model.
    """
    from analysis.tasks.known_facts import load_facts, prepare_facts

    prompts, _ = prepare_facts(tokenizer_of(model), load_facts() if facts is None else facts)
    by_length: dict[int, list[Any]] = {}
    for p in prompts:
        by_length.setdefault(len(p.ids), []).append(p)
    best: list[tuple[Any, Any]] = []
    for length in sorted(by_length, key=lambda k: -len(_pairs(by_length[k]))):  # most pairable lengths first
        if len(_pairs(by_length[length])) <= len(best):
            break  # no later length can pair more, even before screening
        members = by_length[length]
        if require_correct:  # one length: batches without padding
            keep = []
            with torch.no_grad():
                for s in range(0, len(members), batch_size):
                    part = members[s:s + batch_size]
                    top = model(torch.tensor([p.ids for p in part], device=model.device))[:, -1].argmax(-1)
                    keep += [p for p, t in zip(part, top.tolist()) if t == p.answer]
            members = keep
        pairs = _pairs(members)
        if len(pairs) > len(best):
            best = pairs
        if len(best) >= n:
            break
    if not best:
        raise ValueError("no two facts share a template and a token length with different answers")
    chosen = best[:n]
    clean = torch.tensor([a.ids for a, _ in chosen], device=model.device)
    corrupt = torch.tensor([b.ids for _, b in chosen], device=model.device)
    metric = AnswerDiff([a.answer for a, _ in chosen], [b.answer for _, b in chosen])
    return clean, corrupt, metric, [a.fact for a, _ in chosen]


def _pairs(prompts: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Each fact with the next one of its template (cyclically) that has another answer."""
    by_template: dict[str, list[Any]] = {}
    for p in prompts:
        by_template.setdefault(p.fact.get("template", ""), []).append(p)
    out = []
    for members in by_template.values():
        for i, a in enumerate(members):
            b = next((members[(i + k) % len(members)] for k in range(1, len(members))
                      if members[(i + k) % len(members)].answer != a.answer), None)
            if b is not None:
                out.append((a, b))
    return out
