"""A DecodeState belongs to the model that ran it and survives a failed step, on attention, Mamba-1,
Mamba-2 and hybrid models: another model (even a copy with the same config) refuses it, a batch of
another size is refused, and a forward that raises (a hook, a refused lazy hook) leaves the state as
it was, so continuing gives the logits of a run that never saw the failed step."""

from __future__ import annotations

import copy

import pytest
import torch

from hooked.models.decode_state import DecodeState, StateRefused, WrongModel
from tests.test_cache_budget import MODELS

FAMILIES = ["llama_gqa", "mamba", "mamba2", "zamba2"]
PROMPT = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
NEXT = torch.randint(0, 50, (2, 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    torch.manual_seed(0)
    m = MODELS[request.param]().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def prefilled(model) -> DecodeState:
    state = DecodeState()
    with torch.no_grad():
        model(PROMPT, state=state)
    return state


def snapshot(state: DecodeState) -> dict:
    return {"entries": dict(state.entries), "length": state.length, "next": state.next_position.clone()}


def test_a_state_from_another_model_is_refused(model):
    state = prefilled(model)
    twin = copy.deepcopy(model)  # same config and weights, other modules: its entries are not there
    before = snapshot(state)
    with pytest.raises(WrongModel, match=rf"belongs to {type(model).__name__}\(.*at position 6\), not to "):
        twin(NEXT, state=state)
    assert snapshot(state)["entries"] == before["entries"] and state.length == 6
    with torch.no_grad():
        twin_state = prefilled(twin)
        assert torch.equal(twin(NEXT, state=twin_state), model(NEXT, state=state))  # each with its own


def test_copies_of_a_state_keep_its_model(model):
    state = prefilled(model)
    other = copy.deepcopy(model)
    for derived in (state.select(torch.tensor([1, 0])), state.entries_of(list(model.blocks[:1]))):
        with pytest.raises(WrongModel):
            other(NEXT, state=derived)


def test_a_batch_of_another_size_is_refused(model):
    state = prefilled(model)
    with pytest.raises(ValueError, match=r"holds 2 rows .* the input has 3"):
        model(torch.zeros(3, 1, dtype=torch.long), state=state)
    assert state.length == 6


def _raise(x, hook):
    raise RuntimeError(f"hook {hook.name} failed")


def test_a_hook_that_raises_mid_step_leaves_the_state_as_before(model):
    reference, state = prefilled(model), prefilled(model)
    with torch.no_grad():
        want = model(NEXT, state=reference)
    last = model.cfg.n_layers - 1  # every earlier layer has updated its keys / conv window / SSM state by then
    before = snapshot(state)
    with pytest.raises(RuntimeError, match="failed"):
        with torch.no_grad():
            model.run_with_hooks(NEXT, state=state, fwd_hooks=[(f"blocks.{last}.hook_resid_post", _raise)])
    after = snapshot(state)
    assert after["entries"].keys() == before["entries"].keys()
    assert all(after["entries"][k] is before["entries"][k] for k in before["entries"])
    assert after["length"] == before["length"] and torch.equal(after["next"], before["next"])
    with torch.no_grad():
        got = model(NEXT, state=state)
    assert torch.equal(got, want)


@pytest.mark.parametrize("lazy", ["hook_h", "hook_kernel"])
def test_a_refused_lazy_hook_leaves_the_state_usable(model, lazy):
    names = [n for n in model.hook_dict if n.endswith(f"mixer.{lazy}")]
    if not names:
        pytest.skip("no SSM mixer")
    reference, state = prefilled(model), prefilled(model)
    with torch.no_grad():
        want = model(NEXT, state=reference)
        with pytest.raises(StateRefused, match="use_past_kv_cache=False"):
            model.run_with_hooks(NEXT, state=state, fwd_hooks=[(names[-1], lambda x, h: None)])
        assert torch.equal(model(NEXT, state=state), want)
