"""Shared-prefix choice scoring: each prompt is read once, then every choice continues it from the state.

Glossary
    prefix        the tokens every choice of an example shares (its prompt, minus a last token that a
                  choice merges into across the boundary): one left-padded row per example
    continuation  a choice's joint tokens after the prefix, minus the last (the choice's last token is
                  predicted, never read). Choices whose continuation extends another's share its row
                  (maximal contexts, as the whole-row path); a single-token choice needs none: the
                  prefix's last position predicts it.
    state         the prefix forward's DecodeState (hooked/models/decode_state.py), expanded to one
                  row per continuation (`select`: the prefix's keys and values are shared through a row
                  map, not copied per row); the continuation forward reads only its own tokens
    resume        (start_at_layer) the clean run's residual entering layer l, of the prefix and of the
                  continuation, plus the clean state of the blocks below l (`entries_of`): an
                  intervention at layer >= l reruns the prefix and the continuation from there only
    capture       one run that keeps the resume at chosen layers and the scores it made: the clean run
                  (kept by `ChoiceScorer(keep_clean=True)` for every later resume and the baseline), or a
                  run under an intervention from a resume, whose later resumes carry that intervention
                  (pair ablations sharing their first unit start at the second unit's layer)
    replicas      r copies of each forward in one (the prefix rows, then the continuation rows, tiled
                  r times: replica j owns the j-th block of rows in both forwards)

The scores equal the whole-row path's (tests: 1e-5 in float32 on GPT-2, Llama, Mamba, Mamba-2, Zamba2)
for hooks that act at each position alone (ablation, steering). A hook that indexes positions of the
whole sequence, or a `context(batch)` with segments, needs the whole-row path (`ChoiceScorer(...,
shared_prefix=False)`, or `scores(context=...)`, which uses it). An SSM's lazy hooks refuse the state
(`StateRefused`); `ChoiceScorer.scores` then falls back to the whole-row path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hooked.models.decode_state import DecodeState


@dataclass
class PrefixBatch:
    """Prefix rows (one per example) and the continuation rows that extend them."""

    tokens: Tensor  # [rows pos] left-padded prefixes
    attention_mask: Tensor | None  # [rows pos], None when nothing is padded
    examples: Tensor  # [rows] the example of each prefix row
    source: Tensor  # [crows] the prefix row each continuation row extends
    cont: Tensor | None  # [crows cpos] continuation tokens (right-filled); None when no choice needs one
    p_rows: Tensor  # [picks] prefix row whose last position predicts the target
    p_targets: Tensor
    p_owner: Tensor  # flat (example, choice) slot
    c_rows: Tensor  # [picks] continuation row and column predicting the target
    c_cols: Tensor
    c_targets: Tensor
    c_owner: Tensor


@dataclass
class Resume:
    """The clean run at one layer, for one batch: what `run` needs to start there."""

    state: DecodeState  # entries of the blocks below the layer, positions rewound
    prefix: Tensor  # [rows pos d_model] residual entering the layer
    cont: Tensor | None  # [crows cpos d_model]
    clean: bool = True  # False: from a run under an intervention (`capture` from a resume)


@dataclass
class Capture:
    """One run of a batch (`capture`): where to resume at each grabbed layer, and what it scored."""

    resumes: dict[int, Resume]
    scored: list[tuple[Tensor, Tensor]]  # (slot [picks], log-prob [1 picks]) per forward, as `run`


def build(joints: Sequence[Sequence[tuple[tuple[int, ...], int]]], n_choices: int, batch_size: int, pad: int,
          device: torch.device) -> list[PrefixBatch]:
    """joints[i][c] = (prompt + choice tokens, k: tokens shared with the prompt's own) per example and choice."""
    items = []  # (prefix ids, [continuation ids], picks [(continuation index or -1, col, target, slot)])
    for i, choices in enumerate(joints):
        s = min(k for _, k in choices)
        prefix = choices[0][0][:s]
        conts: list[tuple[int, ...]] = []
        for joint, _ in choices:
            need = joint[s:-1]
            if need and not any(ctx[: len(need)] == need for ctx in conts):
                conts = [ctx for ctx in conts if need[: len(ctx)] != ctx] + [need]
        picks = []
        for c, (joint, k) in enumerate(choices):
            need = joint[s:-1]
            home = next((n for n, ctx in enumerate(conts) if ctx[: len(need)] == need), -1)
            for p in range(k - 1, len(joint) - 1):
                picks.append((-1 if p == s - 1 else home, p - s, joint[p + 1], i * n_choices + c))
        items.append((prefix, conts, picks))
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    return [_batch([items[i] for i in order[a: a + batch_size]], order[a: a + batch_size], pad, device)
            for a in range(0, len(order), batch_size)]


def _batch(items: list, examples: list[int], pad: int, device: torch.device) -> PrefixBatch:
    width = max(len(prefix) for prefix, _, _ in items)
    tokens = torch.full((len(items), width), pad, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    conts = [(r, ctx) for r, (_, cs, _) in enumerate(items) for ctx in cs]
    cwidth = max((len(ctx) for _, ctx in conts), default=0)
    cont = torch.full((len(conts), max(cwidth, 1)), pad, dtype=torch.long)
    first = {}  # prefix row -> index of its first continuation row
    for n, (r, ctx) in enumerate(conts):
        cont[n, : len(ctx)] = torch.tensor(ctx)
        first.setdefault(r, n)
    p_picks, c_picks = [], []
    for r, (prefix, _, picks) in enumerate(items):
        tokens[r, width - len(prefix):] = torch.tensor(prefix)
        mask[r, width - len(prefix):] = 1
        for home, col, target, slot in picks:
            if home < 0:
                p_picks.append((r, target, slot))
            else:
                c_picks.append((first[r] + home, col, target, slot))

    def as_t(xs: list) -> Tensor:
        return torch.tensor(xs, dtype=torch.long, device=device)

    p = list(zip(*p_picks)) or [[], [], []]
    c = list(zip(*c_picks)) or [[], [], [], []]
    return PrefixBatch(tokens.to(device), None if bool(mask.all()) else mask.to(device), as_t(examples),
                       as_t([r for r, _ in conts]), cont.to(device) if conts else None,
                       *(as_t(x) for x in p), *(as_t(x) for x in c))


# ------------------------------------------------------------------------------- running
def run(model: Any, batch: PrefixBatch, replicas: int = 1, start_at_layer: int | None = None,
        resume: Resume | None = None) -> list[tuple[Tensor, Tensor]]:
    """(slot [picks], log-prob [replicas picks]) of every scored token, from the prefix forward and from the
    continuation forward (on the model's device, float32, on the autograd graph when it records)."""
    n, r = model.cfg.n_layers, replicas
    rows = len(batch.tokens)
    mask = None if batch.attention_mask is None else batch.attention_mask.repeat(r, 1)
    tokens = batch.tokens.repeat(r, 1)
    if start_at_layer is None:
        state = DecodeState()
        resid = model(tokens, mask, stop_at_layer=n, state=state)
    else:
        state = resume.state.select(torch.arange(rows, device=tokens.device).repeat(r))
        resid = model(resume.prefix.repeat(r, 1, 1), mask, start_at_layer=start_at_layer, stop_at_layer=n,
                      tokens=tokens, state=state)
    out = [_logp(model, resid[:, -1], _tiled(batch.p_rows, rows, r), batch.p_targets, batch.p_owner, r)]
    if batch.cont is None:
        return out
    crows = len(batch.cont)
    cstate, cont = state.select(_tiled(batch.source, rows, r)), batch.cont.repeat(r, 1)
    if start_at_layer is None:
        cresid = model(cont, stop_at_layer=n, state=cstate)
    else:
        cresid = model(resume.cont.repeat(r, 1, 1), start_at_layer=start_at_layer, stop_at_layer=n, tokens=cont,
                       state=cstate)
    flat = _tiled(batch.c_rows, crows, r) * cresid.shape[1] + batch.c_cols.repeat(r)
    return out + [_logp(model, cresid.flatten(0, 1), flat, batch.c_targets, batch.c_owner, r)]


def row_examples(batch: PrefixBatch) -> list[Tensor]:
    """The example of each row of each forward `run` makes (prefix, then continuations when any)."""
    return [batch.examples] + ([] if batch.cont is None else [batch.examples[batch.source]])


def _tiled(index: Tensor, rows: int, r: int) -> Tensor:
    """`index` into each of r replica blocks of `rows` rows, replica-major."""
    return (index[None] + rows * torch.arange(r, device=index.device)[:, None]).reshape(-1)


def _logp(model: Any, resid: Tensor, index: Tensor, targets: Tensor, owner: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """(owner, log-prob of `targets` [r picks]) read at rows `index` of resid [rows d_model] (r blocks of picks)."""
    if len(targets) == 0:
        return owner, resid.new_zeros(r, 0, dtype=torch.float32)
    return owner, picked_logp(model, resid, index, targets.repeat(r)).view(r, -1)


def picked_logp(model: Any, resid: Tensor, index: Tensor, targets: Tensor) -> Tensor:
    """log p(targets[i]) [picks] (float32) at the residual rows resid[index[i]] [rows d_model]. Each distinct row
    goes through the final norm and the unembedding once: the prompt's last position predicts the first
    token of every choice, a shared continuation's position the next token of each choice it carries."""
    if len(index) == 0:
        return resid.new_zeros(0, dtype=torch.float32)
    rows, where = torch.unique(index, return_inverse=True)
    logp = model.unembed(model.ln_final(resid[rows][None]))[0].float().log_softmax(-1)
    return logp[where, targets]


def capture(model: Any, batch: PrefixBatch, layers: Sequence[int], start_at_layer: int | None = None,
            resume: Resume | None = None, score: bool = True) -> Capture:
    """One run of the prefix and of the continuations under whatever hooks are active (from `resume` at
    `start_at_layer`, else from the tokens): the Resume at each of `layers` and the log-prob of every
    scored token, as `run` gives them. score=False: the run stops at the last of `layers` (nothing
    scored; the state holds the blocks below it only, all a resume there reads)."""
    layers = sorted(set(layers))
    if start_at_layer is not None and any(layer <= start_at_layer for layer in layers):
        raise ValueError(f"capture from layer {start_at_layer} grabs later layers only, got {layers}")
    if not score and not layers:
        raise ValueError("capture with score=False needs a layer to stop at")
    rows = len(batch.tokens)
    stop = None if score else layers[-1]
    if start_at_layer is None:
        state, x = DecodeState(), batch.tokens
        prefix, resid = _grab(model, x, batch.attention_mask, layers, state, stop=stop)
    else:
        state, x = resume.state.select(torch.arange(rows, device=batch.tokens.device)), resume.prefix
        prefix, resid = _grab(model, x, batch.attention_mask, layers, state, start_at_layer, batch.tokens, stop)
    states = _resume_states(model, state, layers, batch.attention_mask, x, stopped=resid is None)
    scored = [] if not score else [_logp(model, resid[:, -1], batch.p_rows, batch.p_targets, batch.p_owner, 1)]
    cont: dict[int, Tensor] = {}
    if batch.cont is not None:  # their state is left as the run leaves it: the resumes keep the prefix's
        x = batch.cont if start_at_layer is None else resume.cont
        cont, cresid = _grab(model, x, None, layers, state.select(batch.source), start_at_layer, batch.cont, stop)
        if score:
            flat = batch.c_rows * cresid.shape[1] + batch.c_cols
            scored.append(_logp(model, cresid.flatten(0, 1), flat, batch.c_targets, batch.c_owner, 1))
    out = {layer: Resume(states[layer], prefix[layer], cont.get(layer), start_at_layer is None) for layer in layers}
    return Capture(out, scored)


def _resume_states(model: Any, state: DecodeState, layers: list[int], mask: Tensor | None, x: Tensor,
                   stopped: bool) -> dict[int, DecodeState]:
    """The prefix state a resume at each of `layers` reads: the entries of the blocks below it. stopped: the run
    ended entering a block, so the state advances here as the whole forward's own `state.advance` would (its
    mask: bool, None unpadded)."""
    if stopped:
        state.advance(None if mask is None else mask.bool(), *x.shape[:2], x.device)
    return {layer: state.entries_of([m for block in model.blocks[:layer] for m in block.modules()]) for layer in layers}


class _Enough(Exception):
    """Raised by `_grab`'s hook at its stop layer: the rest of the forward is not needed."""


def _grab(model: Any, x: Tensor, mask: Tensor | None, layers: list[int], state: DecodeState,
          start_at_layer: int | None = None, tokens: Tensor | None = None,
          stop: int | None = None) -> tuple[dict[int, Tensor], Tensor | None]:
    """(residual entering each of `layers` (their hook_resid_pre), final residual) of one run with `state`:
    from tokens `x`, or from the residual `x` entering `start_at_layer`. stop (one of `layers`): the run
    ends entering that block (final residual None; the state's new entries not committed: `_resume_states`)."""
    seen: dict[int, Tensor] = {}

    def keep(layer: int) -> Any:
        def hook(resid: Tensor, hook: Any) -> None:
            seen[layer] = resid.detach()
            if layer == stop:
                raise _Enough
        return hook

    hooks = [(model.blocks[layer].hook_resid_pre.name, keep(layer)) for layer in layers]
    n = model.cfg.n_layers
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            if start_at_layer is None:
                resid = model(x, mask, stop_at_layer=n, state=state)
            else:
                resid = model(x, mask, start_at_layer=start_at_layer, stop_at_layer=n, tokens=tokens, state=state)
    except _Enough:
        resid = None
    return seen, resid
