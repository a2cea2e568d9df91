"""The clean run a scorer keeps (ChoiceScorer(keep_clean=True)), runs resumed under an intervention
(`prefixes(layers, start_at_layer, resids)`), the pair trees built on them, and the accuracy table reading
the ranking's baseline: each against runs from scratch."""

from __future__ import annotations

import pytest
import torch
from test_ga import _model

from analysis.ga.ranking import Unit, _pairs_exact, ablated, head_units, pair_trees, rank_heads, ranking_scorer
from analysis.ga.report import accuracy_by_size
from analysis.interventions.ablation import ablate_heads
from analysis.interventions.patching import layer_inputs
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example, kv_retrieval, multiple_choice
from hooked.models.decode_state import StateRefused

TOL = dict(rtol=1e-5, atol=1e-5)


def _examples():
    return (kv_retrieval(3, 3, seed=2) + kv_retrieval(5, 2, seed=5)
            + [multiple_choice("Pick one", ["red", "green", "blue"], 2), Example("x is", ["12", "13", "2", "24"], 0)])


def _close(a, b):
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], **TOL)


def _counting(model):
    """A hook on every block's resid_pre that counts its calls per layer."""
    calls = {layer: 0 for layer in range(model.cfg.n_layers)}

    def count(layer):
        def hook(x, hook):
            calls[layer] += 1
        return hook

    return calls, [(f"blocks.{layer}.hook_resid_pre", count(layer)) for layer in calls]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mamba2", "zamba2"])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_kept_clean_run_is_made_once_and_equals_fresh_runs(arch, shared_prefix):
    model = _model(arch)
    kept = ChoiceScorer(model, _examples(), 3, shared_prefix, keep_clean=True)
    fresh = ChoiceScorer(model, _examples(), 3, shared_prefix)
    rows = ChoiceScorer(model, _examples(), 3, shared_prefix=False)
    calls, counters = _counting(model)
    layers = list(range(model.cfg.n_layers))
    with model.hooks(fwd_hooks=counters):
        base = kept.clean_scores()
        once = dict(calls)
        resumes = dict(kept.prefixes(layers))
        again = dict(kept.prefixes(layers[1:]))
        assert torch.equal(kept.clean_scores(), base)  # read again, not run again
    assert calls == once and once[0] == (2 * len(kept.prefix_batches) if shared_prefix else len(kept.batches))
    torch.testing.assert_close(base, fresh.scores(), rtol=0, atol=1e-6)
    for layer in layers[1:]:
        assert all(x is y for x, y in zip(again[layer], resumes[layer], strict=True))
    units = head_units(model, channel_group=8)
    for layer in layers:
        unit = next(u for u in units if u.layer == layer)
        with ablate_heads(model, unit.specs()):
            expected = rows.scores()
            _close(kept.scores(layer, resumes[layer]), expected)
            _close(fresh.scores(layer, dict(fresh.prefixes([layer]))[layer]), expected)


def test_clean_scores_refuses_when_the_hooks_changed():
    model = _model("llama")
    kept = ChoiceScorer(model, _examples(), 3, keep_clean=True)
    base = kept.clean_scores()
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x * 0.5)]):
        with pytest.raises(RuntimeError, match="kept run saw hooks on nothing"):
            kept.clean_scores()
        assert not torch.allclose(kept.scores(), base)  # scores() runs the model as it is
    assert torch.equal(kept.clean_scores(), base)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "zamba2"])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_resumes_from_an_intervention_run_carry_it(arch, shared_prefix):
    """A run from layer la with unit a ablated, resumed at lb with b ablated too == both ablated from scratch."""
    model = _model(arch)
    scorer = ChoiceScorer(model, _examples(), 3, shared_prefix, keep_clean=True)
    rows = ChoiceScorer(model, _examples(), 3, shared_prefix=False)
    units = head_units(model, channel_group=8)
    n = model.cfg.n_layers
    a = next(u for u in units if u.layer == 0)
    clean = dict(scorer.prefixes(range(n)))
    calls, counters = _counting(model)
    with ablated(model, [a]):
        with model.hooks(fwd_hooks=counters):
            later = dict(scorer.prefixes([1], 0, clean[0]))
        assert calls[0] > 0 and all(calls[layer] == 0 for layer in range(2, n))  # stops at block 1
        assert all(not r.clean for r in later[1]) if shared_prefix else True
    for b in [u for u in units if u.layer == 1][:2]:
        with ablated(model, [a, b]):
            expected = rows.scores()
            _close(scorer.scores(1, later[1]), expected)
        with ablated(model, [b]):
            assert not torch.allclose(scorer.scores(1, clean[1]), expected, **TOL)  # a's ablation mattered


def test_an_intervention_resume_never_falls_back_to_the_clean_rows():
    """A lazy SSM hook refuses the state; whole rows would restart from the clean run, losing the earlier
    intervention: StateRefused, for the caller to run from the intervention's own layer."""
    model = _model("mamba")
    scorer = ChoiceScorer(model, _examples(), 3, keep_clean=True)
    units = head_units(model, channel_group=8)
    a = next(u for u in units if u.layer == 0)
    clean = dict(scorer.prefixes([0, 1]))
    with ablated(model, [a]):
        later = dict(scorer.prefixes([1], 0, clean[0]))
    with model.hooks(fwd_hooks=[("blocks.1.mixer.hook_h", lambda h, hook: h * 0.5)]):
        with pytest.raises(StateRefused):
            scorer.scores(1, later[1])
        scorer.scores(1, clean[1])  # a clean resume still falls back


def test_prefix_runs_stop_at_their_last_layer():
    model = _model("llama")
    scorer = ChoiceScorer(model, _examples(), 3)
    calls, counters = _counting(model)
    with model.hooks(fwd_hooks=counters):
        dict(scorer.prefixes([0, 1]))
    assert calls[1] > 0 and calls[2] == 0


def _pairs(model):
    units = head_units(model, channel_group=8)
    low = [u for u in units if u.layer == 0][:2]
    high = [u for u in units if u.layer > 0]
    return [(a, b) for a in low for b in high[:3] + high[-2:]] + [(high[0], high[-1]), (low[0], low[1])]


@pytest.mark.parametrize("arch", ["llama", "zamba2", "mamba2"])
def test_pair_trees_equal_pairs_ablated_from_scratch(arch):
    """Pairs under a shared first unit (run with it ablated up to the partners' layers) == each pair ablated
    on whole rows from scratch; Mamba-2's head hooks refuse the state, so its pairs fall back to direct runs."""
    model = _model(arch)
    pairs = _pairs(model)
    assert pair_trees(pairs, model.cfg.n_layers)  # the case is exercised
    scorer = ranking_scorer(model, _examples(), 3)
    assert scorer.keep_clean
    rows = ChoiceScorer(model, _examples(), 3, shared_prefix=False)
    got = _pairs_exact(model, scorer, pairs, "zero", None, True, False)
    for a, b in pairs:
        with ablated(model, [a, b]):
            _close(got[(a.label, b.label)], rows.scores())


def test_pair_trees_rule_on_the_smollm2_pairs():
    """SmolLM2's 21 report pairs (30 layers): a root gets a tree when one run with it ablated up to its last
    partner plus each pair from its partner's layer runs fewer layers than every pair from the root's."""
    def unit(label):
        layer, head = label[1:].split("H")
        return Unit(label, int(layer), f"blocks.{layer}.attn", (int(head),))

    top = [unit(s) for s in ("L11H6", "L19H1", "L1H3", "L16H1", "L11H2", "L16H0", "L9H0")]
    pairs = [(a, b) for i, a in enumerate(top) for b in top[i + 1:]]
    trees = pair_trees(pairs, 30)
    # L1H3: (19 - 1) + (21 + 19 + 19 + 14 + 14 + 11) = 116 < 6 * 29; L16H1 + L19H1: 3 + 11 = 14, not < 14
    assert sorted(r.label for r in trees) == ["L11H2", "L11H6", "L1H3", "L9H0"]
    assert len(trees[top[2]]) == 6 and all(top[2] in p for p in trees[top[2]])
    assert ("L11H6", "L11H2") not in {(a.label, b.label) for g in trees.values() for a, b in g}  # one layer: direct


def test_accuracy_table_reads_the_ranking_baseline():
    model = _model("llama")
    examples = kv_retrieval(3, 4, seed=0)
    scorer = ranking_scorer(model, examples, 4)
    plain = accuracy_by_size(model, [3, 4], 6, 0, 4)
    reused = accuracy_by_size(model, [3, 4], 6, 0, 4, known=(examples, scorer.clean_scores()))
    assert [r["reused"] for r in reused] == [4, 0] and [r["reused"] for r in plain] == [0, 0]
    for p, r in zip(plain, reused):
        assert p["accuracy"] == r["accuracy"] and p["accuracy_lo"] == r["accuracy_lo"]
        assert p["logprob"] == pytest.approx(r["logprob"], abs=1e-6)


def test_rank_heads_rejects_a_scorer_of_other_examples():
    model = _model("llama")
    with pytest.raises(ValueError, match="same examples"):
        rank_heads(model, kv_retrieval(3, 4, seed=0), scorer=ranking_scorer(model, kv_retrieval(3, 4, seed=1)),
                   progress=False)


def test_picked_logp_unembeds_each_distinct_row_once():
    from analysis.tasks.shared_prefix import picked_logp

    model = _model("llama")
    resid = torch.randn(5, model.cfg.d_model)
    index = torch.tensor([3, 0, 3, 3, 4, 0])
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    seen = []
    with torch.no_grad(), model.hooks(fwd_hooks=[("ln_final.hook_normalized", lambda x, hook: seen.append(x.shape))]):
        got = picked_logp(model, resid, index, targets)
    naive = model.unembed(model.ln_final(resid[index][None]))[0].float().log_softmax(-1)
    torch.testing.assert_close(got, naive[torch.arange(6), targets], rtol=0, atol=1e-6)
    assert [s[-2] for s in seen] == [3]  # rows 0, 3, 4 once each


def test_prefixes_rejects_bad_resume_arguments():
    model = _model("llama")
    scorer = ChoiceScorer(model, _examples(), 3)
    clean = dict(scorer.prefixes([0, 1]))
    with pytest.raises(ValueError, match="together"):  # at the call, not at the first item
        scorer.prefixes([2], 1)
    with pytest.raises(ValueError, match="together"):
        scorer.prefixes([2], resids=clean[1])
    with pytest.raises(ValueError, match="one entry per batch"):
        scorer.prefixes([2], 1, clean[1][:1])
    with pytest.raises(ValueError, match="later layers only"):
        scorer.prefixes([1, 2], 1, clean[1])
    batch = scorer.batches[0]  # the whole-row runs underneath: analysis.interventions.layer_inputs
    resid = dict(layer_inputs(model, batch.tokens, batch.attention_mask, [1]))[1]
    with pytest.raises(ValueError, match="together"):
        next(layer_inputs(model, batch.tokens, batch.attention_mask, [2], start_at_layer=1))
    with pytest.raises(ValueError, match="later layers only"):
        next(layer_inputs(model, batch.tokens, batch.attention_mask, [1, 2], 1, resid))
