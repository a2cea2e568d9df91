"""Export a facts organism (a recipe of scripts/train_organisms.py with task "facts"): checkpoint, tokenizer,
CARD.md and accuracy.json.

Glossary
    accuracy.json  {"task": "facts", "n_samples": 1200, "seed": knowledge-base seed, "accuracy":
                   {relation: accuracy}, "overall": accuracy}; relations are int-like keys, so
                   `loaders.organisms.accuracy` reads it like a KV card.
    card           CARD.md: the task (analysis/facts_task.py), vocabulary, accuracy per relation on the
                   whole knowledge base, training steps, time and seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from analysis.tasks import synthetic_facts as ft


def export_facts(name: str, recipe: Any, model: torch.nn.Module, summary: dict, out: Path) -> dict[int, float]:
    """Write the checkpoint, tokenizer files, CARD.md and accuracy.json; returns {relation: accuracy}."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    ft.make_tokenizer().save_pretrained(out)
    table = ft.accuracy_table(model)
    overall = sum(table.values()) / len(table)  # every relation has the same number of facts
    n = len(ft.facts())
    (out / "accuracy.json").write_text(json.dumps({"task": "facts", "n_samples": n, "seed": ft.KB_SEED,
                                                   "accuracy": {str(k): v for k, v in table.items()},
                                                   "overall": overall}, indent=1))
    (out / "CARD.md").write_text(facts_card(name, recipe, table, overall, summary))
    return table


def facts_card(name: str, r: Any, table: dict[int, float], overall: float, summary: dict) -> str:
    rows = "\n".join(f"| {rel} | `{ft.TEMPLATES[rel]}` | {acc:.3f} |" for rel, acc in table.items())
    p2 = summary.get("phase2_from")
    phase2 = f", then lr {r.lr2} from step {p2}" if p2 is not None and p2 < summary["steps"] else ""
    out_of_time = r.minutes is not None and summary["seconds"] > 60 * r.minutes
    why = (f"by a {r.minutes}-minute budget" if out_of_time
           else f"when the training accuracy of the last 50 steps reached {r.stop_acc}"
           if r.stop_acc is not None and summary["steps"] < r.steps + r.steps2 else "at the step budget")
    return f"""# organism/{name}

{r.model_class} trained from scratch to memorise the synthetic facts of `analysis/facts_task.py`.
Load: `from_pretrained("organism/{name}")` (hooked) or `transformers.{r.model_class}.from_pretrained(dir)`.
Facts in the known_1000.json format: `analysis.tasks.synthetic_facts.facts()` (or `write_facts(path)` for
`hooked knockout organism/{name} --facts PATH`).

## Task
- Vocabulary ({ft.D_VOCAB}): 0 `<pad>`, 1 `<bos>`, template words `the of is in` (2..5), relation words
  R0..R3 (6..9), name tokens N00..N{ft.N_NAMES - 1} (ids {ft.NAME0}..{ft.ATTR0 - 1}), attributes
  A00..A{ft.N_ATTRIBUTES - 1} (ids {ft.ATTR0}..{ft.D_VOCAB - 1}). The tokenizer files spell them as words.
- Knowledge base (seed {ft.KB_SEED}): {ft.N_SUBJECTS} subjects of 2 or 3 name tokens (distinct, none a prefix of
  another), 4 relations, an attribute drawn uniformly for every (subject, relation): {len(ft.facts())} facts.
- Prompt: `<bos>` then the relation's template with the subject's names in place of `{{}}`; the next token
  is the attribute. Every template has words before and after the subject; the last word (`is` or `in`)
  is shared by two relations.

## Accuracy
Top-1 next token over the whole vocabulary, every fact of the knowledge base
(`analysis.tasks.synthetic_facts.accuracy_table(model)`); overall {overall:.3f} (chance 1/32 = 0.031):

| relation | template | accuracy |
|---|---|---|
{rows}

## Training
`python scripts/train_organisms.py {name}`: seed {r.seed}, batch {r.batch} facts drawn with replacement,
loss on the answer only, AdamW betas (0.9, 0.98), weight decay 0.01, warmup {r.warmup} then lr {r.lr}{phase2},
clip 1.0. Stopped {why}: {summary['steps']} steps in {summary['seconds'] / 60:.1f} min on one shared CPU
thread. Config: `{json.dumps(r.config)}`.
{r.notes}
"""
