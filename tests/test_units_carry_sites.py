"""Units carry their sites: the analyses given the model map's units ablate them without asking the map again.

Oracles: the spec-based entry points (ablate_heads, ablate_heads_rows, ablate_experts), which resolve
(layer, h) specs through the map, on the same model and tokens.
"""

from __future__ import annotations

import pytest
import torch
from tiny_families import tiny

from analysis.interventions.ablation import ablate_heads, ablate_heads_rows, ablate_units, ablate_units_rows
from analysis.interventions.experts import ablate_expert_units, ablate_experts
from hooked.models.model_map import Unit, model_map

FAMILIES = ["llama", "mamba", "mamba2", "zamba2", "falcon_h1", "qwen3_next", "granite", "jamba"]


def _model(name: str):
    torch.manual_seed(0)
    return tiny(name).double().eval()


def _logits(model, tokens, ctx):
    with torch.no_grad(), ctx:
        return model(tokens)


@pytest.mark.parametrize("name", FAMILIES)
def test_ablating_units_equals_ablating_their_specs(name):
    model = _model(name)
    tokens = torch.randint(1, 60, (2, 7))
    units = model_map(model).units()
    picked = units[1::3]
    assert all(u.site is not None and u.site.path == u.module for u in units)
    got = _logits(model, tokens, ablate_units(model, picked))
    want = _logits(model, tokens, ablate_heads(model, [s for u in picked for s in u.specs()]))
    assert torch.equal(got, want)
    assert not torch.equal(got, _logits(model, tokens, torch.no_grad()))  # the ablation changed something


@pytest.mark.parametrize("name", FAMILIES)
def test_row_ablation_of_units_equals_row_ablation_of_specs(name):
    model = _model(name)
    tokens = torch.randint(1, 60, (2, 7))
    groups = [[u] for u in model_map(model).units()[:3]]
    got = _logits(model, tokens.repeat(3, 1), ablate_units_rows(model, groups))
    want = _logits(model, tokens.repeat(3, 1), ablate_heads_rows(model, [[s for u in g for s in u.specs()] for g in groups]))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["granite", "jamba"])
def test_expert_units_equal_expert_specs(name):
    model = _model(name)
    tokens = torch.randint(1, 60, (2, 7))
    experts = model_map(model).experts()[:2]
    got = _logits(model, tokens, ablate_expert_units(model, experts))
    want = _logits(model, tokens, ablate_experts(model, [s for u in experts for s in u.specs()]))
    assert torch.equal(got, want)


def test_a_unit_made_by_hand_is_placed_by_the_map_or_refused_by_name():
    model = _model("llama")
    mp = model_map(model)
    hand = Unit("L1H2", 1, "blocks.1.attn", (2,))
    with pytest.raises(ValueError, match="L1H2: made by hand"):
        hand.placed()
    placed = mp.placed([hand])[0]
    assert placed == hand and placed.site is mp.site("blocks.1.attn")
    with pytest.raises(ValueError, match="blocks.1.nothing"):
        mp.placed([Unit("L1H2", 1, "blocks.1.nothing", (2,))])
