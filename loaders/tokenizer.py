"""Tokenizers for loaded models: transformers' AutoTokenizer for checkpoint directories, GGUF's own.

Glossary
    tokenizer files  what AutoTokenizer reads from a directory: tokenizer.json, tokenizer_config.json,
                     vocab.json + merges.txt (GPT-2 BPE), tokenizer.model (sentencepiece), ...
    pad token        the id used to fill padded positions; many causal LMs define none, so it is set
                     to the EOS token (the padded positions are masked, the id only has to exist)

A checkpoint without tokenizer files gives `None`: the model still runs on token ids, and
`model.to_tokens` raises a clear error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    d = Path(directory)
    return any((d / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(directory: str | os.PathLike) -> Any | None:
    """AutoTokenizer.from_pretrained(directory) when the directory has tokenizer files, else None."""
    if not has_tokenizer(directory):
        return None
    from transformers import AutoTokenizer

    # trust_remote_code=False: a tokenizer_config `auto_map` naming shipped code is neither run nor asked about
    return prepare_tokenizer(AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False))


def load_gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer stored in a GGUF file (its vocabulary, merges and special tokens)."""
    from loaders.gguf import load_gguf_tokenizer as _load

    return prepare_tokenizer(_load(path))


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Give a tokenizer a pad token when it has none (its EOS token), so batches can be padded."""
    if tokenizer is not None and getattr(tokenizer, "pad_token", None) is None \
            and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
