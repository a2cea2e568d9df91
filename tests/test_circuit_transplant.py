"""State transplants through the decoding state equal hand edits of hook_h, on every SSM family (float64).

A (5 tokens) gives its last state; B (9 tokens) is read up to position 4, takes A's state (every SSM mixer,
or some units of one), and continues: its logits after position 4 equal B's whole forward with
hook_h[:, 4] set to A's state by hand (and
hook_y[:, 4] kept: the transplant happens after position 4 was read); greedy generation from the transplanted state equals greedy
generation that recomputes the whole sequence with the edit each step; the whole decoding state
(sites="all") continues exactly as A followed by B's remaining tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits.transplant import (generate_from, hand_edit_hooks, patchscope, read, ssm_sites, transplant,
                                          transplant_state)

SSM_FAMILIES = ["mamba", "falcon_mamba", "mamba2", "zamba2", "bamba", "granite", "falcon_h1", "nemotron_h", "jamba"]
AT = 4
TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module", params=SSM_FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(4)
    donor = torch.randint(1, 64, (1, 5), generator=gen)
    recipient = torch.randint(1, 64, (2, 9), generator=gen)
    return request.param, model, donor, recipient


def test_transplant_equals_editing_hook_h_by_hand(run):
    _, model, donor, recipient = run
    logits, _ = transplant(model, donor, recipient, AT)
    with torch.no_grad():
        by_hand = model.run_with_hooks(recipient, fwd_hooks=hand_edit_hooks(model, donor, recipient, AT))
        plain = model(recipient)
    torch.testing.assert_close(logits, by_hand[:, AT + 1:], **TOL)
    assert (logits - plain[:, AT + 1:]).abs().max() > 1e-6  # the transplant changed something


def test_transplant_of_some_units_of_one_site(run):
    _, model, donor, recipient = run
    site = list(ssm_sites(model))[-1]
    units = [0, 2]
    logits, _ = transplant(model, donor, recipient, AT, sites=site, units=units)
    with torch.no_grad():
        by_hand = model.run_with_hooks(recipient, fwd_hooks=hand_edit_hooks(model, donor, recipient, AT, site, units))
    torch.testing.assert_close(logits, by_hand[:, AT + 1:], **TOL)


def test_generation_from_a_transplanted_state_equals_recomputing(run):
    _, model, donor, recipient = run
    _, state = read(model, recipient[:, :AT + 1])
    _, donor_state = read(model, donor)
    state = transplant_state(model, state, donor_state)
    new = generate_from(model, state, recipient[:, AT + 1:], 4)
    tokens = recipient.clone()
    with torch.no_grad():
        for _ in range(4):
            hooks = hand_edit_hooks(model, donor, tokens, AT)
            nxt = model.run_with_hooks(tokens, fwd_hooks=hooks)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(new, tokens[:, recipient.shape[1]:])
    assert torch.equal(patchscope(model, donor, recipient, AT, 4), new)


def test_whole_state_continues_as_the_donor_followed_by_the_rest(run):
    _, model, donor, recipient = run
    logits, _ = transplant(model, donor, recipient, AT, sites="all")
    joined = torch.cat([donor.expand(recipient.shape[0], -1), recipient[:, AT + 1:]], dim=1)
    with torch.no_grad():
        whole = model(joined)
    torch.testing.assert_close(logits, whole[:, donor.shape[1]:], **TOL)


def test_transplant_refuses_models_without_state_and_bad_sites():
    with pytest.raises(ValueError, match="no SSM mixer"):
        ssm_sites(tiny("llama")) or transplant(tiny("llama"), torch.ones(1, 3, dtype=torch.long),
                                               torch.ones(1, 6, dtype=torch.long), 2)
    model = tiny("mamba2")
    with pytest.raises(KeyError, match="not SSM mixers"):
        transplant(model, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long), 2, sites=["blocks.9.mixer"])
    with pytest.raises(ValueError, match="must have a token after it"):
        transplant(model, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long), 5)
