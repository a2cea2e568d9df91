"""The hook contract of the attention models (GPT-2, Llama with GQA): DESIGN.md sections 2, 3 and 7.

Every documented hook exists, in forward order, fires once per forward with its documented shape;
identity hooks change nothing (bit for bit); hook_result is lazy, sums to attn_out and its edits
propagate exactly like zeroing o_proj columns in HF; hooks never outlive a failing call; the
cache helpers agree with the residual stream.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import Tensor

from hooked import backends
from hooked.models.attention import Attention
from loaders.load import from_hf

VOCAB = 61
BATCH, POS = 2, 7
CASES = {  # name -> (HF model class, HF config)
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=1)),
    "llama_gqa_bias": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, attention_bias=True, pad_token_id=0)),
    "llama_tied_mqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=0)),
}


@pytest.fixture(params=list(CASES))
def pair(request, tiny_hf):
    """(HF model, our model loaded from it, is_rotary)."""
    cls, config = CASES[request.param]
    hf = tiny_hf(copy.deepcopy(config), cls, perturb=0.1)
    return hf, from_hf(hf), request.param != "gpt2"


@pytest.fixture
def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (BATCH, POS), generator=g)
    mask = torch.ones(BATCH, POS, dtype=torch.long)
    mask[1, :2] = 0  # the second row is left-padded
    return tokens, mask


def expected_hooks(cfg, rotary: bool) -> dict[str, tuple[int, ...]]:
    """DESIGN.md section 3, in forward order, with shapes for [BATCH, POS] tokens."""
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    resid = (BATCH, POS, d)
    hooks = {"hook_embed": resid} if rotary else {"hook_embed": resid, "hook_pos_embed": resid}
    for l in range(cfg.n_layers):
        p = f"blocks.{l}."
        hooks |= {p + "hook_resid_pre": resid, p + "hook_attn_in": resid, p + "ln1.hook_scale": (BATCH, POS, 1),
                  p + "ln1.hook_normalized": resid, p + "attn.hook_q": (BATCH, POS, h, dh),
                  p + "attn.hook_k": (BATCH, POS, kv, dh), p + "attn.hook_v": (BATCH, POS, kv, dh)}
        if rotary:
            hooks |= {p + "attn.hook_rot_q": (BATCH, POS, h, dh), p + "attn.hook_rot_k": (BATCH, POS, kv, dh)}
        hooks |= {p + "attn.hook_attn_scores": (BATCH, h, POS, POS), p + "attn.hook_pattern": (BATCH, h, POS, POS),
                  p + "attn.hook_z": (BATCH, POS, h, dh), p + "attn.hook_result": (BATCH, POS, h, d),
                  p + "hook_attn_out": resid, p + "hook_resid_mid": resid, p + "hook_mlp_in": resid,
                  p + "ln2.hook_scale": (BATCH, POS, 1), p + "ln2.hook_normalized": resid,
                  p + "mlp.hook_pre": (BATCH, POS, cfg.d_mlp)}
        if rotary:
            hooks |= {p + "mlp.hook_pre_linear": (BATCH, POS, cfg.d_mlp)}
        hooks |= {p + "mlp.hook_post": (BATCH, POS, cfg.d_mlp), p + "hook_mlp_out": resid, p + "hook_resid_post": resid}
    hooks["ln_final.hook_scale"] = (BATCH, POS, 1)
    hooks["ln_final.hook_normalized"] = resid
    hooks["unembed.hook_in"] = resid
    hooks["unembed.hook_out"] = (BATCH, POS, cfg.d_vocab)
    return hooks


# ------------------------------------------------------------------------------- the contract
def test_every_documented_hook_exists_in_forward_order(pair) -> None:
    _, model, rotary = pair
    assert list(model.hook_dict) == list(expected_hooks(model.cfg, rotary))


def test_every_hook_fires_once_with_its_shape(pair, batch) -> None:
    _, model, rotary = pair
    fired: dict[str, list[tuple[int, ...]]] = {}
    record = lambda x, hook: fired.setdefault(hook.name, []).append(tuple(x.shape))  # noqa: E731
    model.run_with_hooks(*batch, fwd_hooks=[(lambda name: True, record)])
    assert fired == {name: [shape] for name, shape in expected_hooks(model.cfg, rotary).items()}


def test_identity_hooks_and_full_cache_leave_logits_bit_identical(pair, batch) -> None:
    _, model, _ = pair
    with backends.use(attention="eager"):  # the hooks below put every layer on the exact path
        plain = model(*batch)
    hooked = model.run_with_hooks(*batch, fwd_hooks=[(lambda name: True, lambda x, hook: x)])
    cached, cache = model.run_with_cache(*batch, incl_lazy=True)
    assert torch.equal(plain, hooked) and torch.equal(plain, cached)
    assert len(cache) == len(model.hook_dict)


def test_pattern_is_causal_ignores_padding_and_is_finite(pair, batch) -> None:
    _, model, _ = pair
    tokens, mask = batch
    _, cache = model.run_with_cache(tokens, mask, names_filter=lambda n: "hook_pattern" in n or "scores" in n)
    future = torch.ones(POS, POS, dtype=torch.bool).triu(1)
    for l in range(model.cfg.n_layers):
        pattern, scores = cache["pattern", l], cache["attn_scores", l]
        assert pattern.isfinite().all()  # padding queries (row 1, q < 2) see no key: uniform, not NaN
        assert (scores[..., future] == torch.finfo(scores.dtype).min).all()
        assert (pattern[0][..., future] == 0).all() and (pattern[1, :, 2:][..., future[2:]] == 0).all()
        assert (pattern[1, :, 2:, :2] == 0).all()  # real queries never read padding keys
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


def test_hook_result_is_computed_only_when_hooked(pair, batch, monkeypatch) -> None:
    _, model, _ = pair
    calls = []
    original = Attention.head_results
    monkeypatch.setattr(Attention, "head_results", lambda self, z: calls.append(1) or original(self, z))
    model.hook_dict  # record the forward order first (that run counts every hook as active)
    calls.clear()
    model(*batch)
    model.run_with_cache(*batch, names_filter=lambda n: not n.endswith("hook_result"))
    assert calls == []
    model.run_with_cache(*batch, names_filter="blocks.1.attn.hook_result")
    assert len(calls) == 1
    model.run_with_hooks(*batch, fwd_hooks=[(lambda n: n.endswith("hook_result"), lambda x, hook: None)])
    assert len(calls) == 1 + model.cfg.n_layers


def test_head_results_sum_to_attn_out(pair, batch, assert_rel_close) -> None:
    _, model, _ = pair
    _, cache = model.run_with_cache(*batch, incl_lazy=True)
    for l, block in enumerate(model.blocks):
        bias = block.attn.o_proj.bias if block.attn.o_proj.bias is not None else 0.0
        assert_rel_close(cache["result", l].sum(2) + bias, cache["attn_out", l], 1e-6, f"layer {l}")
    stack, labels = cache.stack_head_results(return_labels=True)
    assert stack.shape == (model.cfg.n_layers * model.cfg.n_heads, BATCH, POS, model.cfg.d_model)
    assert labels[:2] == ["L0H0", "L0H1"] and labels[-1] == f"L{model.cfg.n_layers - 1}H{model.cfg.n_heads - 1}"


def _zero_hf_head(hf, layer: int, head: int, d_head: int):
    """A copy of the HF model with `head`'s columns of layer's output projection zeroed."""
    hf = copy.deepcopy(hf)
    cols = slice(head * d_head, (head + 1) * d_head)
    with torch.no_grad():
        if isinstance(hf, transformers.GPT2LMHeadModel):
            hf.transformer.h[layer].attn.c_proj.weight[cols, :] = 0  # Conv1D: [in out]
        else:
            hf.model.layers[layer].self_attn.o_proj.weight[:, cols] = 0
    return hf


def _zero_in_place(x: Tensor, hook) -> None:
    x[:, :, 1] = 0  # result / z: [batch pos head ...]


def _zero_pattern(x: Tensor, hook) -> Tensor:
    out = x.clone()
    out[:, 1] = 0  # pattern: [batch head q k]
    return out


@pytest.mark.parametrize("hook, fn", [("hook_result", _zero_in_place), ("hook_z", _zero_in_place),
                                      ("hook_pattern", _zero_pattern)])
def test_zeroing_a_head_equals_zeroing_its_o_proj_columns_in_hf(pair, batch, hook, fn, assert_rel_close) -> None:
    hf, model, _ = pair
    tokens, mask = batch
    layer = model.cfg.n_layers - 1
    edited = model.run_with_hooks(tokens, mask, fwd_hooks=[(f"blocks.{layer}.attn.{hook}", fn)])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = _zero_hf_head(hf, layer, 1, model.cfg.d_head)(tokens, attention_mask=mask,
                                                                   position_ids=position_ids).logits
    real = mask.bool()
    assert_rel_close(edited[real], expected[real], 1e-4, hook)
    assert not torch.allclose(edited[real], model(tokens, mask)[real], atol=1e-3)  # the edit did something


def test_gradient_through_hook_result_is_the_attn_out_gradient(pair, batch, assert_rel_close) -> None:
    """With hook_result active, parameter gradients are unchanged and each head sees d loss / d attn_out."""
    _, model, _ = pair
    plain = {n: g for n, g in zip(*_param_grads(model, batch))}
    grads: dict[str, Tensor] = {}
    keep = lambda g, hook: grads.__setitem__(hook.name, g)  # noqa: E731
    with model.hooks(bwd_hooks=[(lambda n: n.endswith("hook_result") or n.endswith("hook_attn_out"), keep)]):
        hooked = {n: g for n, g in zip(*_param_grads(model, batch))}
    for name, g in plain.items():
        assert_rel_close(hooked[name], g, 1e-5, name)
    for l in range(model.cfg.n_layers):
        per_head = grads[f"blocks.{l}.attn.hook_result"]
        expected = grads[f"blocks.{l}.hook_attn_out"][:, :, None].expand_as(per_head)
        assert_rel_close(per_head, expected, 1e-6, f"layer {l}")


def _param_grads(model, batch) -> tuple[list[str], list[Tensor]]:
    model.zero_grad()
    model(*batch).logsumexp(-1).sum().backward()
    names = [n for n, p in model.named_parameters()]
    grads = [p.grad.clone() for _, p in model.named_parameters()]
    model.zero_grad()
    return names, grads


# ---------------------------------------------------------------------------------- errors
def test_hooks_are_gone_after_an_exception_inside_a_hook(pair, batch) -> None:
    _, model, _ = pair
    plain = model(*batch)

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(*batch, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x * 2),
                                                ("blocks.1.attn.hook_pattern", boom)])
    with pytest.raises(RuntimeError, match="boom"):
        with model.hooks(fwd_hooks=[(lambda n: n.endswith("hook_result"), boom)]):
            model(*batch)
    assert all(not point._hooks for point in model.hook_dict.values())
    assert torch.equal(model(*batch), plain)


def test_wrong_shape_return_raises_naming_the_hook(pair, batch) -> None:
    _, model, _ = pair
    with pytest.raises(ValueError, match="blocks.0.attn.hook_pattern"):
        model.run_with_hooks(*batch, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: x[..., :1])])
    with pytest.raises(ValueError, match="blocks.1.attn.hook_k"):
        model.run_with_hooks(*batch, fwd_hooks=[("blocks.1.attn.hook_k", lambda x, hook: x.double())])


def test_unknown_hook_name_raises_with_close_matches(pair, batch) -> None:
    _, model, _ = pair
    with pytest.raises(KeyError, match="blocks.0.attn.hook_pattern"):
        model.run_with_hooks(*batch, fwd_hooks=[("blocks.0.attn.hook_patern", lambda x, hook: x)])


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_token_ids_outside_the_vocabulary_raise(pair, bad: int) -> None:
    _, model, _ = pair
    tokens = torch.tensor([[1, 2, bad]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(tokens)


# ---------------------------------------------------------------------- layers and the cache
def test_start_and_stop_at_layer_round_trip_bit_for_bit(pair, batch) -> None:
    _, model, _ = pair
    tokens, mask = batch
    full = model(tokens, mask)
    for layer in range(model.cfg.n_layers + 1):
        resid = model(tokens, mask, stop_at_layer=layer)
        assert resid.shape == (BATCH, POS, model.cfg.d_model)
        assert torch.equal(model(resid, mask, start_at_layer=layer), full)


def test_cache_shorthand_keys(pair, batch) -> None:
    _, model, rotary = pair
    _, cache = model.run_with_cache(*batch)
    last = model.cfg.n_layers - 1
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["q", 1, "attn"] is cache["blocks.1.attn.hook_q"]
    assert cache["resid_post", -1] is cache[f"blocks.{last}.hook_resid_post"]
    assert cache["embed"] is cache["hook_embed"]
    assert cache["normalized", 0, "ln2"] is cache["blocks.0.ln2.hook_normalized"]
    if rotary:
        assert cache["rot_k", last] is cache[f"blocks.{last}.attn.hook_rot_k"]
    else:
        assert "hook_rot_q" not in " ".join(cache.keys())


def test_decompose_and_accumulated_resid(pair, batch, assert_rel_close) -> None:
    _, model, rotary = pair
    _, cache = model.run_with_cache(*batch)
    n = model.cfg.n_layers
    parts, labels = cache.decompose_resid(return_labels=True)
    assert len(labels) == (1 if rotary else 2) + 2 * n and labels[0] == "embed"
    assert_rel_close(parts.sum(0), cache["resid_post", -1], 1e-6, "decompose_resid")
    acc = cache.accumulated_resid()
    assert acc.shape == (n + 1, BATCH, POS, model.cfg.d_model)
    assert torch.equal(acc[-1], cache["resid_post", -1]) and torch.equal(acc[0], cache["resid_pre", 0])
    assert cache.accumulated_resid(incl_mid=True).shape == (2 * n + 1, BATCH, POS, model.cfg.d_model)
