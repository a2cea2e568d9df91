"""The synthetic facts task of the facts organisms: a fixed, seeded knowledge base of (subject, relation)
-> attribute, asked through templates that put relation words before and after the subject.

Glossary
    vocabulary  90 tokens: 0 <pad>, 1 <bos>, the template words "the", "of", "is", "in", the relation
                words R0..R3, 48 name tokens N00..N47 (ids 10..57), 32 attribute tokens A00..A31
                (ids 58..89).
    subject     2 or 3 name tokens; the 300 subjects are distinct and none is a prefix of another, so
                a subject's identity needs all of its tokens (the name tokens are shared).
    relation    one of 4; its template has words before and after the subject (like known_1000's
                "The mother tongue of {} is"). The last word ("is" or "in") is shared by two
                relations, so the relation must reach the last token from the words before it:
                    0 "R0 {} is"   1 "R1 of {} is"   2 "the R2 of {} is in"   3 "R3 {} in"
    knowledge base  every (subject, relation) pair with its attribute, drawn uniformly (seeded):
                300 x 4 = 1,200 facts.
    fact        a dict in the known_1000.json format (subject, attribute, prompt, template,
                relation_id, known_id), so `analysis.info_flow` and `hooked knockout --facts` run on it.
                The prompt is the template with the subject filled in (no <bos>: the tokenizer adds it).
    answer      the attribute token, predicted at the prompt's last token (full-vocabulary argmax).
    training batch  facts drawn uniformly with replacement from the knowledge base, right-padded with
                <pad> (the models are causal, so the answer's logits never see the padding); the loss
                is on the answer only.
    accuracy    fraction of the knowledge base whose answer is the top-1 next token, per relation.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from analysis.tasks.scoring import logits_of, model_device

PAD, BOS = 0, 1
TEMPLATE_WORDS = ["the", "of", "is", "in"]
N_RELATIONS, N_NAMES, N_ATTRIBUTES = 4, 48, 32
RELATION_WORDS = [f"R{r}" for r in range(N_RELATIONS)]
NAME0 = 2 + len(TEMPLATE_WORDS) + N_RELATIONS  # 10
ATTR0 = NAME0 + N_NAMES  # 58
D_VOCAB = ATTR0 + N_ATTRIBUTES  # 90
WORDS = (["<pad>", "<bos>"] + TEMPLATE_WORDS + RELATION_WORDS + [f"N{i:02d}" for i in range(N_NAMES)]
         + [f"A{i:02d}" for i in range(N_ATTRIBUTES)])
TEMPLATES = ["R0 {} is", "R1 of {} is", "the R2 of {} is in", "R3 {} in"]
N_SUBJECTS, SUBJECT_LENGTHS, KB_SEED = 300, (2, 3), 0


@lru_cache(maxsize=4)
def knowledge_base(seed: int = KB_SEED) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(subjects, attributes): subjects[s] = name-token ids, attributes[s][r] = attribute token id."""
    gen = torch.Generator().manual_seed(seed)
    subjects: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(subjects) < N_SUBJECTS:
        length = SUBJECT_LENGTHS[int(torch.randint(len(SUBJECT_LENGTHS), (1,), generator=gen))]
        s = tuple(int(t) + NAME0 for t in torch.randint(N_NAMES, (length,), generator=gen))
        prefixes = {s[:k] for k in range(1, len(s))}
        if s in seen or prefixes & seen or any(s == t[:len(s)] for t in subjects):
            continue  # distinct, and neither a prefix of an earlier subject nor extended by one
        subjects.append(s)
        seen.add(s)
    attributes = torch.randint(N_ATTRIBUTES, (N_SUBJECTS, N_RELATIONS), generator=gen) + ATTR0
    return tuple(subjects), tuple(tuple(int(a) for a in row) for row in attributes)


def prompt_ids(subject: tuple[int, ...], relation: int) -> list[int]:
    """Token ids of one prompt, <bos> included: the template's words around the subject's names."""
    before, after = TEMPLATES[relation].split("{}")
    ids = [WORDS.index(w) for w in before.split()] + list(subject) + [WORDS.index(w) for w in after.split()]
    return [BOS] + ids


def to_text(ids: list[int] | tuple[int, ...] | Tensor) -> str:
    """The ids as space-separated words, without <bos> (the tokenizer adds it)."""
    return " ".join(WORDS[int(i)] for i in torch.as_tensor(ids).reshape(-1).tolist() if int(i) != BOS)


def facts(seed: int = KB_SEED, relations: tuple[int, ...] = tuple(range(N_RELATIONS))) -> list[dict[str, Any]]:
    """The knowledge base as known_1000-style dicts, subject-major; known_id = 4 * subject + relation."""
    subjects, attributes = knowledge_base(seed)
    out = []
    for s, subject in enumerate(subjects):
        for r in relations:
            name = to_text(subject)
            out.append({"known_id": N_RELATIONS * s + r, "subject": name, "attribute": WORDS[attributes[s][r]],
                        "template": TEMPLATES[r], "prompt": TEMPLATES[r].format(name), "relation_id": f"R{r}"})
    return out


def write_facts(path: str | Path, seed: int = KB_SEED) -> Path:
    """The knowledge base as a known_1000.json-style file (for `hooked knockout --facts PATH`)."""
    Path(path).write_text(json.dumps(facts(seed), indent=1))
    return Path(path)


def _rows(seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompt ids, answer id, relation) of every fact of the knowledge base."""
    subjects, attributes = knowledge_base(seed)
    rows = [(prompt_ids(s, r), attributes[i][r], r) for i, s in enumerate(subjects) for r in range(N_RELATIONS)]
    return [a for a, _, _ in rows], [b for _, b, _ in rows], [c for _, _, c in rows]


def training_batch(batch: int, gen: torch.Generator, seed: int = KB_SEED) -> tuple[Tensor, Tensor]:
    """(tokens [batch pos], labels [batch pos]): facts drawn with replacement, right-padded; labels are
    -100 except at each prompt's last token, where they are the attribute."""
    prompts, answers, _ = _rows(seed)
    pick = torch.randint(len(prompts), (batch,), generator=gen).tolist()
    width = max(len(prompts[i]) for i in pick)
    tokens = torch.full((batch, width), PAD, dtype=torch.long)
    labels = torch.full((batch, width), -100, dtype=torch.long)
    for b, i in enumerate(pick):
        tokens[b, :len(prompts[i])] = torch.tensor(prompts[i])
        labels[b, len(prompts[i]) - 1] = answers[i]
    return tokens, labels


@torch.no_grad()
def accuracy_table(model: Any, seed: int = KB_SEED) -> dict[int, float]:
    """{relation: accuracy} over the whole knowledge base (top-1 over the vocabulary). Prompts of one
    length run together, unpadded, so no padding convention enters the score."""
    prompts, answers, relations = _rows(seed)
    hits = torch.zeros(len(prompts), dtype=torch.bool)
    for length in sorted({len(p) for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if len(p) == length]
        tokens = torch.tensor([prompts[i] for i in idx])
        tokens = tokens.to(model_device(model))
        top = logits_of(model, tokens)[:, -1].argmax(-1).cpu()
        hits[idx] = top == torch.tensor([answers[i] for i in idx])
    rel = torch.tensor(relations)
    return {r: hits[rel == r].float().mean().item() for r in range(N_RELATIONS)}


def make_tokenizer() -> Any:
    """A word-level HF tokenizer for this vocabulary: `tok(to_text(ids))` gives [BOS] + ids, with
    character offsets (so `analysis.facts.prepare_facts` finds the subject's tokens). The same
    construction as `analysis.tasks.token_kv.make_tokenizer`, over these words."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" +"), behavior="removed")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<pad>", pad_token="<pad>")
