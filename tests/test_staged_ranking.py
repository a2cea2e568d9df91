"""Staged verification of a screened ranking (rank_heads(stage_n=, stage_keep=)): which units reach which
stage, and that each stage's numbers are the exact ones (exhaustive on all prompts, on the subset)."""

from __future__ import annotations

import math

import pytest
from test_ga import _model

from analysis.ga.ranking import head_units, rank_heads
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import kv_retrieval


@pytest.mark.parametrize("arch,verify_top,keep", [("llama", 4, 4), ("mamba2", 3, 3)])
def test_staged_rows_carry_exact_numbers_per_stage(arch, verify_top, keep):
    model = _model(arch)
    examples = kv_retrieval(3, 12, seed=1)
    units = head_units(model, channel_group=8)
    kw = dict(batch_size=8, pairs_top_k=2, progress=False)
    full = {r["unit"]: r for r in rank_heads(model, examples, units, **kw).rows}
    scorer = ChoiceScorer(model, examples, 8)
    right = scorer.per_example(scorer.scores())["correct"].bool().tolist()
    prompts = sorted(([i for i in range(12) if right[i]] + [i for i in range(12) if not right[i]])[:4])
    assert 0 < sum(right) < 12  # both kinds of prompt occur: the choice of stage-1 prompts means something
    sub = {r["unit"]: r for r in rank_heads(model, [examples[i] for i in prompts], units, **kw).rows}
    staged = rank_heads(model, examples, units, method="screened", verify_top=verify_top, n_control=4, stage_n=4,
                        stage_keep=keep, pair_with=[units[-1]], **kw)
    assert staged.screen["stage_prompts"] == prompts  # the prompts answered right come first
    rows = {r["unit"]: r for r in staged.rows}
    stages = {s: [u for u, r in rows.items() if r["stage"] == s] for s in ("full", "subset", "estimate")}
    controls = [u for u, r in rows.items() if r["control"]]
    assert len(controls) == 4 and units[-1].label in stages["full"]
    # stage 1: every candidate but the pair_with unit, and the controls; the `keep` best candidates there go on
    # to every prompt, with each control that ranked above the last of them
    stage1 = sorted((u for u, r in rows.items() if not math.isnan(r["stage_drop"])),
                    key=lambda u: (-rows[u]["stage_drop"], -rows[u]["stage_logprob_drop"]))
    assert set(controls) <= set(stage1) and units[-1].label not in stage1
    leaders = [u for u in stage1 if u not in controls][:keep]
    promoted = [u for u in controls if stage1.index(u) < stage1.index(leaders[-1])]
    assert 0 < len(promoted) < len(controls)  # both fates occur (the settings are chosen for it)
    assert len(stage1) >= 4 and set(stages["full"]) == set(leaders) | {units[-1].label} | set(promoted)
    assert set(stages["subset"]) == set(stage1) - set(leaders) - set(promoted)
    assert staged.screen["n_stage1"] == len(stage1) and staged.screen["n_control_full"] == len(promoted)
    for u in stage1:  # subset numbers: the exhaustive ranking on the stage-1 prompts
        assert rows[u]["stage_drop"] == sub[u]["drop"]
        assert rows[u]["stage_logprob_drop"] == pytest.approx(sub[u]["logprob_drop"], abs=1e-6)
    for u in stages["full"]:  # full numbers: the exhaustive ones
        assert rows[u]["drop"] == full[u]["drop"] and rows[u]["verified"]
        assert rows[u]["logprob_drop"] == pytest.approx(full[u]["logprob_drop"], abs=1e-6)
    for u in stages["subset"] + stages["estimate"]:
        assert math.isnan(rows[u]["drop"]) and not rows[u]["verified"]
    order = [r["stage"] for r in staged.rows]  # full rows first, then subset, then estimate-only
    assert order == sorted(order, key=["full", "subset", "estimate"].index)


def test_one_stage_when_stage_n_covers_every_prompt():
    model = _model("llama")
    examples = kv_retrieval(3, 6, seed=1)
    units = head_units(model)
    kw = dict(method="screened", verify_top=3, n_control=1, batch_size=8, pairs_top_k=2, progress=False)
    one = rank_heads(model, examples, units, **kw)
    same = rank_heads(model, examples, units, stage_n=6, **kw)
    assert [r["unit"] for r in one.rows] == [r["unit"] for r in same.rows]
    assert same.screen["n_stage1"] == 0 and not any(r["stage"] == "subset" for r in same.rows)
    with pytest.raises(ValueError, match="stage_n"):
        rank_heads(model, examples, units, stage_n=0, **kw)
