"""Facts organisms: the synthetic facts task, its recipes, and known answers on the shipped checkpoints.

Glossary
    knowledge base  analysis/facts_task.py: 300 multi-token subjects x 4 relations -> attribute
    round trip      facts dicts -> analysis.facts.prepare_facts: every fact kept, the ids are the task's
                    ids, the subject mask covers exactly the subject's name tokens, the answer is the
                    attribute token
    shipped     every loaders/organisms/<name>/ whose accuracy.json says "task": "facts"
    card table  accuracy.json: {relation: accuracy} on the whole knowledge base, reproduced here through
                OUR hooked model organism by name, within 2 points
    HF oracle   the same directory organism by transformers; logits must agree within 1e-4 of max |logit|
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from analysis.tasks import synthetic_facts as ft
from analysis.tasks.known_facts import SOURCE_SETS, prepare_facts
from loaders import from_pretrained
from loaders.organisms import accuracy, available_for, organism_path
from scripts.train_organisms import RECIPES, build, export, train

FACTS_RECIPES = sorted(n for n, r in RECIPES.items() if r.task == "facts")
SHIPPED = available_for("facts")


# ------------------------------------------------------------------------------------ the task
def test_knowledge_base_is_fixed_distinct_and_prefix_free():
    subjects, attributes = ft.knowledge_base()
    assert (subjects, attributes) == ft.knowledge_base.__wrapped__(ft.KB_SEED)  # seeded, not cached luck
    assert len(subjects) == len(set(subjects)) == ft.N_SUBJECTS
    assert {len(s) for s in subjects} == set(ft.SUBJECT_LENGTHS)
    for s in subjects:
        assert all(ft.NAME0 <= t < ft.ATTR0 for t in s)
        assert not any(t != s and t[:len(s)] == s for t in subjects)  # no subject starts another
    assert all(ft.ATTR0 <= a < ft.D_VOCAB for row in attributes for a in row)
    facts = ft.facts()
    pairs = [(f["subject"], f["relation_id"]) for f in facts]
    assert len(pairs) == len(set(pairs)) == ft.N_SUBJECTS * ft.N_RELATIONS
    assert len({f["known_id"] for f in facts}) == len(facts)


def test_facts_round_trip_through_prepare_facts():
    tok = ft.make_tokenizer()
    facts = ft.facts()
    prompts, skipped = prepare_facts(tok, facts)
    assert not skipped and len(prompts) == len(facts)
    subjects, attributes = ft.knowledge_base()
    for fp in prompts:
        s, r = divmod(fp.fact["known_id"], ft.N_RELATIONS)
        ids = ft.prompt_ids(subjects[s], r)
        assert fp.ids == ids and tok(ft.to_text(ids))["input_ids"] == ids
        start = 1 + ft.TEMPLATES[r].split("{}")[0].count(" ")  # <bos> then the words before the subject
        assert [p for p, x in enumerate(fp.subject) if x] == list(range(start, start + len(subjects[s])))
        assert fp.special == [True] + [False] * (len(ids) - 1)
        assert fp.answer == attributes[s][r]
        assert fp.source_positions("last") == [len(ids) - 1] and fp.source_positions("first") == [0]
        rel = fp.source_positions("relation")
        assert set(rel) | set(fp.source_positions("subject")) == set(range(1, len(ids)))
        subject = fp.source_positions("subject")
        assert min(rel) < min(subject) and max(subject) < max(rel) == len(ids) - 1  # words on both sides


def test_training_batch_labels_are_the_attributes():
    tokens, labels = ft.training_batch(32, torch.Generator().manual_seed(3))
    answer = {tuple(ft.prompt_ids(s, r)): a[r] for s, a in zip(*ft.knowledge_base()) for r in range(ft.N_RELATIONS)}
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        at = [p for p, t in enumerate(lab) if t != -100]
        assert len(at) == 1
        prompt = row[:at[0] + 1]
        assert all(t == ft.PAD for t in row[at[0] + 1:])
        assert lab[at[0]] == answer[tuple(prompt)]


def test_accuracy_table_counts_the_top1_answer():
    """A 'model' that returns the knowledge base's answer as its logits scores 1 on every relation."""
    lookup = {tuple(ft.prompt_ids(s, r)): a[r] for s, a in zip(*ft.knowledge_base()) for r in range(ft.N_RELATIONS)}

    def oracle(tokens):
        logits = torch.zeros(*tokens.shape, ft.D_VOCAB)
        for b, row in enumerate(tokens.tolist()):
            logits[b, -1, lookup[tuple(row)]] = 1.0
        return logits

    assert ft.accuracy_table(oracle) == {r: 1.0 for r in range(ft.N_RELATIONS)}


# ------------------------------------------------------------------------------ training script
@pytest.mark.parametrize("name", FACTS_RECIPES)
def test_facts_recipe_trains_a_few_steps_and_exports(name, tmp_path):
    recipe = dataclasses.replace(RECIPES[name], steps=2, steps2=1, batch=4, warmup=1)
    model, summary = train(name, recipe, tmp_path / "work", save_every=2, log=lambda s: None)
    assert summary["steps"] == 3 and (tmp_path / "work" / "state.pt").is_file()
    fresh = build(recipe)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    table = export(name, recipe, model, summary, tmp_path / "out")
    assert set(table) == set(range(ft.N_RELATIONS)) and all(0 <= v <= 1 for v in table.values())
    card = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    assert card["task"] == "facts" and card["n_samples"] == len(ft.facts())
    assert {int(k) for k in card["accuracy"]} == set(table)
    hooked = from_pretrained(tmp_path / "out")
    tokens = torch.tensor([ft.prompt_ids(ft.knowledge_base()[0][0], 2)])
    with torch.no_grad():
        ref = model(tokens).logits
        torch.testing.assert_close(hooked(tokens), ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    assert hooked.to_str_tokens(tokens[0])[:3] == ["<bos>", "the", "R2"]


def test_stop_acc_ends_training(tmp_path):
    recipe = dataclasses.replace(RECIPES["mamba2-facts"], steps=1000, steps2=0, batch=2, stop_acc=0.0, minutes=None)
    _, summary = train("mamba2-facts", recipe, tmp_path, log=lambda s: None)
    assert summary["steps"] == 50  # the first step with 50 steps of training accuracy to average


# ---------------------------------------------------------------------------- shipped checkpoints
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_facts_accuracy_reproduced_by_hooked_model(name, organism):
    card = accuracy(name)
    table = ft.accuracy_table(organism(name), seed=card["seed"])
    for r, acc in card["accuracy"].items():
        assert abs(table[r] - acc) <= 0.02, (r, table[r], acc)
    assert organism(name).to_str_tokens("R1 of N03 N17 is") == ["<bos>", "R1", "of", "N03", "N17", "is"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_facts_logits_match_hf(name, organism):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(organism_path(name)).eval()
    subjects = ft.knowledge_base()[0]
    tokens = torch.tensor([ft.prompt_ids(subjects[s], 2) for s in range(40) if len(subjects[s]) == 3])
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = organism(name)(tokens)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", SHIPPED)
def test_info_flow_runs_on_shipped_facts_organism(name, organism):
    from analysis.info_flow import info_flow

    model = organism(name)
    result = info_flow(model, ft.facts()[:60], window=1, n=12, batch_size=6, progress=False)
    n_layers = model.cfg.n_layers
    assert result.changes.shape == (len(result.facts), len(SOURCE_SETS), n_layers) and len(result.facts) >= 6
    assert torch.isfinite(result.changes).all() and (result.changes >= -100 - 1e-9).all()
