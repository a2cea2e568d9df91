"""Metrics for circuits: per-prompt answers, and how a metric follows the prompts into chunks.

Glossary
    metric     `metric(logits) -> scalar tensor`, a mean over the prompts of the batch it is given
    rows       circuits run prompts in chunks (`batch_size=`) and tile them (replicas): a metric holding
               per-prompt data (answer ids) gives its chunk's version with `metric.rows(part)` (part: a
               slice of the prompts); a metric without `rows` must not depend on which prompts it sees
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


def at_rows(metric: Callable[[Tensor], Tensor], part: slice) -> Callable[[Tensor], Tensor]:
    """The metric for the prompts `part` (see the glossary)."""
    rows = getattr(metric, "rows", None)
    return rows(part) if callable(rows) else metric
