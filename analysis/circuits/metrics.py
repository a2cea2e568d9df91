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

from hooked.validate import Integer, as_index, check, checked, token_ids


class AnswerDiff:
    """Mean over prompts of logit[right] - logit[wrong] at position `pos` (ids per prompt); without `wrong`,
    the log-probability of `right`."""

    @checked(pos=Integer())
    def __init__(self, right: Any, wrong: Any = None, pos: int = -1) -> None:
        self.right = token_ids(right, None, "AnswerDiff: right").reshape(-1)  # the vocabulary: at the call
        self.wrong = None if wrong is None else token_ids(wrong, None, "AnswerDiff: wrong").reshape(-1)
        if self.wrong is not None and self.wrong.shape != self.right.shape:
            raise ValueError(f"right and wrong need one id per prompt each, got {tuple(self.right.shape)} and "
                             f"{tuple(self.wrong.shape)}")
        self.pos = pos
        self.tail = -pos if pos < 0 else None  # it reads logits[:, pos]: from the end when pos < 0

    def __call__(self, logits: Tensor) -> Tensor:
        x = logits[:, as_index(self.pos, logits.shape[1], "AnswerDiff: pos", "positions of the logits")]
        if x.shape[0] != len(self.right):
            raise ValueError(f"AnswerDiff holds {len(self.right)} prompts, the logits {x.shape[0]}: use .rows(part)")
        rows = torch.arange(x.shape[0], device=x.device)
        right = token_ids(self.right, x.shape[-1], "AnswerDiff: right").to(x.device)
        if self.wrong is None:
            return x.log_softmax(-1)[rows, right].mean()
        return (x[rows, right] - x[rows, token_ids(self.wrong, x.shape[-1], "AnswerDiff: wrong").to(x.device)]).mean()

    def rows(self, part: slice) -> "AnswerDiff":
        return AnswerDiff(self.right[part], None if self.wrong is None else self.wrong[part], self.pos)


def tail_of(metric: Callable[[Tensor], Tensor]) -> int | None:
    """The number of final positions the metric reads (see the glossary), or None for all of them."""
    return check(getattr(metric, "tail", None), "metric.tail", Integer(ge=1, none=True))  # the last positions read


def at_rows(metric: Callable[[Tensor], Tensor], part: slice) -> Callable[[Tensor], Tensor]:
    """The metric for the prompts `part` (see the glossary)."""
    rows = getattr(metric, "rows", None)
    return rows(part) if callable(rows) else metric
