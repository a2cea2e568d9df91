"""Retrieval tasks for Gather-and-Aggregate: KV-retrieval and multiple choice, as prompts + choices.

Glossary
    Example     one prompt, its candidate continuations (`choices`) and the index of the right one
                (`answer`); `segments` are the character spans [start, end) of the pieces a Gather
                head is expected to compress (a `key:value` line, an answer option line), each
                ending with its newline.
    segment-final token   the token holding a segment's last character (the newline): where a
                Gather head writes a segment's summary and where an Aggregate head reads it.
    query position        the prompt's last token: the position whose next-token distribution
                scores the choices (Bick, Xing, Gu 2025, "Gather-and-Aggregate").
    PromptBatch the prompts of several examples tokenised together (left padding), with the
                segments and the query position in padded token coordinates.

KV-retrieval (METHODS.md A, exact format; keys are distinct words from `data/words.txt`, values
distinct integers in [0, 100), every value is a choice, appended with NO leading space)::

    Memorize the following dictionary:
    lantern:42
    orchid:7
    The value of the key 'orchid' is

Multiple choice (MMLU format)::

    {question}
    A. {option}
    ...
    Answer:

scored by the letter tokens (" A", " B", ...: the leading space as in the MMLU harness; change it
with `letter_prefix`).
"""

from __future__ import annotations


import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from hooked.validate import Integer, check, checked

WORDS_PATH = Path(__file__).parent / "data" / "words.txt"
KV_HEADER = "Memorize the following dictionary:\n"
KV_QUESTION = "The value of the key '{key}' is"


@dataclass
class Example:
    prompt: str
    choices: list[str]
    answer: int
    segments: list[tuple[int, int]] = field(default_factory=list)  # character spans [start, end)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise TypeError(f"Example: prompt must be a string, got {type(self.prompt).__name__}")
        if not isinstance(self.choices, (list, tuple)) or not all(isinstance(c, str) for c in self.choices):
            shown = repr(self.choices)[:80]
            raise TypeError(f"Example: choices must be a list of strings (a string would be read character by "
                            f"character), got {shown}")
        check(self.answer, "Example: answer", Integer(ge=0, lt=len(self.choices)))
        for i, (start, end) in enumerate(self.segments):  # character spans [start, end) of the prompt
            check(end, f"Example: segments[{i}] end", Integer(ge=1, le=len(self.prompt)))
            check(start, f"Example: segments[{i}] start", Integer(ge=0, lt=end))


@lru_cache(maxsize=1)
def load_words() -> tuple[str, ...]:
    """The shipped word list: distinct lower-case English nouns, one a line."""
    words = tuple(w.strip() for w in WORDS_PATH.read_text().splitlines() if w.strip())
    assert len(set(words)) == len(words), "data/words.txt has duplicates"
    return words


@checked(seed=Integer(ge=0))
def kv_retrieval(n_pairs: int, n_samples: int, seed: int = 0, words: tuple[str, ...] | None = None) -> list[Example]:
    """`n_samples` KV-retrieval prompts with `n_pairs` key:value lines each (seeded, reproducible).

    Choices are the `n_pairs` values as strings, in dictionary order; `answer` indexes the queried
    key's value. `segments` are the `key:value\\n` lines; `meta` holds keys, values and the query.
    """
    words = load_words() if words is None else tuple(words)
    repeated = sorted({w for w in words if words.count(w) > 1})
    if repeated:  # two equal keys would make the query ambiguous
        raise ValueError(f"words must be distinct keys; repeated: {repeated[:10]}")
    bad = [w for w in words if not isinstance(w, str) or not w.strip() or ":" in w or "\n" in w]
    if bad:
        raise ValueError(f"words must be non-empty strings without ':' or newlines (the prompt's syntax); got {bad[:5]}")
    n_pairs = check(n_pairs, "n_pairs", Integer(ge=1, le=min(len(words), 100)))  # distinct keys, at most 100
    n_samples = check(n_samples, "n_samples", Integer(ge=1))
    rng = random.Random(seed)
    out = []
    for _ in range(n_samples):
        keys = rng.sample(words, n_pairs)
        values = rng.sample(range(100), n_pairs)
        target = rng.randrange(n_pairs)
        prompt, segments = KV_HEADER, []
        for k, v in zip(keys, values):
            line = f"{k}:{v}\n"
            segments.append((len(prompt), len(prompt) + len(line)))
            prompt += line
        prompt += KV_QUESTION.format(key=keys[target])
        out.append(Example(prompt, [str(v) for v in values], target, segments,
                           {"task": "kv_retrieval", "keys": keys, "values": values, "query": keys[target]}))
    return out


def multiple_choice(question: str, options: list[str], answer: int, letter_prefix: str = " ") -> Example:
    """An MMLU-style prompt; the choices are the option letters, each option line a segment."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    check(len(options), "multiple_choice: len(options)", Integer(ge=2, le=len(letters)))
    prompt, segments = question.rstrip("\n") + "\n", []
    for letter, option in zip(letters, options):
        line = f"{letter}. {option}\n"
        segments.append((len(prompt), len(prompt) + len(line)))
        prompt += line
    prompt += "Answer:"
    return Example(prompt, [letter_prefix + c for c in letters[: len(options)]], answer, segments,
                   {"task": "multiple_choice", "options": list(options)})


# ------------------------------------------------------------------------------- tokenisation
def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids exactly as `HookedModel.tokenize` makes them (special tokens added)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def segment_token_spans(tokenizer: Any, example: Example) -> list[tuple[int, int]]:
    """Each segment as token positions (first, last) in the prompt's own tokenisation.

    `last` is the token holding the segment's final character (its newline), `first` the token
    holding its first character. A fast tokenizer's offsets are used; otherwise the prompt is
    re-tokenised up to each boundary (exact when no merge crosses a segment boundary).
    """
    text = example.prompt
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        offsets = None
    spans = []
    for start, end in example.segments:
        if offsets is not None:
            first = _token_at(offsets, start)
            last = _token_at(offsets, end - 1)
        else:
            first = len(encode(tokenizer, text[:start])) if start > 0 else 0
            last = len(encode(tokenizer, text[:end])) - 1
        spans.append((first, last))
    return spans


def _token_at(offsets: list[tuple[int, int]], char: int) -> int:
    for i, (a, b) in enumerate(offsets):
        if a <= char < b:
            return i
    raise ValueError(f"no token covers character {char}")


@dataclass
class PromptBatch:
    """Prompts tokenised together, left-padded: every query position is the last column."""

    tokens: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    segments: list[list[tuple[int, int]]]  # per row: (first, last) token positions, padded coordinates

    @property
    def query(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def queries(self) -> list[int]:
        return [self.query] * self.tokens.shape[0]

    def summary_mask(self) -> Bool[Tensor, "batch pos"]:
        """True at every segment-final token."""
        mask = torch.zeros(self.tokens.shape, dtype=torch.bool)
        for b, spans in enumerate(self.segments):
            for _, last in spans:
                mask[b, last] = True
        return mask.to(self.tokens.device)


def tokenizer_of(model: Any) -> Any:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError("this model has no tokenizer; load it from a checkpoint that has one or set model.tokenizer")
    return tok


def encode_prompts(model: Any, examples: list[Example]) -> PromptBatch:
    """Tokenise the prompts (no choices) of `examples` with the model's tokenizer, left-padded."""
    tok = tokenizer_of(model)
    tokens, mask = model.tokenize([e.prompt for e in examples], padding_side="left")
    width = tokens.shape[1]
    segments = []
    for b, e in enumerate(examples):
        pad = width - int(mask[b].sum())
        segments.append([(first + pad, last + pad) for first, last in segment_token_spans(tok, e)])
    return PromptBatch(tokens, mask, segments)


def char_tokenizer(alphabet: str | None = None) -> Any:
    """A character-level tokenizer (BOS added, PAD and EOS defined) for tiny random models.

    Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, then one per character of `alphabet` (default:
    printable ASCII). Vocabulary size `len(alphabet) + 4`; a tiny model needs d_vocab >= that.
    """
    import string

    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = alphabet if alphabet is not None else string.printable
    chars = list(dict.fromkeys(alphabet))
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
