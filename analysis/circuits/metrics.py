"""Metrics for circuits: per-prompt answers, and how a metric follows the prompts into chunks.

Glossary
    metric     `metric(logits) -> scalar tensor`, a mean over the prompts of the batch it is given
    rows       circuits run prompts in chunks (`batch_size=`) and tile them (replicas): a metric holding
               per-prompt data (answer ids) gives its chunk's version with `metric.rows(part)` (part: a
               slice of the prompts); a metric without `rows` must not depend on which prompts it sees
    tail       a metric that reads only the last k positions' logits, and indexes them from the end, says
               so with `metric.tail = k`: circuit runs then unembed only those positions (the logits it is
               given are [batch k d_vocab]; the unembedding of a 49k vocabulary is a fifth of a small
               model's forward). Without `tail` (or None) it gets every position's logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class AnswerDiff:
    """Mean over prompts of logit[right] - logit[wrong] at position `pos` (ids per prompt); without `wrong`,
    the log-probability of `right`."""

    def __init__(self, right: Any, wrong: Any = None, pos: int = -1) -> None:
        self.right = torch.as_tensor(right).reshape(-1)
        self.wrong = None if wrong is None else torch.as_tensor(wrong).reshape(-1)
        if self.wrong is not None and self.wrong.shape != self.right.shape:
            raise ValueError(f"right and wrong need one id per prompt each, got {tuple(self.right.shape)} and "
                             f"{tuple(self.wrong.shape)}")
        self.pos = pos
        self.tail = -pos if pos < 0 else None  # it reads logits[:, pos]: from the end when pos < 0

    def __call__(self, logits: Tensor) -> Tensor:
        x = logits[:, self.pos]
        if x.shape[0] != len(self.right):
            raise ValueError(f"AnswerDiff holds {len(self.right)} prompts, the logits {x.shape[0]}: use .rows(part)")
        rows = torch.arange(x.shape[0], device=x.device)
        if self.wrong is None:
            return x.log_softmax(-1)[rows, self.right.to(x.device)].mean()
        return (x[rows, self.right.to(x.device)] - x[rows, self.wrong.to(x.device)]).mean()

    def rows(self, part: slice) -> "AnswerDiff":
        return AnswerDiff(self.right[part], None if self.wrong is None else self.wrong[part], self.pos)


def tail_of(metric: Callable[[Tensor], Tensor]) -> int | None:
    """The number of final positions the metric reads (see the glossary), or None for all of them."""
    tail = getattr(metric, "tail", None)
    if tail is None:
        return None
    if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
        raise ValueError(f"metric.tail must be a positive integer (the last positions it reads) or None, got {tail!r}")
    return tail


def at_rows(metric: Callable[[Tensor], Tensor], part: slice) -> Callable[[Tensor], Tensor]:
    """The metric for the prompts `part` (see the glossary)."""
    rows = getattr(metric, "rows", None)
    return rows(part) if callable(rows) else metric
