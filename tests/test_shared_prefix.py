"""Shared-prefix choice scoring (analysis/tasks/shared_prefix.py) against the whole-row path: plain, under
ablation, with replicas, resumed at a layer, and the fallback when the decoding state is refused;
DecodeState.select / entries_of and the state's start_at_layer / stop_at_layer rules."""

from __future__ import annotations

import pytest
import torch
from test_ga import TOK, _bpe_with_boundary_merges, _model

from analysis.interventions.ablation import ablate_heads, ablate_heads_rows
from analysis.ga.ranking import head_units
from analysis.tasks.scoring import ChoiceScorer, common_prefix
from analysis.tasks.text import Example, encode, kv_retrieval, multiple_choice
from hooked.models.decode_state import DecodeState

ARCHS = ["gpt2", "llama", "mamba", "mamba2", "zamba2"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _examples():
    """Multi-token choices, several dictionary sizes (left padding), 3 to 5 choices per example."""
    return (kv_retrieval(3, 3, seed=2) + kv_retrieval(5, 2, seed=5) + [multiple_choice("Pick one", ["red", "green", "blue"], 2)]
            + [Example("x is", ["12", "13", "2", "24"], 0)])


def _both(model, examples, batch_size=3):
    return ChoiceScorer(model, examples, batch_size), ChoiceScorer(model, examples, batch_size, shared_prefix=False)


def _close(a, b):
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], **TOL)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_shared_prefix_equals_whole_rows(arch, tokenizer):
    tok = TOK if tokenizer == "char" else _bpe_with_boundary_merges()
    model = _model(arch, tok)
    examples = _examples()
    if tokenizer == "bpe":  # the merge across the prompt/choice boundary must occur
        assert any(common_prefix(encode(tok, e.prompt), encode(tok, e.prompt + c)) < len(encode(tok, e.prompt))
                   for e in examples for c in e.choices)
    shared, rows = _both(model, examples)
    assert sum(len(b.tokens) for b in shared.prefix_batches) == len(examples)  # one prefix row per example
    assert sum(len(b.tokens) for b in rows.batches) > len(examples)
    _close(shared.scores(), rows.scores())


@pytest.mark.parametrize("arch", ARCHS)
def test_under_ablation_replicas_and_resume(arch):
    """The ablation applies in the prefix and the continuation forward; r ablations per forward; resumed
    at each layer from the clean run (Zamba2's shared heads too)."""
    model = _model(arch)
    shared, rows = _both(model, _examples())
    units = head_units(model, channel_group=8)
    layers = sorted({u.layer for u in units})
    first = {layer: [u for u in units if u.layer == layer][:3] for layer in layers}
    for layer, resumes in shared.prefixes(layers):
        groups = [u.specs() for u in first[layer]]
        with ablate_heads(model, groups[0]):
            expected = rows.scores()
            _close(shared.scores(), expected)
            _close(shared.scores(layer, resumes), expected)
        with ablate_heads_rows(model, groups):
            batched = shared.scores(layer, resumes, replicas=len(groups))
            assert batched.shape[0] == len(groups)
            _close(shared.scores(replicas=len(groups)), batched)
        for group, got in zip(groups, batched):
            with ablate_heads(model, group):
                _close(got, rows.scores())


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_refused_state_falls_back_to_whole_rows(arch):
    """An SSM's lazy hook (hook_h) cannot be served from a state: the scorer scores whole rows instead,
    also when resuming from the shared path's clean run."""
    model = _model(arch)
    shared, rows = _both(model, _examples())
    seen = []

    def halve(h, hook):
        seen.append(h.shape[1])
        return h * 0.5

    name = "blocks.1.mixer.hook_h"
    with model.hooks(fwd_hooks=[(name, halve)]):
        expected = rows.scores()
        n_rows = len(seen)
        got = shared.scores()
    _close(got, expected)
    assert len(seen) > n_rows  # the hook ran again (whole rows) after the refused prefix forward
    with torch.no_grad():
        plain = rows.scores()
    assert not torch.allclose(plain, expected)  # the hook changed the scores: the fallback kept it
    for layer, resumes in shared.prefixes([1]):
        with model.hooks(fwd_hooks=[(name, halve)]):
            _close(shared.scores(layer, resumes), expected)


def test_context_uses_whole_rows():
    model = _model("llama")
    shared, _ = _both(model, _examples())
    batches = []

    def context(batch):
        batches.append(batch)
        return torch.no_grad()

    shared.scores(context=context)
    assert batches == shared.batches  # masking experiments see the whole rows with their segments


@pytest.mark.parametrize("arch", ["llama", "mamba2", "zamba2"])
def test_decode_state_select_and_entries_of(arch):
    model = _model(arch)
    tokens = torch.randint(4, 100, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        full = model(tokens, mask)
        state = DecodeState()
        model(tokens[:, :6], mask[:, :6], state=state)
        index = torch.tensor([2, 0, 0, 1])
        picked = state.select(index)
        assert picked.length == 6 and torch.equal(picked.next_position, state.next_position[index])
        step = model(tokens[index, 6:], state=picked)
        torch.testing.assert_close(step, full[index, 6:], **TOL)
        # the original state is untouched by the selected one's forward
        torch.testing.assert_close(model(tokens[:, 6:], state=state), full[:, 6:], **TOL)
    below = [m for m in model.blocks[0].modules()]
    kept = state.entries_of(below)
    assert kept.entries and kept.length == 0 and kept.next_position is None and kept.past_mask is None
    assert {key[0] for key in kept.entries} <= {id(m) for m in below}
    assert all(kept.entries[key] is state.entries[key] for key in kept.entries)  # shared, not copied


def test_state_rules_for_layer_ranges():
    model = _model("llama")
    tokens = torch.randint(4, 100, (2, 5))
    with pytest.raises(ValueError, match="stop_at_layer must be the last"):
        model(tokens, state=DecodeState(), stop_at_layer=1)
    with torch.no_grad():  # stop_at_layer = n_layers: the final residual
        resid = model(tokens, state=DecodeState(), stop_at_layer=model.cfg.n_layers)
        torch.testing.assert_close(model.unembed(model.ln_final(resid)), model(tokens), **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_attribution_estimates_equal_whole_rows(arch):
    """The screen's first-order estimates through the shared prefix (a prompt write feeds every choice via
    the state) equal the whole-row ones (each row's copy of it summed): the same total derivative."""
    from analysis.ga.screening import estimate_effects

    model = _model(arch)
    shared, rows = _both(model, _examples())
    units = head_units(model, channel_group=8)
    a, b = estimate_effects(model, shared, units), estimate_effects(model, rows, units)
    for u in units:
        for key in ("est_logprob_drop", "est_margin_drop"):
            assert a[u.label][key] == pytest.approx(b[u.label][key], abs=1e-5), (u.label, key)
