"""Metrics for circuits: per-prompt answers, KL to the clean run, and how a metric follows the prompts into chunks.

Glossary
    metric     `metric(logits) -> scalar tensor`, a mean over the prompts of the batch it is given, or
               `metric(logits, clean_logits)`: one that also reads the clean run's logits (`KL`)
    arity      decided once per call by `reads_clean(metric)`: its `reads_clean` attribute when it has one,
               else its signature: two positional parameters without a default read the clean logits, one
               does not (a `clean_logits=None` default counts as not read). The clean logits are those of the
               unpatched clean run of the same prompts (and tail), taken once per chunk from a forward the
               method runs anyway (EAP: its clean gradient run; EAP-IG: its clean recording); verification
               runs one clean forward per chunk for them. Such a metric is given them bound (`with_clean`),
               so every run calls a one-argument metric.
    rows       circuits run prompts in chunks (`batch_size=`) and tile them (replicas): a metric holding
               per-prompt data (answer ids) gives its chunk's version with `metric.rows(part)` (part: a
               slice of the prompts); a metric without `rows` must not depend on which prompts it sees
    tail       a metric that reads only the last k positions' logits, and indexes them from the end, says
               so with `metric.tail = k`: circuit runs then unembed only those positions (the logits it is
               given are [batch k d_vocab]; the unembedding of a 49k vocabulary is a fifth of a small
               model's forward). Without `tail` (or None) it gets every position's logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hooked.validate import Integer, WrongType, as_index, check, checked, metric_name, token_ids


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


class KL:
    """Mean over prompts of KL(clean || run) at position `pos`: sum_v p_clean(v) (log p_clean(v) - log p(v)).
    0 on the clean run; reads the clean logits (`metric(logits, clean_logits)`, see the glossary)."""

    reads_clean = True

    @checked(pos=Integer())
    def __init__(self, pos: int = -1) -> None:
        self.pos = pos
        self.tail = -pos if pos < 0 else None

    def __call__(self, logits: Tensor, clean_logits: Tensor) -> Tensor:
        if clean_logits.shape != logits.shape:
            raise ValueError(f"KL: logits {tuple(logits.shape)} and clean_logits {tuple(clean_logits.shape)} differ")
        i = as_index(self.pos, logits.shape[1], "KL: pos", "positions of the logits")
        run = logits[:, i].log_softmax(-1)
        clean = clean_logits[:, i].to(run).log_softmax(-1)
        return (clean.exp() * (clean - run)).sum(-1).mean()

    def rows(self, part: slice) -> "KL":
        return self  # no per-prompt data


def reads_clean(metric: Callable[..., Tensor]) -> bool:
    """Whether the metric is `metric(logits, clean_logits)` (the glossary's rule), refused by name when it
    takes neither one nor two arguments."""
    flag = getattr(metric, "reads_clean", None)
    if flag is not None:
        return bool(flag)
    try:
        params = inspect.signature(metric).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the plain form
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    if len(required) not in (1, 2):
        raise WrongType(f"{metric_name(metric)} takes {len(required)} arguments without a default: circuits call "
                        "metric(logits) or metric(logits, clean_logits)")
    return len(required) == 2


class WithClean:
    """A metric reading the clean logits, bound to them (`clean` None: to the logits of the run itself,
    detached: the clean gradient run of EAP, whose own logits are the clean ones; they are kept in
    `.clean` once seen). Keeps the metric's `tail` and name."""

    def __init__(self, metric: Callable[..., Tensor], clean: Tensor | None = None) -> None:
        self.metric, self.clean = metric, None if clean is None else clean.detach()
        self.tail = getattr(metric, "tail", None)
        self.__qualname__ = getattr(metric, "__qualname__", None) or type(metric).__name__

    def __call__(self, logits: Tensor) -> Tensor:
        if self.clean is None:
            self.clean = logits.detach()
        return self.metric(logits, self.clean)


def with_clean(metric: Callable[..., Tensor], clean: Tensor | None = None) -> Callable[[Tensor], Tensor]:
    """The one-argument form of `metric` (see the glossary): bound to `clean` when it reads the clean logits,
    else the metric itself."""
    return WithClean(metric, clean) if reads_clean(metric) else metric
