"""Prompts of different lengths for circuits: one left-padded batch, whatever form the user gives.

Glossary
    prompts       what edge_attribution, verify_circuit and the sweeps take as clean / corrupt:
                  a token batch [batch pos] (with its `attention_mask` when padded, on either side),
                  a list of strings (model.tokenizer, special tokens added as `HookedModel.tokenize` adds
                  them), a list of 1-D token tensors (or lists of ids), or a list of `Example`s
    Prompts       the normalised record: `tokens` [batch width] left-padded (each prompt's last token in the
                  last column), `attention_mask` [batch width] bool (None when no prompt is padded: the
                  plain causal path, bit-identical and no slower), `lengths` [batch] real tokens per prompt;
                  width = the longest prompt (columns no prompt uses are dropped)
    left-aligned  internally every batch is padded on the LEFT (a right-padded batch is moved, row by row):
                  logits[:, -1] is each prompt's last token, so a metric that reads positions from the end
                  (AnswerDiff(pos=-1), `metric.tail`) sees each prompt's own; a position counted from the
                  start would include the padding and is refused for AnswerDiff
    pad id        pad positions hold PAD in clean and corrupt alike. No real position reads a pad position
                  (every family's attention_mask path: masked keys, SSM / delta-rule inputs zeroed), so the
                  metric's gradients there are exactly 0 and a patch there reaches no real position. Their
                  activations may still differ between clean and corrupt (a left-pad query's attention row
                  has no visible key: uniform over every key), so EAP zeroes the sender diffs there
                  (`pad_free`): pad positions add nothing to any score or patched run.
    pair          clean prompt b and corrupt prompt b must have one length (the edges patch position by
                  position); pairs of different lengths are refused, naming them
    rows(part)    the prompts of a chunk (batch_size=), trimmed to the chunk's longest prompt
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from analysis.circuits.metrics import AnswerDiff, tail_of

PAD = 0  # the id at pad positions: never read by a real position, the same in clean and corrupt


@dataclass(frozen=True)
class Prompts:
    tokens: Tensor  # [batch width] long, left-padded
    attention_mask: Tensor | None  # [batch width] bool; None when nothing is padded
    lengths: Tensor  # [batch] long (cpu)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def padded(self) -> bool:
        return self.attention_mask is not None

    def rows(self, part: slice) -> "Prompts":
        """The prompts `part`, trimmed to their longest (no mask when they have one length)."""
        lengths = self.lengths[part]
        w = int(lengths.max())
        tokens = self.tokens[part, self.width - w:]
        mask = None if self.attention_mask is None or int(lengths.min()) == w else self.attention_mask[part, self.width - w:]
        return Prompts(tokens, mask, lengths)


def unpadded(tokens: Tensor) -> Prompts:
    """A batch of one length as Prompts (for callers holding plain token ids)."""
    return Prompts(tokens, None, torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long))


def _rows_of(model: Any, x: Sequence[Any], what: str) -> list[Tensor]:
    """Each prompt of a list as 1-D token ids."""
    from analysis.tasks.text import Example, encode, tokenizer_of

    if all(isinstance(e, str) for e in x):
        tok = tokenizer_of(model)
        return [torch.tensor(encode(tok, e), dtype=torch.long) for e in x]
    if all(isinstance(e, Example) for e in x):
        tok = tokenizer_of(model)
        return [torch.tensor(encode(tok, e.prompt), dtype=torch.long) for e in x]
    rows = []
    for k, e in enumerate(x):
        if isinstance(e, (str, Example)):
            raise TypeError(f"{what}: a list mixes strings or Examples with token ids (item {k})")
        t = e if torch.is_tensor(e) else torch.as_tensor(e)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{what}[{k}]: token ids must be integers, got {t.dtype}")
        if t.ndim != 1:
            raise ValueError(f"{what}[{k}]: a prompt must be 1-D token ids, got shape {tuple(t.shape)}")
        rows.append(t.long().cpu())
    return rows


def _left(rows: list[Tensor], device: Any) -> Prompts:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    w = int(lengths.max())
    tokens = torch.full((len(rows), w), PAD, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, w - len(r):] = r
    mask = None
    if int(lengths.min()) < w:
        mask = torch.arange(w)[None] >= (w - lengths)[:, None]
        mask = mask.to(device)
    return Prompts(tokens.to(device), mask, lengths)


def _from_mask(tokens: Tensor, attention_mask: Any, what: str) -> Prompts:
    """A [batch pos] batch padded on either side, given with its mask, moved to the left."""
    mask = torch.as_tensor(attention_mask).to(tokens.device)
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, {what} has {tuple(tokens.shape)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    real = mask.bool()
    lengths = real.sum(1)
    starts = real[:, :1].long().sum(1) + (real[:, 1:] & ~real[:, :-1]).sum(1)  # runs of real tokens per row
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask: {what} rows {empty[:10]} have no real token")
    holes = (starts != 1).nonzero().flatten().tolist()
    if holes:
        raise ValueError(f"attention_mask: {what} rows {holes[:10]} have padding between real tokens; pad on the "
                         "left or the right only")
    if bool(real.all()):
        return unpadded(tokens)
    first = real.long().argmax(1)  # the first real token of each row
    w = int(lengths.max())
    col = torch.arange(w, device=tokens.device)[None]
    offset = col - (w - lengths)[:, None]  # position within the prompt; < 0 at pad columns
    src = (first[:, None] + offset).clamp(0, tokens.shape[1] - 1)
    keep = offset >= 0
    out = torch.where(keep, tokens.gather(1, src), torch.full_like(src, PAD))
    return Prompts(out, None if int(lengths.min()) == w else keep, lengths.cpu())


def prompts_of(model: Any, x: Any, attention_mask: Any = None, what: str = "prompts") -> Prompts:
    """`x` (see the glossary) as a left-padded Prompts record on the model's device."""
    if torch.is_tensor(x):
        tokens = model.check_tokens(x).to(model.device)
        if attention_mask is None:
            return unpadded(tokens)
        return _from_mask(tokens, attention_mask, what)
    if attention_mask is not None:
        raise ValueError(f"attention_mask goes with a token batch [batch pos]; {what} is a list, padded here")
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{what}: expected token ids [batch pos], or a list of strings, 1-D token tensors or "
                        f"Examples, got {type(x).__name__}")
    if len(x) == 0:
        raise ValueError(f"{what}: no prompts")
    rows = _rows_of(model, x, what)
    short = [k for k, r in enumerate(rows) if len(r) == 0]
    if short:
        raise ValueError(f"{what}: prompts {short[:10]} have no tokens")
    out = _left(rows, model.device)
    model.check_tokens(out.tokens)  # ids outside the vocabulary, named
    return out


def prompt_pair(model: Any, clean: Any, corrupt: Any, attention_mask: Any = None,
                metric: Callable[[Tensor], Tensor] | None = None) -> tuple[Prompts, Prompts]:
    """(clean, corrupt) as Prompts, each pair of one length (see the glossary). `attention_mask`: the padding
    of both token batches. With `metric`, refuses what it would read at pad positions."""
    a = prompts_of(model, clean, attention_mask, "clean")
    b = prompts_of(model, corrupt, attention_mask, "corrupt")
    if a.batch != b.batch:
        raise ValueError(f"clean has {a.batch} prompts, corrupt {b.batch}")
    if not torch.equal(a.lengths, b.lengths):
        bad = (a.lengths != b.lengths).nonzero().flatten().tolist()
        shown = ", ".join(f"{k} ({int(a.lengths[k])} clean, {int(b.lengths[k])} corrupt tokens)" for k in bad[:5])
        raise ValueError(f"each clean prompt and its corrupt must have one length: prompts {shown}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    if metric is not None and a.padded:
        check_metric(metric, a)
    return a, b


def check_metric(metric: Callable[[Tensor], Tensor], prompts: Prompts) -> None:
    """A metric on a padded batch must read positions from the end, within every prompt."""
    tail = tail_of(metric)
    shortest = int(prompts.lengths.min())
    if tail is not None and tail > shortest:
        raise ValueError(f"the metric reads the last {tail} positions (metric.tail) but a prompt has only "
                         f"{shortest} tokens: it would read padding")
    if isinstance(metric, AnswerDiff) and metric.pos >= 0:
        raise ValueError(f"AnswerDiff(pos={metric.pos}) counts from the start, which padding shifts: give the "
                         "position from the end (pos < 0) for prompts of different lengths")


def pad_free(x: Tensor | None, attention_mask: Tensor) -> Tensor | None:
    """x [... batch pos d] with every pad position set to 0 (in place)."""
    if x is None:
        return None
    return x.masked_fill_(~attention_mask.to(x.device)[..., None], 0.0)
