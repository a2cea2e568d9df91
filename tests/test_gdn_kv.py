"""organism/gdn-kv's measured circuit (docs/results/organisms/gdn_kv/README.md), n = 8, 200 prompts: the
Gated DeltaNet layer does gather (its short conv writes each key with its value) and aggregate (head 2's
kernel row at `?` reads the queried pair's write); the attention layer is unused."""

from __future__ import annotations

import pytest

from analysis.interventions import knockout
from analysis.tasks import token_kv
from loaders.organisms import available
from scripts.branch_report import accuracy_with, write_read_cuts, zero

pytestmark = pytest.mark.skipif("gdn-kv" not in available(), reason="organism/gdn-kv not shipped")
N, SAMPLES = 8, 200


@pytest.fixture(scope="module")
def model_and_prompts(organism):
    return organism("gdn-kv"), token_kv.prompts(N, SAMPLES, seed=108, fmt="k?")


def test_the_delta_layer_is_needed_and_the_attention_layer_is_not(model_and_prompts):
    model, p = model_and_prompts
    base = accuracy_with(model, p, [])
    assert base > 0.9
    assert accuracy_with(model, p, [("blocks.0.hook_mixer_out", zero)]) < 0.2
    assert accuracy_with(model, p, [("blocks.1.hook_attn_out", zero)]) > base - 0.05


def test_conv_gathers_and_head_2_aggregates(model_and_prompts):
    model, p = model_and_prompts
    cuts = write_read_cuts(model, p)
    base = accuracy_with(model, p, [])
    for kept in ("keys -> values and newlines: kernel", "query key -> ?: kernel", "values -> ?: kernel",
                 "newlines -> ?: kernel"):
        assert cuts[kept] > base - 0.05, kept
    for broken in ("keys -> values and newlines: kernel + conv taps", "query key -> ?: kernel + conv taps",
                   "values and newlines -> ?: kernel"):
        assert cuts[broken] < 0.2, broken
    nl = p.pair_newlines()
    reads = list(nl) + [n - 1 for n in nl]
    pos = p.tokens.shape[1]
    for heads, low in (([2], True), ([0, 1, 3], False)):
        with knockout(model, reads, [pos - 1], [0], channels=heads):
            acc = accuracy_with(model, p, [])
        assert (acc < 0.2) if low else (acc > base - 0.05), (heads, acc)
