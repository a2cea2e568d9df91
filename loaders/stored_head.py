"""Tied or not: follow the checkpoint, as HF's `from_pretrained` does.

HF (5.24) ties the output projection to the embedding (`tie_word_embeddings`) unless the checkpoint
stores its own `lm_head.weight` with values other than the embedding's: that head is then loaded as it
is, untied ("both are present in the checkpoints with different values, so we will NOT tie them"),
whatever the config says. Checked against HF's own `from_pretrained` for Qwen3.5, Llama, Mamba, GPT-2,
Gemma 2 and Zamba2 in tests/test_load_errors.py. `from_hf` sees the same through tensor identity: a head
that is the embedding's own tensor is tied, another tensor with other values is not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

HEAD_KEYS = ("lm_head.weight",)
EMBED = "embed.weight"  # our embedding's parameter in every key map


class _NoKey:
    names: tuple[str, ...] = ()


_NO_KEY = _NoKey()


def follow_stored_head(cfg: Any, arch: Any, source: Any) -> Any:
    """`cfg` with `tied=False` when it ties the head but the source stores a head of its own whose values
    differ from the embedding's; `cfg` unchanged otherwise (no stored head, the embedding's tensor under a
    second name, or equal values)."""
    if not getattr(cfg, "tied", False) or "tied" not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    present = set(source.keys())
    head = next((n for n in HEAD_KEYS if n in present), None)
    embed = next((n for n in arch.key_map(cfg).get(EMBED, _NO_KEY).names if n in present), None)
    if head is None or embed is None:
        return cfg
    identity = getattr(source, "identity", lambda n: None)
    if identity(head) is not None and identity(head) == identity(embed):
        return cfg  # from_hf: the head is the embedding's own tensor
    if source.shape(head) == source.shape(embed) and torch.equal(source.read(head), source.read(embed)):
        return cfg
    return dataclasses.replace(cfg, tied=False)
