"""Knockout while decoding with a DecodeState cuts exactly what the whole-sequence forward cuts (issue 28).

On every family of tests/tiny_families.py, a prefill and several decode steps under `knockout(...)` (sources in the prefill and in the new tokens,
targets in the new tokens and in the prompt) give, step by step, the logits of one whole-sequence forward
under the same knockout (float64, 1e-10): attention rows are the last q_len of the k_pos keys, an SSM cut
carries the state's part from cut sources across steps, a conv cut reads the past inputs in the state's
window. A step that cannot be exact (positions that move with the sequence's end, a knockout entered
after the past was read with sources there, one left for a step) is refused by name, never answered
differently; `generate` under a knockout equals generate recomputing every step under it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from analysis.interventions.knockout import knockout
from analysis.kernel_rows import slice_hooks, ssm_sites
from hooked.models.cut_record import PastCutMismatch
from hooked.models.decode_state import DecodeState, StateRefused
from tests.tiny_families import FAMILIES, V, tiny

TOKENS = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(1))
STEPS = (5, 2, 1, 1, 1, 1, 1)  # prefill, then new tokens per step
SOURCES, TARGETS = [1, 3, 6, 8, 10], [2, 6, 7, 9, 11]  # both in the prefill and in the new tokens
_MODELS: dict[str, object] = {}


def model_of(name: str):
    if name not in _MODELS:
        _MODELS[name] = copy.deepcopy(tiny(name)).double()
    return _MODELS[name]


def decode(model, tokens, steps=STEPS, mask=None, state=None):
    """Logits of every position, read in steps with one DecodeState."""
    state = DecodeState() if state is None else state
    out, at = [], 0
    for i, n in enumerate(steps):
        out.append(model(tokens[:, at:at + n], mask if i == 0 else None, state=state))
        at += n
    return torch.cat(out, dim=1)


def _close(got, want, tol=1e-10):
    torch.testing.assert_close(got, want, rtol=0, atol=tol * max(1.0, want.abs().max().item()))


def _bool_rows(positions_per_row, width):
    m = torch.zeros(len(positions_per_row), width, dtype=torch.bool)
    for b, ps in enumerate(positions_per_row):
        m[b, ps] = True
    return m


VARIANTS = {
    "all": dict(),
    "channels": dict(channels=[0, 2]),
    "cut_conv": dict(cut_conv=True),
    "channels_conv": dict(channels=[1, 3], cut_conv=True),
    "pattern": dict(attention="pattern"),
    "bool_rows": dict(sources=_bool_rows([[0, 4, 7, 9], [2, 5, 8, 10, 11]], 14),  # wider than the sequence
                      targets=_bool_rows([[4, 8, 10, 11], [6, 9, 11]], 14)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_steps_equal_the_whole_sequence_forward(name, variant):
    model = model_of(name)
    kw = dict(sources=SOURCES, targets=TARGETS, layers=range(model.cfg.n_layers)) | VARIANTS[variant]
    if not ssm_sites(model):
        kw.pop("channels", None)  # attention cuts every head (knockout refuses channels without an SSM mixer)
    full_kw = dict(kw)
    for key in ("sources", "targets"):  # the whole forward takes masks of its own length
        if torch.is_tensor(full_kw[key]):
            full_kw[key] = full_kw[key][:, :TOKENS.shape[1]]
    with torch.no_grad():
        plain = model(TOKENS)
        with knockout(model, **full_kw):
            want = model(TOKENS)
        with knockout(model, **kw):
            got = decode(model, TOKENS)
    _close(got, want)
    assert (want - plain).abs().amax(-1)[:, 7:].min() > 1e-6  # the cut changes every new target's logits


@pytest.mark.parametrize("name", ["llama", "mamba", "mamba2", "zamba2"])
def test_left_padded_prefill(name):
    model = model_of(name)
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0
    kw = dict(sources=SOURCES, targets=TARGETS, layers=[0, model.cfg.n_layers - 1], cut_conv=True)
    with torch.no_grad(), knockout(model, **kw):
        want = model(TOKENS, mask)
        got = decode(model, TOKENS, mask=mask[:, :STEPS[0]])
    real = mask.bool()
    _close(got[real], want[real])


@pytest.mark.parametrize("name", ["llama", "mamba", "mamba2", "zamba2"])
def test_selected_rows_continue_their_cut(name):
    """`select` (one prefix read for several continuations) carries each row's cut state."""
    model = model_of(name)
    index = torch.tensor([1, 0, 1])
    rows = TOKENS[index].clone()
    rows[2, 6:] = torch.randint(1, V, (6,), generator=torch.Generator().manual_seed(5))  # another continuation
    kw = dict(sources=_bool_rows([[1, 3], [0, 4]], 12), targets=[7, 9, 11], layers=range(model.cfg.n_layers))
    with torch.no_grad():
        with knockout(model, **{**kw, "sources": kw["sources"][index]}):
            want = model(rows)
        state = DecodeState()
        with knockout(model, **kw):
            model(TOKENS[:, :6], state=state)
        state = state.select(index)
        with knockout(model, **{**kw, "sources": kw["sources"][index]}):
            got = decode(model, rows[:, 6:], steps=(3, 1, 2), state=state)
    _close(got, want[:, 6:])


def test_two_knockouts_on_one_attention_layer():
    model = model_of("llama")
    a = dict(sources=[1, 2], targets=[6, 8], layers=[0])
    b = dict(sources=[5, 7], targets=[7, 9, 10], layers=[0, 1])
    with torch.no_grad(), knockout(model, **a), knockout(model, **b):
        _close(decode(model, TOKENS), model(TOKENS))


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_under_knockout_equals_recompute(name):
    model = model_of(name)
    kw = dict(sources=[0, 2, 3], targets=[4, 5], layers=range(model.cfg.n_layers), cut_conv=True)
    gen = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False)
    prompt = TOKENS[:, :6]
    with knockout(model, **kw):
        fast = model.generate(prompt, **gen)
        slow = model.generate(prompt, use_past_kv_cache=False, **gen)
    assert torch.equal(fast, slow)
    with torch.no_grad(), knockout(model, **kw):  # each new token is the argmax of the knocked-out forward
        assert torch.equal(model(fast[:, :-1])[:, -1].argmax(-1), fast[:, -1])


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("name", ["llama", "mamba2", "zamba2"])
def test_positions_that_move_with_the_end_are_refused_after_the_prefill(name):
    model = model_of(name)
    kw = dict(sources=[2], targets=[-1], layers=[0])
    state = DecodeState()
    with torch.no_grad(), knockout(model, **kw):
        _close(model(TOKENS[:, :6], state=state), model(TOKENS[:, :6]))  # the prefill is exact
        with pytest.raises(PastCutMismatch, match=r"targets are \[\] .* were \[5\] .*use_past_kv_cache=False"):
            model(TOKENS[:, 6:7], state=state)
    assert state.length == 6  # refused steps leave the state as it was
    with pytest.raises(StateRefused, match="negative positions count from the end"):
        with knockout(model, **kw):
            model.generate(TOKENS[:, :6], max_new_tokens=3, do_sample=False, stop_at_eos=False)
    with knockout(model, **kw):
        model.generate(TOKENS[:, :6], max_new_tokens=3, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)


@pytest.mark.parametrize("name", ["llama", "mamba", "mamba2"])
def test_a_knockout_entered_after_the_prefill(name):
    """Exact when it cuts nothing the past needed; refused when the past holds its sources (SSM) or edges."""
    model = model_of(name)
    with torch.no_grad():
        state = DecodeState()
        model(TOKENS[:, :6], state=state)
        with knockout(model, sources=[6, 8], targets=[8, 10], layers=[0, 1]):  # everything in the new tokens
            got = decode(model, TOKENS[:, 6:], steps=(2, 1, 3), state=state)
            want = model(TOKENS)[:, 6:]
        _close(got, want)
        state = DecodeState()
        model(TOKENS[:, :6], state=state)
        past_source = "sources" if name != "llama" else "edges into"
        with knockout(model, sources=[1, 7], targets=[8] if name != "llama" else [3, 8], layers=[0]):
            with pytest.raises(PastCutMismatch, match=f"starts while decoding, at position 6.*{past_source}"):
                model(TOKENS[:, 6:7], state=state)


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_a_knockout_left_for_a_step_is_refused_on_return(name):
    model = model_of(name)
    kw = dict(sources=[1], targets=[3, 9], layers=[0])
    with torch.no_grad():
        state = DecodeState()
        with knockout(model, **kw):
            model(TOKENS[:, :6], state=state)
        model(TOKENS[:, 6:7], state=state)  # without the knockout: its record is dropped
        with knockout(model, **kw), pytest.raises(PastCutMismatch, match="starts while decoding, at position 7"):
            model(TOKENS[:, 7:8], state=state)


def test_a_bool_mask_narrower_than_the_sequence_is_refused():
    model = model_of("mamba")
    with torch.no_grad(), knockout(model, sources=torch.ones(2, 6, dtype=torch.bool), targets=[7], layers=[0]):
        state = DecodeState()
        model(TOKENS[:, :6], state=state)
        with pytest.raises(ValueError, match=r"mask has shape \(2, 6\).*while decoding a mask covers"):
            model(TOKENS[:, 6:7], state=state)


def test_kernel_slices_are_refused_while_decoding():
    model = model_of("mamba2")
    state = DecodeState()
    with torch.no_grad():
        model(TOKENS[:, :6], state=state)
        hooks = slice_hooks(model, ssm_sites(model)[0], [-1], lambda s: None)
        with pytest.raises(StateRefused, match="kernel slices .* while decoding"):
            model.run_with_hooks(TOKENS[:, 6:7], state=state, fwd_hooks=hooks)
