"""The synthetic token-level key-value task the model organisms are trained on, and its scoring.

Glossary
    vocabulary  101 tokens: 0 <pad>, 1 <bos>, 2 ":", 3 "\\n" (written <nl> in text), 4 "?", then
                64 key tokens K00..K63 (ids 5..68) and 32 value tokens V00..V31 (ids 69..100).
    pair        the four tokens `k : v \\n`; its newline is the pair's segment-final token.
    context     `<bos>` then n pairs with distinct keys (values drawn with replacement).
    query       the question after the context. Two formats: "k?" (`k ?`, the answer is predicted
                at "?") and "?k" (`? k`, predicted at k). Attention models only learnt "?k".
    answer      the queried key's value; the model's next token at the query's last position.
    training sequence  context, then every key asked once in a random order, each query followed by
                its answer: `ctx q1 a1 q2 a2 ...`; the loss is on every answer (n answers per sequence).
                Options: keys asked with replacement (`n_queries` of them), answers left out.
    choices     for evaluation, the n values of the context (as in the text KV task of
                `analysis.tasks.kv_retrieval`); evaluation prompts draw distinct values, so chance
                is 1/n; a prompt is right when the answer scores highest. Training draws values
                with replacement.
    scoring     `analysis.tasks.scoring`: the same rule as the text task's `score_choices`, in its
                token form (`choice_scores`, `score_choices_tokens`); tests check both agree on
                `examples`.

The text form (`to_text`, `examples`) spells the tokens with single spaces, e.g.
`K03 : V12 \\n K41 : V07 \\n ? K03`, which `make_tokenizer()` (a word-level HF tokenizer) maps back to
the same ids; `examples` returns `analysis.tasks.Example`s so the G&A tooling runs on organisms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from analysis.tasks.scoring import choice_scores, logits_of, model_device
from analysis.tasks.text import Example
from hooked.validate import Integer, check

PAD, BOS, COLON, NL, QMARK = 0, 1, 2, 3, 4
N_KEYS, N_VALUES = 64, 32
KEY0, VALUE0 = 5, 5 + N_KEYS
D_VOCAB = VALUE0 + N_VALUES  # 101
WORDS = (["<pad>", "<bos>", ":", "\n", "?"] + [f"K{i:02d}" for i in range(N_KEYS)]
         + [f"V{i:02d}" for i in range(N_VALUES)])
QUERY_FORMATS = ("k?", "?k")


def query_tokens(key: int, fmt: str) -> list[int]:
    """The query for token id `key`: `[key, ?]` for "k?", `[?, key]` for "?k"."""
    if fmt not in QUERY_FORMATS:
        raise ValueError(f"query format must be one of {QUERY_FORMATS}, got {fmt!r}")
    return [key, QMARK] if fmt == "k?" else [QMARK, key]


def _draw(n: int, batch: int, gen: torch.Generator, distinct_values: bool = False) -> tuple[Tensor, Tensor]:
    """Keys (distinct per row) and values (with replacement, or distinct), both [batch n] token ids."""
    top = N_VALUES if distinct_values else N_KEYS
    check(n, "n", Integer(ge=1, le=top))
    keys = torch.argsort(torch.rand(batch, N_KEYS, generator=gen), dim=1)[:, :n] + KEY0
    if distinct_values:
        values = torch.argsort(torch.rand(batch, N_VALUES, generator=gen), dim=1)[:, :n] + VALUE0
    else:
        values = torch.randint(0, N_VALUES, (batch, n), generator=gen) + VALUE0
    return keys, values


def _context(keys: Tensor, values: Tensor) -> Int[Tensor, "batch ctx"]:
    batch, n = keys.shape
    pairs = torch.stack([keys, torch.full_like(keys, COLON), values, torch.full_like(keys, NL)], dim=2)
    return torch.cat([torch.full((batch, 1), BOS, dtype=torch.long), pairs.reshape(batch, 4 * n)], dim=1)


def training_batch(n: int, batch: int, gen: torch.Generator, fmt: str, queries: str = "permutation",
                   n_queries: int | None = None, answers: bool = True) -> tuple[Tensor, Tensor]:
    """(tokens [batch pos], labels [batch pos]): context plus queries with answers; labels are
    the next-token targets, -100 everywhere but at each query's last token (the answer follows).

    queries: "permutation" asks every key once (random order); "replacement" draws `n_queries`
    (default n) asked keys uniformly with replacement, which removes the elimination shortcut
    (answering with a context value not asked yet scores (1/2 + 1)/2 = 0.75 at n = 2 and 0.61 at
    n = 3 under "permutation") and gives small n as many answers per sequence as large n.
    answers: False leaves the answers out of the sequence (`ctx q1 q2 ...`, each query still labelled
    with its value), so a repeated query cannot be answered by copying an earlier answer (an
    induction shortcut that never needs the context).
    """
    if queries not in ("permutation", "replacement"):
        raise ValueError(f"queries must be 'permutation' or 'replacement', got {queries!r}")
    if n_queries is not None and queries == "permutation" and n_queries != n:
        raise ValueError(f"queries='permutation' asks each of the n = {n} keys once; n_queries={n_queries}")
    keys, values = _draw(n, batch, gen)
    ctx = _context(keys, values)
    if queries == "permutation":
        order = torch.argsort(torch.rand(batch, n, generator=gen), dim=1)
    else:
        order = torch.randint(0, n, (batch, n_queries or n), generator=gen)
    asked = order.shape[1]
    qk, qv = keys.gather(1, order), values.gather(1, order)
    q = torch.tensor(query_tokens(0, fmt))
    key_slot = 0 if fmt == "k?" else 1
    block = q.expand(batch, asked, 2).clone()
    block[:, :, key_slot] = qk
    if answers:
        block = torch.cat([block, qv[:, :, None]], dim=2)  # q q a, q q a, ...
    width = block.shape[2]
    tokens = torch.cat([ctx, block.reshape(batch, width * asked)], dim=1)
    labels = torch.full_like(tokens, -100)
    query_end = ctx.shape[1] + width * torch.arange(asked) + 1  # each query's last token predicts the answer
    labels[:, query_end] = qv
    return tokens, labels


def queried_newlines(tokens: Int[Tensor, "batch pos"], n: int, fmt: str,
                     answers: bool = True) -> tuple[Int[Tensor, " asked"], Int[Tensor, "batch asked"]]:
    """For a `training_batch` with n pairs: the position of each query's last token (where the
    answer is predicted) and, per row, the position of the queried pair's newline."""
    width = 3 if answers else 2
    ctx = 4 * n + 1
    asked = (tokens.shape[1] - ctx) // width
    if tokens.shape[1] != ctx + width * asked or asked < 1:
        raise ValueError(f"tokens of length {tokens.shape[1]} are not a training batch with n = {n} "
                         f"pairs and {'' if answers else 'no '}answers")
    key_slot = 0 if fmt == "k?" else 1
    start = ctx + width * torch.arange(asked)
    asked_keys = tokens[:, start + key_slot]  # [batch asked]
    context_keys = tokens[:, 4 * torch.arange(n) + 1]  # [batch n]
    match = asked_keys[:, :, None] == context_keys[:, None, :]
    if not bool((match.sum(-1) == 1).all()):
        raise ValueError("every query must ask exactly one key of the context")
    return start + 1, 4 * match.int().argmax(-1) + 4


@dataclass
class KVPrompts:
    """Evaluation prompts: context plus one query; the answer is `choices[b, answer[b]]`."""

    tokens: Int[Tensor, "batch pos"]
    choices: Int[Tensor, "batch n"]  # the context's value ids, in context order
    answer: Int[Tensor, " batch"]  # index into choices of the queried pair
    fmt: str

    @property
    def n(self) -> int:
        return self.choices.shape[1]

    def pair_newlines(self) -> list[int]:
        """Positions of each pair's newline (segment-final tokens); the same for every row."""
        return [4 * i + 4 for i in range(self.n)]


def prompts(n: int, n_samples: int, seed: int = 0, fmt: str = "?k") -> KVPrompts:
    """`n_samples` seeded prompts with `n` pairs each (distinct keys, distinct values, so the n
    choices are distinct and chance is 1/n); the queried pair is uniform over the n."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = _draw(n, n_samples, gen, distinct_values=True)
    target = torch.randint(0, n, (n_samples,), generator=gen)
    qk = keys.gather(1, target[:, None])[:, 0]
    q = torch.stack([torch.tensor(query_tokens(int(k), fmt)) for k in qk])
    return KVPrompts(torch.cat([_context(keys, values), q], dim=1), values, target, fmt)


def correct(scores: Float[Tensor, "batch n"], p: KVPrompts) -> Tensor:
    """Right when the answer's value scores highest (a value repeated in the context counts as one)."""
    best = p.choices.gather(1, scores.argmax(1, keepdim=True))[:, 0]
    return best == p.choices.gather(1, p.answer[:, None])[:, 0]


@torch.no_grad()
def accuracy(model: Any, n: int, n_samples: int = 300, seed: int = 0, fmt: str = "?k", batch: int = 100) -> float:
    """Fraction of `n_samples` seeded prompts answered right (choice scoring over the context's values)."""
    p = prompts(n, n_samples, seed, fmt)
    device = model_device(model)
    hits = []
    for s in range(0, n_samples, batch):
        logits = logits_of(model, p.tokens[s:s + batch].to(device))
        part = KVPrompts(p.tokens[s:s + batch], p.choices[s:s + batch], p.answer[s:s + batch], fmt)
        hits.append(correct(choice_scores(logits.cpu(), part.choices), part))
    return torch.cat(hits).float().mean().item()


def accuracy_table(model: Any, ns: Sequence[int] = (4, 8, 12, 16), n_samples: int = 300, seed: int = 0,
                   fmt: str = "?k") -> dict[int, float]:
    """{n: accuracy} on `n_samples` seeded prompts per n (seed + n, so each n has its own prompts)."""
    return {n: accuracy(model, n, n_samples, seed + n, fmt) for n in ns}


# ------------------------------------------------------------------------------ text form
def to_text(ids: Sequence[int] | Tensor) -> str:
    """The ids as space-separated words, without <bos> (the tokenizer adds it)."""
    ids = [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]
    return " ".join(WORDS[i] for i in ids if i != BOS)


def make_tokenizer() -> Any:
    """A word-level HF tokenizer for the organisms' vocabulary: `tok(to_text(ids))` gives [BOS] + ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" +"), behavior="removed")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<pad>", pad_token="<pad>")


def examples(n: int, n_samples: int, seed: int = 0, fmt: str = "?k") -> list[Example]:
    """The same prompts as `prompts(n, n_samples, seed, fmt)` as text `Example`s for the G&A tooling:
    segments are the `K : V \\n` pairs, choices the context's values (" V12": leading space)."""
    p = prompts(n, n_samples, seed, fmt)
    out = []
    for b in range(n_samples):
        ids = p.tokens[b, 1:].tolist()
        segments, text = [], ""
        for i in range(n):
            piece = to_text(ids[4 * i:4 * i + 4])
            start = len(text) + (1 if text else 0)
            text = f"{text} {piece}" if text else piece
            segments.append((start, len(text)))
        text += " " + to_text(ids[4 * n:])
        choices = [" " + WORDS[int(v)] for v in p.choices[b]]
        out.append(Example(text, choices, int(p.answer[b]), segments,
                           {"task": "kv_organism", "fmt": fmt, "tokens": p.tokens[b].tolist()}))
    return out
