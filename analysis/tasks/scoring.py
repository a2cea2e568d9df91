"""Choice scoring shared by every task: a choice's score is the summed log-probability of its tokens.

Glossary
    choice tokens   prompt and choice are tokenised together (merges across the boundary are
                    real: "is" + "42" may not be "is" then "42"). The choice tokens are the joint
                    tokens from the first position where the joint tokenisation departs from the
                    prompt's own (normally: right after the prompt's tokens; when a merge swallowed
                    the prompt's last token, the merged token counts as a choice token, scored
                    given everything before it).
    score           summed log-probability of the choice tokens; predicted = argmax over choices.
    context         the joint tokens minus the last: one forward of a context yields the
                    log-probabilities of every token of every choice it extends, so choices that
                    share a context (all single-token choices of a prompt) cost one row.
    shared prefix   (default) each example's prompt is read once and each choice continues it from
                    the decoding state (analysis/tasks/shared_prefix.py): about one row per example
                    instead of one per context. `context(batch)` users (segments, queries: the G&A
                    masking experiments) and `shared_prefix=False` get the whole-row path (`batches`).
    text form       `ChoiceScorer` / `score_choices`: `Example`s (text prompts and choices).
    token form      `score_choices_tokens` (ids in, any choice lengths) and `choice_scores` (its
                    batched single-token form on logits): the organisms' token-level tasks.
                    Both forms apply the same rule; tests check they agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from analysis.interventions.patching import layer_inputs
from analysis.tasks import shared_prefix as sp
from analysis.tasks.text import Example, encode, segment_token_spans, tokenizer_of
from hooked.models.decode_state import StateRefused
from hooked.validate import nonempty


@dataclass
class ChoiceBatch:
    """Left-padded context rows plus where each scored token is read."""

    tokens: Tensor  # [rows pos]
    attention_mask: Tensor | None  # [rows pos], None when nothing is padded
    rows: Tensor  # [picks] row of each scored position
    cols: Tensor  # [picks] column (padded coordinates) whose logits predict the target
    targets: Tensor  # [picks] the choice token scored there
    owner: Tensor  # [picks] flat (example, choice) slot the log-prob is added to
    segments: list[list[tuple[int, int]]]  # per row: each segment's (first, last) token, padded coordinates
    queries: list[int]  # per row: the prompt's last token (padded coordinates)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChoiceScorer:
    """Tokenise once, then score choices as often as needed (under ablations, from a layer's residual).

    shared_prefix: read each prompt once and continue it per choice from the decoding state (the
    default; hooks must act at each position alone, see shared_prefix.py), else one whole row per
    context (`batches`, also what `context=` and the attribution screen use).
    keep_clean: the first run of `clean_scores` or `prefixes` (with the hooks attached then, normally
    none) keeps the residual entering every layer (`clean_bytes()`) and its scores: every later
    `prefixes` and `clean_scores` reads them instead of running the model again.
    """

    def __init__(self, model: Any, examples: Sequence[Example], batch_size: int = 16,
                 shared_prefix: bool = True, keep_clean: bool = False) -> None:
        tok = tokenizer_of(model)
        examples = nonempty(examples, "examples")
        self.model, self.examples, self.shared_prefix = model, examples, shared_prefix
        self.keep_clean = keep_clean
        self._kept: tuple[list[dict[int, Any]], Tensor, frozenset[str]] | None = None  # resumes, scores, hooked
        joints: list[list[tuple[tuple[int, ...], int]]] = []
        self.n_choices = max(len(e.choices) for e in self.examples)
        contexts: list[tuple[int, tuple[int, ...], int, list[tuple[int, int]]]] = []  # (example, ids, query, spans)
        picks: list[tuple[int, tuple[int, ...], int, int, int]] = []  # (example, context needed, pos, target, slot)
        for i, ex in enumerate(self.examples):
            prompt = encode(tok, ex.prompt)
            spans = segment_token_spans(tok, ex) if ex.segments else []
            mine: list[tuple[int, ...]] = []
            joints.append([])
            for c, choice in enumerate(ex.choices):
                joint = encode(tok, ex.prompt + choice)
                k = common_prefix(prompt, joint)
                if k == 0 or len(joint) <= k:
                    raise ValueError(f"example {i}: choice {choice!r} adds no token after the prompt (or no context)")
                joints[-1].append((tuple(joint), k))
                need = tuple(joint[:-1])
                if not any(ctx[: len(need)] == need for ctx in mine):  # keep only maximal contexts
                    mine = [ctx for ctx in mine if need[: len(ctx)] != ctx]
                    mine.append(need)
                picks += [(i, need, p, joint[p + 1], i * self.n_choices + c) for p in range(k - 1, len(joint) - 1)]
            for ctx in mine:
                contexts.append((i, ctx, len(prompt) - 1, spans))
        where = {}
        for n, (i, ctx, _, _) in enumerate(contexts):
            where.setdefault(i, []).append((ctx, n))
        resolved = []  # each pick read from a maximal context of its example that extends what it needs
        for i, need, p, target, slot in picks:
            n = next(n for ctx, n in where[i] if ctx[: len(need)] == need)
            resolved.append((n, p, target, slot))
        pad, device = _pad_id(tok), model_device(model)
        self.batches = self._batch(contexts, resolved, batch_size, pad, device)
        self.prefix_batches = sp.build(joints, self.n_choices, batch_size, pad, device)

    def _batch(self, contexts, picks, batch_size: int, pad: int, device: torch.device) -> list[ChoiceBatch]:
        order = sorted(range(len(contexts)), key=lambda n: len(contexts[n][1]))
        by_context: dict[int, list] = {}
        for n, p, target, slot in picks:
            by_context.setdefault(n, []).append((p, target, slot))
        batches = []
        for start in range(0, len(order), batch_size):
            members = order[start: start + batch_size]
            width = max(len(contexts[n][1]) for n in members)
            tokens = torch.full((len(members), width), pad, dtype=torch.long)
            mask = torch.zeros((len(members), width), dtype=torch.long)
            rows, cols, targets, owner, segments, queries = [], [], [], [], [], []
            for r, n in enumerate(members):
                _, ids, query, spans = contexts[n]
                off = width - len(ids)
                tokens[r, off:] = torch.tensor(ids)
                mask[r, off:] = 1
                segments.append([(a + off, b + off) for a, b in spans])
                queries.append(query + off)
                for p, target, slot in by_context.get(n, []):
                    rows.append(r), cols.append(p + off), targets.append(target), owner.append(slot)
            full = bool(mask.all())
            batches.append(ChoiceBatch(tokens.to(device), None if full else mask.to(device),
                                       *(torch.tensor(x, device=device) for x in (rows, cols, targets, owner)),
                                       segments, queries))
        return batches

    # ---------------------------------------------------------------------------- running
    def prefixes(self, layers: Sequence[int], start_at_layer: int | None = None,
                 resids: Sequence[Any] | None = None) -> Iterator[tuple[int, list[Any]]]:
        """(l, [what `scores(l, ...)` resumes from, per batch]) for ascending `layers`, one run in all: the
        residual entering block l (whole rows), or a shared_prefix.Resume (shared prefix).

        Without start_at_layer: the clean run (kept with keep_clean). With start_at_layer + resids
        (from an earlier `prefixes`): a run from there under the hooks attached now, so what it yields
        carries their intervention (layers must be later than start_at_layer)."""
        if (start_at_layer is None) != (resids is None):
            raise ValueError("prefixes: pass start_at_layer and resids together (resids from an earlier prefixes "
                             f"at that layer), got start_at_layer={start_at_layer} and resids "
                             f"{'None' if resids is None else 'given'}")
        n_batches = len(self.prefix_batches if self.shared_prefix else self.batches)
        if resids is not None and len(resids) != n_batches:
            raise ValueError(f"prefixes: resids must hold one entry per batch ({n_batches}), got {len(resids)}")
        if start_at_layer is not None and any(layer <= start_at_layer for layer in layers):
            raise ValueError(f"prefixes from layer {start_at_layer} yields later layers only, got {sorted(set(layers))}")
        return self._prefixes(layers, start_at_layer, resids)

    def _prefixes(self, layers: Sequence[int], start_at_layer: int | None,
                  resids: Sequence[Any] | None) -> Iterator[tuple[int, list[Any]]]:
        if start_at_layer is None and self.keep_clean:
            runs = self._clean()[0]
            for layer in sorted(set(layers)):
                yield layer, [run[layer] for run in runs]
            return
        if self.shared_prefix:  # each run stops entering the last of `layers`
            runs = [sp.capture(self.model, b, layers, start_at_layer, None if resids is None else resids[i],
                               score=False).resumes for i, b in enumerate(self.prefix_batches)]
        else:
            runs = [self._row_run(b, layers, start_at_layer, None if resids is None else resids[i], to_end=False)
                    for i, b in enumerate(self.batches)]
        for layer in sorted(set(layers)):
            yield layer, [run[layer] for run in runs]

    def clean_scores(self) -> Float[Tensor, "example choice"]:
        """`scores()` of the model as it is; with keep_clean, from the kept run (made now if not yet)."""
        if not self.keep_clean:
            return self.scores()
        try:
            _, flat, hooked = self._clean()
        except StateRefused:  # the hooks attached now are lazy: whole rows, nothing kept
            return self.scores()
        now = _hooked(self.model)
        if now != hooked:
            raise RuntimeError(f"clean_scores: the kept run saw hooks on {sorted(hooked) or 'nothing'}, now "
                               f"{sorted(now) or 'nothing'} have hooks; call scores() for the model as it is now")
        return self._finish(flat.clone(), 1)

    def clean_bytes(self) -> int:
        """About what keep_clean holds: the residual entering every layer of every row (shared prefix: and
        the state's keys and values, at most twice that)."""
        n, d = self.model.cfg.n_layers, self.model.cfg.d_model
        size = next(self.model.parameters()).element_size()
        if self.shared_prefix:
            tokens = sum(b.tokens.numel() + (0 if b.cont is None else b.cont.numel()) for b in self.prefix_batches)
            return 3 * n * tokens * d * size
        return n * sum(b.tokens.numel() for b in self.batches) * d * size

    def _clean(self) -> tuple[list[dict[int, Any]], Tensor, frozenset[str]]:
        """The kept run, made on first use (a hook the state refuses raises StateRefused, nothing kept)."""
        if self._kept is None:
            layers, n = range(self.model.cfg.n_layers), self.model.cfg.n_layers
            flat = torch.zeros(1, len(self.examples) * self.n_choices, dtype=torch.float64)
            runs: list[dict[int, Any]] = []
            if self.shared_prefix:
                for batch in self.prefix_batches:
                    run = sp.capture(self.model, batch, layers)
                    runs.append(run.resumes)
                    for owner, values in run.scored:
                        flat.index_add_(1, owner.cpu(), values.double().cpu())
            else:
                for batch in self.batches:
                    runs.append(self._row_run(batch, layers))
                    flat.index_add_(1, batch.owner.cpu(), self._row_logp(batch, runs[-1].pop(n), 1))
            self._kept = (runs, flat, _hooked(self.model))
        return self._kept

    def _row_run(self, batch: ChoiceBatch, layers: Sequence[int], start_at_layer: int | None = None,
                 resid: Tensor | None = None, to_end: bool = True) -> dict[int, Tensor]:
        """Whole rows: the residual entering each of `layers` and (to_end) the final one (key n_layers),
        one run from the tokens or from `resid` entering `start_at_layer` (`layer_inputs`)."""
        grab = set(layers) | ({self.model.cfg.n_layers} if to_end else set())
        return dict(layer_inputs(self.model, batch.tokens, batch.attention_mask, grab, start_at_layer, resid))

    def _row_logp(self, batch: ChoiceBatch, resid: Tensor, r: int) -> Tensor:
        """Log-prob [r picks] (float64, CPU) of each scored token of a whole-row batch from the final residual."""
        rows = batch.rows + len(batch.tokens) * torch.arange(r, device=batch.rows.device)[:, None]
        flat = rows.reshape(-1) * resid.shape[1] + batch.cols.repeat(r)
        return sp.picked_logp(self.model, resid.flatten(0, 1), flat, batch.targets.repeat(r)).double().cpu().view(r, -1)

    def scores(self, start_at_layer: int | None = None, resids: Sequence[Any] | None = None,
               context: Callable[[ChoiceBatch], Any] | None = None, replicas: int = 1) -> Float[Tensor, "example choice"]:
        """Summed log-probs [n_examples, max_choices] (-inf where an example has fewer choices).

        start_at_layer + resids: run from those residuals (see `prefixes`). context(batch): a
        context manager entered around each batch's forward (masking experiments; whole rows).
        replicas = r > 1: each batch is tiled r times along the batch axis (replica j holds rows
        [j * rows, (j + 1) * rows)), for r different interventions in one forward (the context
        applies a per-replica edit); the result is [r, n_examples, max_choices].
        Only the scored positions go through the final norm and the unembedding. With the shared
        prefix, a hook the decoding state refuses (an SSM's lazy hooks) falls back to whole rows (from
        the clean run's residual; resumes that carry an intervention raise the StateRefused instead).
        """
        if context is None and self.shared_prefix:
            try:
                return self._finish(self._shared(start_at_layer, resids, replicas), replicas)
            except StateRefused:
                if resids is not None and isinstance(resids[0], sp.Resume):
                    if not all(r.clean for r in resids):  # whole rows would start from the clean run instead
                        raise
                    resids = [dict(layer_inputs(self.model, b.tokens, b.attention_mask, [start_at_layer]))[start_at_layer]
                              for b in self.batches]
        return self._finish(self._rows(start_at_layer, resids, context, replicas), replicas)

    def _shared(self, start_at_layer: int | None, resids: Sequence[Any] | None, replicas: int) -> Tensor:
        flat = torch.zeros(replicas, len(self.examples) * self.n_choices, dtype=torch.float64)
        with torch.no_grad():
            for b, batch in enumerate(self.prefix_batches):
                for owner, values in sp.run(self.model, batch, replicas, start_at_layer,
                                            None if resids is None else resids[b]):
                    flat.index_add_(1, owner.cpu(), values.double().cpu())
        return flat

    def flat_scores(self, whole_rows: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Summed log-probs [examples * choices] (float64, on the model's device, on the autograd graph
        when it records) and the example of each row of each forward, in the order the forwards ran
        (-1: a row that scores nothing): for hooks that collect per-row activations (the attribution
        screen). Shared prefix unless refused (then whole rows), as `scores`; whole_rows: `batches`."""
        device = model_device(self.model)
        if self.shared_prefix and not whole_rows:
            try:
                flat = torch.zeros(len(self.examples) * self.n_choices, dtype=torch.float64, device=device)
                for batch in self.prefix_batches:
                    for owner, values in sp.run(self.model, batch):
                        flat = flat.index_add(0, owner, values[0].double())
                return flat, [rows for batch in self.prefix_batches for rows in sp.row_examples(batch)]
            except StateRefused:
                pass
        n, owners = self.model.cfg.n_layers, []
        flat = torch.zeros(len(self.examples) * self.n_choices, dtype=torch.float64, device=device)
        for batch in self.batches:
            resid = self.model(batch.tokens, batch.attention_mask, stop_at_layer=n)
            index = batch.rows * resid.shape[1] + batch.cols
            logp = sp.picked_logp(self.model, resid.flatten(0, 1), index, batch.targets)
            flat = flat.index_add(0, batch.owner, logp.double())
            rows = torch.full((len(batch.tokens),), -1, dtype=torch.long, device=batch.rows.device)
            rows[batch.rows] = batch.owner // self.n_choices
            owners.append(rows)
        return flat, owners

    def _finish(self, flat: Tensor, r: int) -> Tensor:
        out = flat.view(r, len(self.examples), self.n_choices)
        for i, ex in enumerate(self.examples):
            out[:, i, len(ex.choices):] = float("-inf")
        return out[0] if r == 1 else out

    def _rows(self, start_at_layer: int | None, resids: Sequence[Tensor] | None,
              context: Callable[[ChoiceBatch], Any] | None, replicas: int) -> Tensor:
        """The whole-row path: one row per context (`batches`)."""
        model, n, r = self.model, self.model.cfg.n_layers, replicas
        flat = torch.zeros(r, len(self.examples) * self.n_choices, dtype=torch.float64)
        with torch.no_grad():
            for b, batch in enumerate(self.batches):
                mask = None if batch.attention_mask is None else batch.attention_mask.repeat(r, 1)
                tokens = batch.tokens.repeat(r, 1)
                with context(batch) if context is not None else contextlib.nullcontext():
                    if start_at_layer is None:
                        resid = model(tokens, mask, stop_at_layer=n)
                    else:
                        resid = model(resids[b].repeat(r, 1, 1), mask, start_at_layer=start_at_layer,
                                      stop_at_layer=n, tokens=tokens)
                flat.index_add_(1, batch.owner.cpu(), self._row_logp(batch, resid, r))
        return flat

    def answers(self) -> Tensor:
        return torch.tensor([e.answer for e in self.examples])

    def per_example(self, scores: Tensor) -> dict[str, Tensor]:
        """Per example: "correct" and "logprob" (`per_example`); their means are `metrics`."""
        return per_example(scores, self.examples)

    def metrics(self, scores: Tensor) -> dict[str, float]:
        return {"accuracy": accuracy(scores, self.examples), "logprob": answer_logprob(scores, self.examples)}


def score_choices(model: Any, examples: Sequence[Example], batch_size: int = 16,
                  shared_prefix: bool = True) -> Float[Tensor, "example choice"]:
    """Summed log-probability of each choice's tokens after its prompt (batched, padded). shared_prefix=False
    for hooks that index positions of the whole sequence (see `ChoiceScorer`)."""
    return ChoiceScorer(model, examples, batch_size, shared_prefix).scores()


def per_example(scores: Tensor, examples: Sequence[Example]) -> dict[str, Tensor]:
    """Per example: "correct" (1.0 when the answer has the top score) and "logprob" (answer log-prob
    normalised over the choices)."""
    answers = torch.tensor([e.answer for e in examples])
    return {"correct": (scores.argmax(-1) == answers).double(),
            "logprob": scores.log_softmax(-1).gather(1, answers[:, None])[:, 0]}


def accuracy(scores: Tensor, examples: Sequence[Example]) -> float:
    answers = torch.tensor([e.answer for e in examples])
    return (scores.argmax(-1) == answers).double().mean().item()


def answer_logprob(scores: Tensor, examples: Sequence[Example]) -> float:
    """Mean log-probability of the right choice, normalised over the choices (a smooth accuracy)."""
    answers = torch.tensor([e.answer for e in examples])
    return scores.log_softmax(-1).gather(1, answers[:, None]).mean().item()


# ------------------------------------------------------------------------------ token form
def logits_of(model: Any, tokens: Tensor) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits of a hooked model (returns a tensor) or an HF model (returns an output with .logits)."""
    out = model(tokens)
    return out if torch.is_tensor(out) else out.logits


def score_choices_tokens(model: Any, prompt: Sequence[int] | Tensor, choices: Sequence[Sequence[int]]) -> Tensor:
    """Summed log-probability of each choice's tokens appended to `prompt` (one sequence of ids).

    This is the choice scorer shared with the text KV task: single-token choices (the organisms')
    cost one forward; multi-token choices one forward per choice.
    """
    prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
    device = model_device(model)
    if all(len(c) == 1 for c in choices):
        logp = logits_of(model, prompt[None].to(device))[0, -1].float().log_softmax(-1)
        return logp[torch.tensor([c[0] for c in choices], device=device)]
    scores = []
    for c in choices:
        seq = torch.cat([prompt, torch.as_tensor(list(c), dtype=torch.long)])[None].to(device)
        logp = logits_of(model, seq)[0, len(prompt) - 1:-1].float().log_softmax(-1)
        scores.append(logp.gather(1, seq[0, len(prompt):, None]).sum())
    return torch.stack(scores)


def choice_scores(logits: Float[Tensor, "batch pos d_vocab"], choices: Int[Tensor, "batch n"]) -> Float[Tensor, "batch n"]:
    """Batched form of `score_choices_tokens` for single-token choices: log-probs at the last position."""
    return logits[:, -1].float().log_softmax(-1).gather(1, choices)


def _hooked(model: Any) -> frozenset[str]:
    """Names of the hook points with a hook visible to this caller."""
    return frozenset(name for name, point in getattr(model, "hook_dict", {}).items() if point.has_hooks)


def _pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def model_device(model: Any) -> torch.device:
    """Where the model's inputs go: a hooked model's `device` (a dispatched model's main device), else
    its first parameter's (CPU for a parameterless callable)."""
    if isinstance(getattr(model, "device", None), torch.device):
        return model.device
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
