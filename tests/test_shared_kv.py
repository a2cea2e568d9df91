"""A selected DecodeState's keys and values (hooked/models/shared_kv.py) against the gathered copy they replace.

Attention through a `SharedKV` (the shared past read through the row map) equals attention through
cat([k0[index], own]) built by hand, in float64 within 1e-12: outputs, scores and pattern hooks, the state
afterwards and the gradients, across head layouts, rotary, soft-cap, sliding windows, a left-padded prefix,
repeated / permuted / unused source rows, multi-token continuations, select of a select and extends after a
select. Whole models: prefix forward + select + continuation forward equal the whole-sequence forward."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import build_tiny_hf
from test_ga import _model

from hooked.models.attention import Attention
from hooked.models.base import Context
from hooked.models.decode_state import DecodeState
from hooked.models.shared_kv import RowMap, SharedKV
from hooked.ops.rotary import Rotary
from loaders.load import from_hf

EXACT = dict(rtol=1e-12, atol=1e-12)
D_IN, D_HEAD, SOURCES, P0 = 12, 4, 4, 7
INDEX = torch.tensor([2, 0, 0, 2, 3, 2])  # repeated, out of order, source 1 unused
INDEX2 = torch.tensor([5, 1, 1, 0])  # a select of the selected rows
CASES = {  # name -> (n_heads, n_kv_heads, Attention keywords, prefix left-padded)
    "mha": (4, 4, {}, False),
    "gqa": (6, 2, {}, True),
    "mqa_rotary": (4, 1, dict(rotary=Rotary(D_HEAD)), True),
    "gqa_softcap_window": (4, 2, dict(rotary=Rotary(D_HEAD), softcap=1.5, window=3), True),
    "mha_window": (2, 2, dict(window=5), False),
}


def _attention(n_heads, n_kv_heads, kw) -> Attention:
    torch.manual_seed(0)
    attn = Attention(D_IN, n_heads, n_kv_heads, D_HEAD, **kw).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.6)
    return attn


def _step(attn: Attention, x, state: DecodeState, mask=None):
    """One forward of `attn` on new positions x [batch pos d_in], as a model runs it; returns (out, scores,
    pattern) with the hooks' views."""
    batch, pos = x.shape[:2]
    ctx = Context(mask, torch.zeros(batch, pos, dtype=torch.long), state=state)
    ctx.position_ids = state.positions(mask, batch, pos, x.device)
    ctx.key_mask = state.key_mask(mask, batch, pos, x.device)
    seen = {}
    undo = [getattr(attn, name).add_hook(lambda t, hook, name=name: seen.__setitem__(name, t))
            for name in ("hook_attn_scores", "hook_pattern")]
    out = attn(x, ctx)
    for u in undo:
        u()
    state.advance(mask, batch, pos, x.device)
    return out, seen["hook_attn_scores"], seen["hook_pattern"]


def _gathered(state: DecodeState) -> DecodeState:
    """The same state with every SharedKV replaced by the copy it stands for: cat([k0[index], own])."""
    out = copy.copy(state)
    out.entries = {key: (torch.cat([e.k0[e.rows.index], e.k1], 1), torch.cat([e.v0[e.rows.index], e.v1], 1))
                   if isinstance(e, SharedKV) else e for key, e in state.entries.items()}
    return out


def _prefix(attn, padded, x0):
    mask = None
    if padded:
        mask = torch.ones(SOURCES, P0, dtype=torch.bool)
        mask[1, :3] = mask[2, :1] = False
    state = DecodeState()
    _step(attn, x0, state, mask)
    return state


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cont", [1, 3])
def test_attention_through_shared_past_equals_gathered_copy(case, cont):
    n_heads, n_kv_heads, kw, padded = CASES[case]
    attn = _attention(n_heads, n_kv_heads, kw)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(SOURCES, P0, D_IN, dtype=torch.float64, generator=g)
    state = _prefix(attn, padded, x0)
    shared = state.select(INDEX)
    ref = _gathered(shared)
    kv = shared.entries[(id(attn), "kv")]
    assert isinstance(kv, SharedKV) and kv.k1.shape[1] == 0 and kv.k0 is state.entries[(id(attn), "kv")][0]
    steps = [torch.randn(len(INDEX), cont, D_IN, dtype=torch.float64, generator=g),
             torch.randn(len(INDEX), 1, D_IN, dtype=torch.float64, generator=g)]  # an extend after the first
    for x in steps:
        for got, want in zip(_step(attn, x, shared), _step(attn, x, ref)):
            torch.testing.assert_close(got, want, **EXACT)  # output, scores, pattern: same shapes, same values
        torch.testing.assert_close(_gathered(shared).entries, ref.entries, **EXACT)
        assert isinstance(shared.entries[(id(attn), "kv")], SharedKV)
    again, ref_again = shared.select(INDEX2), _gathered(ref.select(INDEX2))  # select of a select
    assert again.entries[(id(attn), "kv")].k0 is kv.k0  # still the prefix's keys, never copied
    x = torch.randn(len(INDEX2), 2, D_IN, dtype=torch.float64, generator=g)
    for got, want in zip(_step(attn, x, again), _step(attn, x, ref_again)):
        torch.testing.assert_close(got, want, **EXACT)
    assert again.length == ref_again.length == P0 + cont + 3


@pytest.mark.parametrize("case", ["gqa", "gqa_softcap_window"])
def test_gradients_reach_the_shared_past(case):
    """d(out)/d(prefix input) (through k0, v0) and d(out)/d(continuation input) (through q and the own
    keys) equal the gathered copy's."""
    n_heads, n_kv_heads, kw, padded = CASES[case]
    attn = _attention(n_heads, n_kv_heads, kw)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(SOURCES, P0, D_IN, dtype=torch.float64, generator=g, requires_grad=True)
    x1 = torch.randn(len(INDEX), 2, D_IN, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(len(INDEX), 2, D_IN, dtype=torch.float64, generator=g)
    grads = []
    for gather in (False, True):
        state = _prefix(attn, padded, x0).select(INDEX)
        out, _, _ = _step(attn, x1, _gathered(state) if gather else state)
        grads.append(torch.autograd.grad((out * weight).sum(), (x0, x1)))
    assert grads[0][0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], **EXACT)


def test_row_map_grid():
    rows = RowMap.of(INDEX, SOURCES)
    assert rows.width == 3 and sorted(rows.slot.tolist()) == rows.slot.unique().tolist()  # one slot per row
    assert (rows.slot // rows.width).tolist() == INDEX.tolist()
    x = torch.randn(len(INDEX), 2)
    grid = rows.to_grid(x)
    assert grid.shape == (SOURCES, 3, 2) and (grid[1] == 0).all()  # the unused source's slots are empty
    torch.testing.assert_close(rows.from_grid(grid), x, rtol=0, atol=0)
    composed = rows.compose(INDEX2)
    assert composed.index.tolist() == INDEX[INDEX2].tolist() and composed.sources == SOURCES
    empty = RowMap.of(torch.zeros(0, dtype=torch.long), SOURCES)
    assert empty.width == 0 and empty.from_grid(empty.to_grid(torch.zeros(0, 3))).shape == (0, 3)


def test_select_shares_one_row_map_across_layers():
    model = _model("llama")
    state = DecodeState()
    with torch.no_grad():
        model(torch.randint(4, 100, (3, 5)), state=state)
    for picked in (state.select(INDEX[INDEX < 3]), state.select(INDEX[INDEX < 3]).select(torch.tensor([1, 0]))):
        kvs = [e for key, e in picked.entries.items() if key[1] == "kv"]
        assert len(kvs) == model.cfg.n_layers and all(e.rows is kvs[0].rows for e in kvs)


# ------------------------------------------------------------------------------ whole models
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)
GEMMA = dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
HYBRID = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=61, max_position_embeddings=512)
MODELS = {
    "gpt2": lambda: _model("gpt2"),
    "llama": lambda: _model("llama"),
    "zamba2": lambda: _model("zamba2"),
    "mistral": lambda: from_hf(build_tiny_hf(transformers.MistralConfig(**SMALL, sliding_window=4),
                                             transformers.MistralForCausalLM, perturb=0.1)),
    "gemma2": lambda: from_hf(build_tiny_hf(transformers.Gemma2Config(**SMALL, **GEMMA, attn_logit_softcapping=2.0,
                                                                      final_logit_softcapping=3.0),
                                            transformers.Gemma2ForCausalLM, perturb=0.1)),
    "bamba": lambda: from_hf(build_tiny_hf(transformers.BambaConfig(
        num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=24, mamba_n_heads=4, mamba_n_groups=1,
        mamba_d_state=8, mamba_chunk_size=16, **HYBRID), transformers.BambaForCausalLM, perturb=0.1)),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_prefix_select_continuation_equals_whole_sequence(arch):
    model = MODELS[arch]()
    tokens = torch.randint(4, 60, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :2] = 0
    index, index2 = torch.tensor([2, 0, 0, 2, 1]), torch.tensor([4, 1, 1, 0])
    with torch.no_grad():
        full = model(tokens, mask)
        state = DecodeState()
        model(tokens[:, :7], mask[:, :7], state=state)
        picked = state.select(index)
        step = model(tokens[index, 7:10], state=picked)  # three positions at once
        torch.testing.assert_close(step, full[index, 7:10], rtol=1e-5, atol=1e-5)
        again = picked.select(index2)
        step = model(tokens[index[index2], 10:], state=again)
        torch.testing.assert_close(step, full[index[index2], 10:], rtol=1e-5, atol=1e-5)
