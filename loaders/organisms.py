"""Shipped model organisms: small checkpoints trained on synthetic tasks, loadable by name.

Glossary
    organism     a tiny HF-format checkpoint in loaders/organisms/<name>/ (config.json,
                 model.safetensors, word-level tokenizer files, CARD.md, accuracy.json), trained by
                 scripts/train_organisms.py on the KV task of analysis/kv_task.py
    name         "organism/<name>", e.g. "organism/mamba2-kv"; `from_pretrained` resolves it here
    card         CARD.md: task format, vocabulary, accuracy per n, training steps and time, seed
    accuracy.json  the card's table as data: {"fmt", "n_samples", "seed", "accuracy": {n: acc}}

The checkpoints carry their own tokenizer files, so a loaded organism has `model.tokenizer` and
`model.to_str_tokens` works on text like "K03 : V12 \\n ? K03" and on token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ORGANISMS_DIR = Path(__file__).parent / "organisms"
PREFIX = "organism/"


def available() -> list[str]:
    """Names of the shipped organisms (directories with a config.json)."""
    if not ORGANISMS_DIR.is_dir():
        return []
    return sorted(d.name for d in ORGANISMS_DIR.iterdir() if (d / "config.json").is_file())


def is_organism(name: str) -> bool:
    return str(name).lower().startswith(PREFIX)


def organism_path(name: str) -> Path:
    """The checkpoint directory of "organism/<name>" (or a bare "<name>")."""
    short = str(name)[len(PREFIX):] if is_organism(name) else str(name)
    path = ORGANISMS_DIR / short.lower()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no organism {short!r}; shipped: {', '.join(available()) or 'none'}")
    return path


def card(name: str) -> str:
    """The organism's CARD.md text."""
    return (organism_path(name) / "CARD.md").read_text()


def task(name: str) -> str:
    """The organism's task: "kv" (analysis.tasks.token_kv) or "facts" (analysis.tasks.synthetic_facts)."""
    return accuracy(name).get("task", "kv")


def available_for(task_name: str) -> list[str]:
    """The shipped organisms trained on `task_name`."""
    return [n for n in available() if task(n) == task_name]


def accuracy(name: str) -> dict[str, Any]:
    """The card's accuracy table as data: {"fmt", "n_samples", "seed", "accuracy": {n: acc}} with int n."""
    data = json.loads((organism_path(name) / "accuracy.json").read_text())
    data["accuracy"] = {int(n): float(a) for n, a in data["accuracy"].items()}
    return data
