"""Attribution estimates of every unit kind: heads, Mamba-2 heads, Mamba-1 channel groups and
mixture-of-experts experts; each estimate is the exact first-order change (central finite difference
of a scaled ablation), and screened rankings now screen experts instead of always verifying them.

Glossary
    scaled ablation   the unit's write multiplied by (1 - t) (an expert: its routing weights where it is
                      chosen); t = 1 is the zero ablation, so d q / d t at t = 0 is the estimate of q's change
    finite difference (q(t) - q(-t)) / (2 t) at t = 1e-2, float64 models (the scorer rounds log-probs to
                      float32, so a smaller t would measure rounding)
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_hf

from analysis.ga import expert_units, head_units, rank_heads
from analysis.ga.ranking import candidates
from analysis.ga.screening import write_attributions
from analysis.interventions.ablation import _write_mask, attached, head_layout
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import char_tokenizer, kv_retrieval
from loaders.load import from_hf

sys.path.insert(0, str(Path(__file__).parent))
from test_ga import CONFIGS  # noqa: E402
from test_hybrid_analysis import FAMILIES  # noqa: E402

T = 1e-2


def _model(name: str):
    if name in CONFIGS:
        model = from_hf(build_tiny_hf(CONFIGS[name](), seed=0, perturb=0.1, dtype=torch.float64))
    else:
        model = from_hf(build_tiny_hf(FAMILIES[name](), seed=0, perturb=0.1, dtype=torch.float64))
    model.tokenizer = char_tokenizer()
    return model


@contextlib.contextmanager
def _scaled(model, unit, t: float):
    """The unit's write (an expert: its routing weights) times (1 - t)."""
    if unit.kind == "expert":
        seen = {}

        def on_chosen(chosen, hook):
            seen["c"] = chosen

        def on_weights(w, hook):
            return torch.where(seen.pop("c") == unit.heads[0], (1 - t) * w, w)

        hooks = [(f"{unit.module}.hook_chosen", on_chosen, False), (f"{unit.module}.hook_routing_weights", on_weights,
                                                                      False)]
    else:
        module = head_layout(model)[unit.module]

        def on_write(act, hook):
            return torch.where(_write_mask(module, list(unit.heads), act.device), (1 - t) * act, act)

        hooks = [(module.hook, on_write, False)]
    with attached(model, hooks):
        yield


def _quantities(scorer, scores):
    answers = scorer.answers()
    right = scores.gather(1, answers[:, None])[:, 0]
    others = scores.scatter(1, answers[:, None], float("-inf")).max(-1).values
    return {"margin": right - others, "logprob": scores.log_softmax(-1).gather(1, answers[:, None])[:, 0]}


# (model, which units): attention heads, Mamba-2 heads, Mamba-1 channel groups, Zamba2 shared heads, experts
CASES = [("llama", "head"), ("gpt2", "head"), ("mamba2", "head"), ("mamba", "head"), ("zamba2", "head"),
         ("granite", "expert"), ("nemotron_h", "expert"), ("jamba", "expert"), ("jamba", "head")]


@pytest.mark.parametrize("name, kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_estimate_is_the_first_order_change_of_the_scaled_ablation(name, kind):
    model = _model(name)
    scorer = ChoiceScorer(model, kv_retrieval(3, 4, seed=2), batch_size=8)
    units = head_units(model, channel_group=8) if kind == "head" else expert_units(model)
    units = units[:: max(1, len(units) // 4)][:4]  # a few per model, spread over its layers
    att = write_attributions(model, scorer, sorted({u.module for u in units}))
    checked = 0
    for u in units:
        with _scaled(model, u, T):
            up = _quantities(scorer, scorer.scores())
        with _scaled(model, u, -T):
            down = _quantities(scorer, scorer.scores())
        for key in ("margin", "logprob"):
            fd = (up[key] - down[key]) / (2 * T)  # d q / d t: the change per unit of ablation
            est = att[key][u.module][:, list(u.heads)].sum(-1)
            scale = max(fd.abs().max().item(), 1e-3)
            torch.testing.assert_close(est, fd, rtol=0, atol=1e-3 * scale + 1e-4, msg=lambda m, u=u, key=key: f"{u.label} {key}: {m}")
            checked += int(fd.abs().max() > 1e-6)
    assert checked >= 2, "every unit's effect is ~0: the test cannot fail"


def test_channel_group_units_get_estimates_of_their_summed_channels():
    model = _model("mamba")
    scorer = ChoiceScorer(model, kv_retrieval(3, 4, seed=2), batch_size=8)
    groups = head_units(model, channel_group=8)
    singles = head_units(model, channel_group=1)
    att = write_attributions(model, scorer, sorted({u.module for u in groups}))
    g = groups[1]
    assert len(g.heads) == 8 and g.label.startswith("L0C8")
    parts = [u for u in singles if u.module == g.module and u.heads[0] in g.heads]
    whole = att["logprob"][g.module][:, list(g.heads)].sum(-1)
    torch.testing.assert_close(whole, sum(att["logprob"][u.module][:, u.heads[0]] for u in parts), rtol=1e-12,
                               atol=1e-12)


def test_screened_ranking_screens_experts_and_verifies_them_exactly():
    model = _model("granite")
    examples = kv_retrieval(2, 3, seed=1)
    units = expert_units(model)
    ex = rank_heads(model, examples, units, batch_size=4, pairs_top_k=2, progress=False)
    sc = rank_heads(model, examples, units, method="screened", verify_top=2, n_control=1, batch_size=4,
                    pairs_top_k=2, progress=False)
    exact = {r["unit"]: r for r in ex.rows}
    experts = [r for r in sc.rows if r["kind"] == "expert"]
    assert len(experts) == 12 and all(math.isfinite(r["est_logprob_drop"]) for r in experts)
    est = {r["unit"]: {k: r[k] for k in ("est_drop", "est_logprob_drop", "est_margin_drop")} for r in experts}
    picked = {u.label for u in candidates(units, est, 2)} | set(sc.screen["control_units"])
    assert {r["unit"] for r in experts if r["verified"]} == picked and 3 <= len(picked) < 12  # screened
    for r in sc.rows:
        if r["verified"]:
            assert (r["accuracy"], r["logprob"]) == (exact[r["unit"]]["accuracy"], exact[r["unit"]]["logprob"])


def test_experts_refuse_mean_ablation_estimates():
    model = _model("granite")
    scorer = ChoiceScorer(model, kv_retrieval(2, 2, seed=1), batch_size=4)
    with pytest.raises(ValueError, match="zero-ablated only"):
        write_attributions(model, scorer, [expert_units(model)[0].module], mode="mean")
    with pytest.raises(ValueError, match="neither head modules nor mixture-of-experts"):
        write_attributions(model, scorer, ["blocks.0.nothing"])


@pytest.mark.parametrize("name", ["llama", "mamba2", "granite"])
def test_per_choice_estimates_are_first_order_changes_of_each_choice_score(name):
    model = _model(name)
    scorer = ChoiceScorer(model, kv_retrieval(3, 4, seed=2), batch_size=8)
    units = (head_units(model) + expert_units(model))[:: 3][:4]
    att = write_attributions(model, scorer, sorted({u.module for u in units}), per_choice=True)
    assert att["quantities"] == [f"choice{c}" for c in range(scorer.n_choices)]
    t = T / 10  # Granite's later MoE routing flips within t = 1e-2 of one of these units
    for u in units:
        with _scaled(model, u, t):
            up = scorer.scores()
        with _scaled(model, u, -t):
            down = scorer.scores()
        fd = (up - down) / (2 * t)  # [example choice]
        est = torch.stack([att[f"choice{c}"][u.module][:, list(u.heads)].sum(-1) for c in range(scorer.n_choices)], -1)
        torch.testing.assert_close(est, fd, rtol=0, atol=2e-3 * max(fd.abs().max().item(), 1e-3) + 5e-4,
                                   msg=lambda m, u=u: f"{u.label}: {m}")
