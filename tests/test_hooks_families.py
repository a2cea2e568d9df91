"""The hook contract and the interventions on Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3.

For each family: every documented hook exists in forward order and fires once with its shape
(q/k norms, soft-caps and post-norms included); identity hooks and a full cache leave the logits
bit-identical; head results sum to what the post-norm (if any) reads; the frozen final norm keeps
the decomposition exact; `ablate_heads` equals HF with the heads' o_proj columns zeroed; knockout is
causal in both attention modes; and a knockout of a source already outside a layer's sliding window
changes nothing, while the same cut in a full-attention layer does change the output.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hooked import backends
import transformers
from conftest import build_tiny_hf, rel_close
from torch import Tensor

from analysis.interventions import ablate_heads, knockout
from loaders.load import from_hf

VOCAB = 61
BATCH, POS, WINDOW = 2, 12, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8, layer_types=MIXED)
CASES = {  # name -> (HF model class, HF config)
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**SMALL, sliding_window=WINDOW)),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **SMALL, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **SMALL, **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**SMALL, **GEMMA)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(name, HF model, our model loaded from it)."""
    cls, config = CASES[request.param]
    hf = build_tiny_hf(copy.deepcopy(config), cls, perturb=0.1)
    return request.param, hf, from_hf(hf)


def tokens(seed: int = 3) -> Tensor:
    return torch.randint(1, VOCAB, (BATCH, POS), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def batch() -> tuple[Tensor, Tensor]:
    mask = torch.ones(BATCH, POS, dtype=torch.long)
    mask[1, :2] = 0  # the second row is left-padded
    return tokens(), mask


def expected_hooks(model) -> dict[str, tuple[int, ...]]:
    """DESIGN.md section 3 plus this issue's hooks, in forward order, for [BATCH, POS] tokens."""
    cfg = model.cfg
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    resid, q, k = (BATCH, POS, d), (BATCH, POS, h, dh), (BATCH, POS, kv, dh)
    one, q1, k1 = (BATCH, POS, 1), (BATCH, POS, h, 1), (BATCH, POS, kv, 1)
    scores, mlp = (BATCH, h, POS, POS), (BATCH, POS, cfg.d_mlp)
    hooks = {"hook_embed": resid}
    for l, block in enumerate(model.blocks):
        p = f"blocks.{l}."
        hooks |= {p + "hook_resid_pre": resid, p + "hook_attn_in": resid, p + "ln1.hook_scale": one,
                  p + "ln1.hook_normalized": resid, p + "attn.hook_q": q,
                  p + "attn.hook_k": k, p + "attn.hook_v": k}
        if block.attn.q_norm is not None:
            hooks |= {p + "attn.q_norm.hook_scale": q1, p + "attn.q_norm.hook_normalized": q,
                      p + "attn.k_norm.hook_scale": k1, p + "attn.k_norm.hook_normalized": k}
        hooks |= {p + "attn.hook_rot_q": q, p + "attn.hook_rot_k": k}
        if block.attn.softcap is not None:
            hooks |= {p + "attn.softcap.hook_in": scores, p + "attn.softcap.hook_out": scores}
        hooks |= {p + "attn.hook_attn_scores": scores, p + "attn.hook_pattern": scores, p + "attn.hook_z": q,
                  p + "attn.hook_result": (BATCH, POS, h, d)}
        if block.ln1_post is not None:
            hooks |= {p + "ln1_post.hook_scale": one, p + "ln1_post.hook_normalized": resid}
        hooks |= {p + "hook_attn_out": resid, p + "hook_resid_mid": resid, p + "hook_mlp_in": resid,
                  p + "ln2.hook_scale": one, p + "ln2.hook_normalized": resid,
                  p + "mlp.hook_pre": mlp, p + "mlp.hook_pre_linear": mlp, p + "mlp.hook_post": mlp}
        if block.ln2_post is not None:
            hooks |= {p + "ln2_post.hook_scale": one, p + "ln2_post.hook_normalized": resid}
        hooks |= {p + "hook_mlp_out": resid, p + "hook_resid_post": resid}
    hooks |= {"ln_final.hook_scale": one, "ln_final.hook_normalized": resid, "unembed.hook_in": resid,
              "unembed.hook_out": (BATCH, POS, VOCAB)}
    if model.unembed.softcap is not None:
        hooks |= {"unembed.softcap.hook_in": (BATCH, POS, VOCAB), "unembed.softcap.hook_out": (BATCH, POS, VOCAB)}
    return hooks


FAMILY_HOOKS = {  # hooks each family must have (so that expected_hooks cannot silently drop them)
    "mistral": [], "qwen2": [],
    "qwen3": ["blocks.0.attn.q_norm.hook_normalized"],
    "gemma2": ["blocks.0.attn.softcap.hook_in", "blocks.2.ln1_post.hook_normalized", "unembed.softcap.hook_out"],
    "gemma3": ["blocks.1.attn.k_norm.hook_normalized", "blocks.0.ln2_post.hook_normalized"],
}


# ------------------------------------------------------------------------------- the contract
def test_every_hook_exists_in_forward_order_and_fires_once_with_its_shape(pair, batch) -> None:
    name, _, model = pair
    expected = expected_hooks(model)
    assert list(model.hook_dict) == list(expected)
    assert all(h in expected for h in FAMILY_HOOKS[name])
    fired: dict[str, list[tuple[int, ...]]] = {}
    record = lambda x, hook: fired.setdefault(hook.name, []).append(tuple(x.shape))  # noqa: E731
    model.run_with_hooks(*batch, fwd_hooks=[(lambda n: True, record)])
    assert fired == {n: [shape] for n, shape in expected.items()}


def test_identity_hooks_and_full_cache_leave_logits_bit_identical(pair, batch) -> None:
    _, _, model = pair
    with backends.use(attention="eager"):  # the hooks below put every layer on the exact path
        plain = model(*batch)
    hooked = model.run_with_hooks(*batch, fwd_hooks=[(lambda n: True, lambda x, hook: x)])
    cached, cache = model.run_with_cache(*batch, incl_lazy=True)
    assert torch.equal(plain, hooked) and torch.equal(plain, cached)
    assert len(cache) == len(model.hook_dict)


def test_head_results_sum_to_the_attention_output(pair, batch, assert_rel_close) -> None:
    """sum_h result_h + b_O is the attention output: hook_attn_out, or what ln1_post turns into it."""
    _, _, model = pair
    _, cache = model.run_with_cache(*batch, incl_lazy=True)
    for l, block in enumerate(model.blocks):
        bias = block.attn.o_proj.bias if block.attn.o_proj.bias is not None else 0.0
        summed = cache["result", l].sum(2) + bias
        post = block.ln1_post(summed) if block.ln1_post is not None else summed
        assert_rel_close(post, cache["attn_out", l], 1e-5, f"layer {l}")


def test_decomposition_through_the_frozen_final_norm(pair, batch, assert_rel_close) -> None:
    """The final norm applied with the final residual's scale (hook_scale) to the summed components
    is ln_final's output ((1 + w) for Gemma)."""
    _, _, model = pair
    _, cache = model.run_with_cache(*batch)
    parts = cache.decompose_resid()
    assert_rel_close(parts.sum(0), cache["resid_post", -1], 1e-5, "decompose_resid")
    frozen = model.ln_final.normalize_with_scale(parts, cache["ln_final.hook_scale"]).sum(0)
    assert_rel_close(frozen, cache["ln_final.hook_normalized"], 1e-5, "apply_frozen")


def test_pattern_respects_causality_padding_and_windows(pair, batch) -> None:
    _, _, model = pair
    tokens_, mask = batch
    _, cache = model.run_with_cache(tokens_, mask, names_filter=lambda n: n.endswith("hook_pattern"))
    q, k = torch.arange(POS)[:, None], torch.arange(POS)[None]
    for l, block in enumerate(model.blocks):
        window = block.attn.window or POS + 1
        hidden = (k > q) | (k <= q - window)
        pattern = cache["pattern", l]
        assert pattern.isfinite().all()
        assert (pattern[0][..., hidden] == 0).all() and (pattern[1, :, 2:, :2] == 0).all()
        assert (pattern[0][..., ~hidden] > 0).all()


# --------------------------------------------------------------------------- interventions
HEADS = [(0, 1), (2, 0), (2, 3)]


def _hf_with_zeroed_heads(hf, heads: list[tuple[int, int]], d_head: int):
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for layer, head in heads:
            hf.model.layers[layer].self_attn.o_proj.weight[:, head * d_head:(head + 1) * d_head] = 0
    return hf


def test_ablate_heads_equals_hf_with_o_proj_columns_zeroed(pair, batch) -> None:
    _, hf, model = pair
    tokens_, mask = batch
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = _hf_with_zeroed_heads(hf, HEADS, model.cfg.d_head)(
            tokens_, attention_mask=mask, position_ids=position_ids).logits
        plain = model(tokens_, mask)
        with ablate_heads(model, HEADS):
            got = model(tokens_, mask)
    real = mask.bool()
    rel_close(got[real], expected[real], 1e-5, "ablated logits")
    assert (got - plain)[real].abs().max() > 1e-3 * plain.abs().max(), "the ablation changed nothing"
    assert torch.equal(model(tokens_, mask), plain), "hooks left behind"


@pytest.mark.parametrize("mode", ["scores", "pattern"])
def test_knockout_is_causal(pair, mode: str) -> None:
    """Changing tokens after the target never changes the target's logits, whatever is cut."""
    _, _, model = pair
    j = 7
    a = tokens(seed=3)
    b = a.clone()
    b[:, j + 1:] = tokens(seed=4)[:, j + 1:]
    every = range(model.cfg.n_layers)
    with torch.no_grad():
        clean = model(a)
        for sources in (range(POS), [j - 1, j, j + 1, j + 2], [j + 1, j + 3]):
            with knockout(model, sources, [j, j - 2], every, attention=mode):
                la, lb = model(a), model(b)
            assert torch.isfinite(la).all()
            torch.testing.assert_close(la[:, : j + 1], lb[:, : j + 1], rtol=0, atol=1e-6)
        with knockout(model, [j - 1, j - 2], [j], every, attention=mode):
            assert (model(a)[:, j] - clean[:, j]).abs().max() > 1e-4  # a real cut does something


@pytest.mark.parametrize("mode", ["scores", "pattern"])
def test_knockout_outside_the_window_changes_nothing(pair, mode: str) -> None:
    """Source j - WINDOW is outside every sliding layer's window of target j: cutting it there is a
    no-op (bit for bit); the same cut in a full-attention layer, where the edge exists, is not."""
    _, _, model = pair
    j = POS - 1
    source = j - WINDOW
    sliding = [l for l, b in enumerate(model.blocks) if b.attn.window == WINDOW]
    full = [l for l, b in enumerate(model.blocks) if b.attn.window is None]
    assert sliding, "the case must have sliding layers"
    toks = tokens()
    with torch.no_grad(), backends.use(attention="eager"):  # knockout's layers run eager: so does clean
        clean = model(toks)
        with knockout(model, [source], [j], sliding, attention=mode):
            assert torch.equal(model(toks), clean)
        with knockout(model, [source + 1], [j], sliding, attention=mode):  # just inside the window
            assert (model(toks)[:, j] - clean[:, j]).abs().max() > 1e-4
        if full:
            with knockout(model, [source], [j], full, attention=mode):
                assert (model(toks)[:, j] - clean[:, j]).abs().max() > 1e-4


def test_incremental_decoding_equals_recompute_past_the_window(pair) -> None:
    """A DecodeState (prefix, then one token at a time, then two) gives the full forward's logits, with
    the window (4) shorter than the 12 tokens, and a left-padded row."""
    from hooked.generate import DecodeState

    _, _, model = pair
    toks, mask = tokens(), torch.ones(BATCH, POS, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(toks, mask)
        state = DecodeState()
        parts = [model(toks[:, :6], mask[:, :6], state=state)]
        parts += [model(toks[:, i:i + 1], state=state) for i in range(6, 10)]
        parts.append(model(toks[:, 10:], state=state))
    real = mask.bool()
    rel_close(torch.cat(parts, dim=1)[real], full[real], 1e-5, "incremental logits")


def test_edited_scale_is_what_the_norm_divides_by(pair, batch) -> None:
    """Doubling ln_final.hook_scale halves ln_final's output, (1 + w)-norms included."""
    _, _, model = pair
    _, plain = model.run_with_cache(*batch, names_filter="ln_final.hook_normalized")
    with model.hooks(fwd_hooks=[("ln_final.hook_scale", lambda x, hook: 2 * x)]):
        _, edited = model.run_with_cache(*batch, names_filter="ln_final.hook_normalized")
    rel_close(edited["ln_final.hook_normalized"], plain["ln_final.hook_normalized"] / 2, 1e-6, "halved")


def test_fold_ln_keeps_the_logits(pair, batch) -> None:
    """fold_ln moves each pre-norm's gain ((1 + w) for Gemma) into its readers: same logits; the
    post-norms read no residual and stay. A final soft-cap refuses center_unembed, by name."""
    from hooked.processing import process_weights

    _, _, model = pair
    folded = process_weights(copy.deepcopy(model), fold_ln=True, center_writing_weights=False,
                             center_unembed=False, fold_value_biases=True)
    with torch.no_grad():
        rel_close(folded(*batch)[batch[1].bool()], model(*batch)[batch[1].bool()], 1e-5, "fold_ln")
    if model.unembed.softcap is not None:
        with pytest.raises(ValueError, match="soft-cap"):
            process_weights(copy.deepcopy(model), center_unembed=True)


def test_transformerlens_weight_names(pair) -> None:
    """TL's weight names read the new families' modules: shapes as TL has them (kv heads repeated for
    W_K, W_V), W_O[l, h] is head h's o_proj columns, W_U is W_E^T when tied."""
    _, _, model = pair
    cfg, n, h = model.cfg, model.cfg.n_layers, model.cfg.n_heads
    assert model.W_Q.shape == model.W_K.shape == model.W_V.shape == (n, h, cfg.d_model, cfg.d_head)
    assert model.W_O.shape == (n, h, cfg.d_head, cfg.d_model) and model.OV.shape == (n, h, cfg.d_model, cfg.d_model)
    o_proj = model.blocks[1].attn.o_proj.weight
    assert torch.equal(model.W_O[1, 2], o_proj[:, 2 * cfg.d_head:3 * cfg.d_head].T)
    if cfg.tied:
        assert torch.equal(model.W_U, model.W_E.T)
