"""organism/falcon-h1-kv's measured circuit (docs/results/organisms/falcon_h1_kv/README.md), n = 8, 200 prompts:
layer 1's attention aggregates (reads the queried value at `?`), its SSM branch is unused, and layer 0's
causal conv (not its SSM kernel, not its attention) writes each key into its value token."""

from __future__ import annotations

import pytest
import torch

from analysis.tasks import token_kv
from loaders.organisms import available
from scripts.branch_report import accuracy_with, cut_segment, gather_cuts, zero

pytestmark = pytest.mark.skipif("falcon-h1-kv" not in available(), reason="organism/falcon-h1-kv not shipped")
N, SAMPLES = 8, 200


@pytest.fixture(scope="module")
def model_and_prompts(organism):
    return organism("falcon-h1-kv"), token_kv.prompts(N, SAMPLES, seed=108, fmt="k?")


@pytest.mark.parametrize("hook,low", [("blocks.1.hook_attn_out", True), ("blocks.0.hook_mixer_out", True),
                                      ("blocks.1.hook_mixer_out", False)])
def test_branch_ablations(model_and_prompts, hook, low):
    model, p = model_and_prompts
    base = accuracy_with(model, p, [])
    acc = accuracy_with(model, p, [(hook, zero)])
    assert base > 0.85
    assert (acc < 0.25) if low else (acc > base - 0.05), (hook, acc, base)


def test_layer1_attention_reads_the_queried_value(model_and_prompts):
    model, p = model_and_prompts
    with torch.no_grad():
        _, cache = model.run_with_cache(p.tokens, names_filter="blocks.1.attn.hook_pattern")
    value = torch.tensor(p.pair_newlines())[p.answer] - 1
    mass = cache["blocks.1.attn.hook_pattern"][torch.arange(SAMPLES), :, -1, value].mean(0)  # [n_heads]
    assert (mass > 0.6).all(), mass
    assert cut_segment(model, p, ["blocks.1.attn.hook_pattern"]) < 0.25
    assert cut_segment(model, p, [f"blocks.{l}.mixer.hook_kernel" for l in range(2)]) > 0.85


def test_layer0_conv_gathers(model_and_prompts):
    model, p = model_and_prompts
    cuts = gather_cuts(model, p)
    assert cuts["L0 all + conv (knockout)"] < 0.25
    assert min(cuts["L0 attn pattern"], cuts["L0 mixer kernel"], cuts["L0 all, no conv cut (knockout)"]) > 0.85
