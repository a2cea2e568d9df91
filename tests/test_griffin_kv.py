"""organism/griffin-kv's measured circuit (docs/results/organisms/griffin_kv/README.md), n = 8, 200 prompts: the
RG-LRU block's conv gathers (the query key reaches `?` through its taps, not through the recurrence) and the
attention layer aggregates (every head at `?` reads the queried pair's value token); both layers are needed."""

from __future__ import annotations

import pytest
import torch

from analysis.tasks import token_kv
from loaders.organisms import available
from scripts.branch_report import accuracy_with, cut_segment, read_mass, write_read_cuts, zero

pytestmark = pytest.mark.skipif("griffin-kv" not in available(), reason="organism/griffin-kv not shipped")
N, SAMPLES = 8, 200


@pytest.fixture(scope="module")
def model_and_prompts(organism):
    return organism("griffin-kv"), token_kv.prompts(N, SAMPLES, seed=108, fmt="k?")


def test_both_layers_are_needed(model_and_prompts):
    model, p = model_and_prompts
    base = accuracy_with(model, p, [])
    assert base > 0.85
    assert accuracy_with(model, p, [("blocks.0.hook_mixer_out", zero)]) < 0.2
    assert accuracy_with(model, p, [("blocks.1.hook_attn_out", zero)]) < 0.2


def test_attention_aggregates_the_queried_value_and_the_recurrence_is_not_read(model_and_prompts):
    model, p = model_and_prompts
    base = accuracy_with(model, p, [])
    assert cut_segment(model, p, ["blocks.1.attn.hook_pattern"]) < 0.2
    assert cut_segment(model, p, ["blocks.0.mixer.hook_kernel"]) > base - 0.05
    mass = read_mass(model, token_kv.prompts(N, 100, seed=7, fmt="k?"))
    for h in range(4):
        assert mass[f"blocks.1.attn:{h}"]["value"] > 0.6 and mass[f"blocks.1.attn:{h}"]["top_value"] > 0.8


def test_the_conv_carries_the_query_key_to_the_query(model_and_prompts):
    model, p = model_and_prompts
    base = accuracy_with(model, p, [])
    cuts = write_read_cuts(model, p)
    assert cuts["query key -> ?: kernel"] > base - 0.1
    assert cuts["query key -> ?: kernel + conv taps"] < 0.2
    assert cuts["keys -> values: kernel"] > base - 0.05
    assert cuts["keys -> values: kernel + conv taps"] < base - 0.1
    assert torch.isfinite(torch.tensor(list(cuts.values()))).all()
