"""Factual prompts for knockout: loading, subject spans from tokenizer offsets, source sets, screening.

Glossary
    fact         a dict in the known_1000.json format (Meng et al. 2022): subject, attribute, prompt,
                 template, relation_id, known_id. The answer is " " + attribute; the token scored is
                 its first token.
    FactPrompt   one tokenised fact: ids, which tokens belong to the subject (every token whose
                 character span overlaps the subject's, from the tokenizer's offsets), which are
                 special (BOS and friends), the answer token.
    source set   positions knocked out as sources, per fact (DESIGN.md section 5, METHODS.md B):
                   subject   the subject's tokens
                   relation  every non-subject, non-special token; the last token included when
                             relation_includes_last (the paper's choice) and excluded otherwise
                   last      the last token (so last -> last is the self edge)
                   first     the first token (BOS when the tokenizer adds one)
    left padding rows are padded on the left; a fact of length T in a batch of width W occupies
                 positions W-T .. W-1, so its last token is at -1 in every row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hooked.validate import positive_int

SOURCE_SETS = ("subject", "relation", "last", "first")
KNOWN_FACTS = Path(__file__).parent / "data" / "known_1000.json"


def load_facts(path: str | Path | None = None, n: int | None = None) -> list[dict[str, Any]]:
    """Facts from a known_1000.json-style file (default: the copy shipped in analysis/data)."""
    origin = path or KNOWN_FACTS
    try:
        with open(origin, encoding="utf-8") as f:
            facts = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{origin}: not a JSON facts file ({e})") from None
    if n is not None:
        n = positive_int(n, "n")
    return check_facts(facts, str(origin))[:n] if n is not None else check_facts(facts, str(origin))


def check_facts(facts: Any, origin: str = "facts") -> list[dict[str, Any]]:
    """`facts` if it is a list of fact objects with string 'subject', 'attribute', 'prompt' (and
    'template' when present); else a ValueError naming the entries and fields."""
    if not isinstance(facts, list) or not all(isinstance(x, dict) for x in facts):
        raise ValueError(f"{origin}: expected a JSON list of fact objects")
    missing = [i for i, x in enumerate(facts) if not {"subject", "attribute", "prompt"} <= set(x)]
    if missing:
        raise ValueError(f"{origin}: facts {missing[:10]} lack one of 'subject', 'attribute', 'prompt'")
    bad = [f"{i}.{k}" for i, x in enumerate(facts) for k in ("subject", "attribute", "prompt", "template")
           if k in x and not (isinstance(x[k], str) and (x[k] or k == "template"))]
    if bad:
        raise ValueError(f"{origin}: these fact fields must be non-empty strings: {', '.join(bad[:10])}")
    return facts


@dataclass
class FactPrompt:
    fact: dict[str, Any]
    ids: list[int]
    subject: list[bool]  # per token: overlaps the subject's characters
    special: list[bool]  # per token: a special token (BOS, ...)
    answer: int  # first token of " " + attribute

    def __len__(self) -> int:
        return len(self.ids)

    def source_positions(self, kind: str, relation_includes_last: bool = True) -> list[int]:
        """Positions (0-based, unpadded) of one source set; see the module glossary."""
        last = len(self.ids) - 1
        if kind == "subject":
            return [p for p, s in enumerate(self.subject) if s]
        if kind == "relation":
            rel = [p for p in range(len(self.ids)) if not self.subject[p] and not self.special[p]]
            rel = [p for p in rel if p != last]
            return rel + [last] if relation_includes_last else rel
        if kind == "last":
            return [last]
        if kind == "first":
            return [0]
        raise ValueError(f"unknown source set {kind!r}; known: {SOURCE_SETS}")


def subject_span(prompt: str, subject: str, template: str | None = None) -> tuple[int, int]:
    """Character span [start, end) of the subject in the prompt: where the template's "{}" puts it
    when the prompt has the subject there, else its first occurrence."""
    start = template.find("{}") if template else -1
    if start < 0 or prompt[start: start + len(subject)] != subject:
        start = prompt.find(subject)
    if start < 0:
        raise ValueError(f"subject {subject!r} not found in prompt {prompt!r}")
    return start, start + len(subject)


def prepare_facts(tokenizer: Any, facts: Iterable[dict[str, Any]]) -> tuple[list[FactPrompt], list[tuple[dict, str]]]:
    """Tokenise facts; returns (prompts, skipped facts with the reason)."""
    prompts, skipped = [], []
    for fact in check_facts(list(facts)):
        prompt = fact["prompt"]
        try:
            s0, s1 = subject_span(prompt, fact["subject"], fact.get("template"))
        except ValueError as e:
            skipped.append((fact, str(e)))
            continue
        try:
            enc = tokenizer(prompt, return_offsets_mapping=True, return_special_tokens_mask=True)
        except NotImplementedError as e:  # slow tokenizers have no offsets
            raise TypeError("info_flow needs a fast tokenizer (offset mappings) to find subject tokens") from e
        offsets, special = enc["offset_mapping"], [bool(x) for x in enc["special_tokens_mask"]]
        subject = [not sp and a < s1 and b > s0 and b > a for (a, b), sp in zip(offsets, special)]
        answer_ids = tokenizer(" " + fact["attribute"], add_special_tokens=False)["input_ids"]
        if not any(subject) or not answer_ids:
            skipped.append((fact, "no subject token" if not any(subject) else "empty answer"))
            continue
        prompts.append(FactPrompt(fact, list(enc["input_ids"]), subject, special, int(answer_ids[0])))
    return prompts, skipped


def pad_left(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(tokens [batch width], attention_mask [batch width] bool), padded on the left."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[b, width - len(r):] = True
    return tokens.to(device), mask.to(device)


def source_masks(prompts: Sequence[FactPrompt], kind: str, width: int,
                 relation_includes_last: bool = True) -> Tensor:
    """Bool mask [len(prompts) width] of one source set for left-padded rows of this width."""
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for b, fp in enumerate(prompts):
        shift = width - len(fp)
        for p in fp.source_positions(kind, relation_includes_last):
            mask[b, shift + p] = True
    return mask


def pad_id(tokenizer: Any) -> int:
    """The id used for padding: the tokenizer's pad token, else EOS, else 0 (masked anyway)."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0
