"""MiniMax (HF `minimax`): lightning attention beside softmax attention, MoE MLPs, the stream through its norms.

Parity with HF's own model: float32 logits, the embedding and every resid_post within 1e-4 of HF's max
magnitude; float64 within 1e-5 of HF as shipped (its RMSNorm, router softmax and rotary compute in float32 in
a float64 model, and its decay buffers are made in float32) and within 1e-10 with those parts made float64;
left padding == each prompt alone; decoding with a DecodeState == recompute == HF's whole forward (and ==
HF's own cached decoding where layer 0 is softmax attention: with a lightning layer 0, transformers 5.24's
MiniMaxCache.get_seq_length() stays 0, so HF decodes with position ids and masks restarted at 0, off its
own whole forward by 1.77 absolute on the tiny model); save_pretrained -> from_pretrained == from_hf bit for
bit; MiniMax-Text-01's config built on meta with HF's shape for every tensor and its parameter count; a
layer type HF has no mask for refused by name.
The lightning mixer (float64, 1e-12): the block algorithm == the sequential oracle (any block size, from a
state); y == K . v; y == S^T q read from hook_h; kernel rows / columns == the dense kernel; knockout ==
zeroing the dense kernel's entries (all heads, some heads); its heads are the map's units.
State edits: tests/test_state_edits.py; decode-step knockout: tests/test_decode_knockout.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from einops import einsum
from hybrid_checks import (check_against_hf, check_decoding, check_heads_are_map_units,
                           check_knockout_zeroes_head_entries, check_padding, check_released_on_meta,
                           check_save_pretrained, perturbed)
from test_parity_moe_families import _float64_forward
from tiny_families import tiny

from analysis.interventions import knockout
from hooked.models.lightning import LightningMixer
from hooked.ops.lightning import (lightning_chunked, lightning_kernel, lightning_kernel_cols, lightning_kernel_rows,
                                  lightning_sequential)
from hooked.ops.rotary import rope_inv_freq
from loaders.load import from_hf, normalise_config
from loaders.registry import find_architecture

V = 64
VARIANTS = {
    "alternating": dict(num_hidden_layers=4, block_size=4),  # HF's default layer types: attention at even layers
    "factors_window": dict(num_hidden_layers=3, block_size=3, sliding_window=5, full_attn_alpha_factor=0.7,
                           full_attn_beta_factor=1.2, linear_attn_alpha_factor=1.3, linear_attn_beta_factor=0.8,
                           mlp_alpha_factor=0.9, mlp_beta_factor=1.1,
                           layer_types=["linear_attention", "linear_attention", "full_attention"]),
}
F64 = 1e-5  # HF's MiniMaxRMSNorm casts to float32 in a float64 model
RELEASED = dict(  # MiniMaxAI/MiniMax-Text-01-hf: 80 layers, softmax attention every 8th, DeepNorm alpha (2 * 80)^(1/4)
    model_type="minimax", architectures=["MiniMaxForCausalLM"], vocab_size=200064, hidden_size=6144,
    intermediate_size=9216, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    num_local_experts=32, num_experts_per_tok=2, block_size=256, rope_theta=10000000, max_position_embeddings=10240000,
    layer_types=["full_attention" if (l + 1) % 8 == 0 else "linear_attention" for l in range(80)],
    **{f"{k}_{ab}_factor": (160 ** 0.25 if ab == "alpha" else 1.0) for k in ("full_attn", "linear_attn", "mlp")
       for ab in ("alpha", "beta")})


def make_hf(variant: str, dtype: torch.dtype = torch.float32):
    config = transformers.MiniMaxConfig(vocab_size=V, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=8, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
                                        pad_token_id=0, **VARIANTS[variant])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # HF's grouped_mm path refuses float64
    torch.manual_seed(0)
    return perturbed(transformers.MiniMaxForCausalLM(config), scale=0.2).to(dtype)


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ parity with HF
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_resid_and_padding_equal_hf(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    assert [b.kind for b in model.blocks] == ["mixer" if t == "linear_attention" else "attn"
                                              for t in hf.config.layer_types]
    check_against_hf(hf, model, tokens())
    check_padding(hf, model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_logits_and_resid_equal_hf(variant):
    hf = make_hf(variant, torch.float64)
    model, toks = from_hf(hf), tokens()
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
    n = model.cfg.n_layers
    ours = [cache[f"blocks.{l}.hook_resid_post"] for l in range(n - 1)] + [logits]
    for what, a, b in zip([f"resid_post {l}" for l in range(n - 1)] + ["logits"], ours,
                          list(out.hidden_states[1:-1]) + [out.logits]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=F64 * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_within_1e10_of_hf_with_its_float32_parts_made_float64(variant):
    hf = make_hf(variant, torch.float64)
    model, toks = from_hf(hf), tokens()
    for module in hf.modules():
        name = type(module).__name__
        if name.endswith(("RMSNorm", "RotaryEmbedding", "TopKRouter")):  # HF's source, its float32 casts float64
            module.forward = _float64_forward(module)
        if name == "MiniMaxLightningAttention":  # the decay buffers, made again in float64
            torch.set_default_dtype(torch.float64)
            try:
                slope = module.get_slope_rate()
            finally:
                torch.set_default_dtype(torch.float32)
            module.slope_rate, (module.query_decay, module.key_decay, module.diagonal_decay) = (
                slope, module.decay_factors(slope))
    rope = next(b.attn for b in model.blocks if b.kind == "attn").rotary
    hf.model.rotary_emb.inv_freq = rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling), torch.float64)
    hf.config._attn_implementation = "sdpa"  # its math kernel keeps float64 (HF's eager softmax is float32)
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
    n = model.cfg.n_layers
    for what, a, b in zip([f"resid_post {l}" for l in range(n - 1)] + ["logits"],
                          [cache[f"blocks.{l}.hook_resid_post"] for l in range(n - 1)] + [logits],
                          list(out.hidden_states[1:-1]) + [out.logits]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_with_the_state_equals_recomputing_and_hf(variant):
    """5 positions (past one block of 3 or 4), then one at a time; and HF's own decoding where it can."""
    hf = make_hf(variant)
    toks = tokens(pos=11)
    stepped = check_decoding(hf, from_hf(hf), toks, padded_then_step=False)
    if hf.config.layer_types[0] != "full_attention":
        return  # HF's cache counts the positions read by layer 0's keys: none after a lightning layer 0 (above)
    with torch.no_grad():
        theirs = hf(toks, use_cache=False).logits
        cache = hf(toks[:, :5], use_cache=True).past_key_values  # HF's own decoding: its linear cache
        hf_steps = [hf(toks[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(5, 11)]
    torch.testing.assert_close(stepped[:, 5:], torch.cat(hf_steps, 1), rtol=0, atol=1e-4 * theirs.abs().max().item())


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    check_save_pretrained(make_hf(variant), tokens(), tmp_path)


def test_released_config_builds_hf_shapes_on_meta():
    cfg, model = check_released_on_meta(RELEASED, "minimax", transformers.MiniMaxForCausalLM, read="raw")
    assert cfg.layer_types.count("attention") == 10 and cfg.attn_alpha == pytest.approx(3.5565588200778455)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9) == 456  # MiniMax-Text-01's published 456B


def test_a_layer_type_hf_has_no_mask_for_is_refused_by_name():
    raw = normalise_config(dict(RELEASED, num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="sliding_attention"):
        find_architecture(raw).config_from_hf(raw)


# ------------------------------------------------------------------------------ the lightning mixer, float64
@pytest.mark.parametrize("block_size", [1, 3, 4, 11, 16])
def test_block_algorithm_equals_the_sequential_oracle(block_size):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    slope, h0 = torch.tensor([0.05, 0.4, 1.7], dtype=torch.float64), torch.randn(2, 3, 4, 4, generator=g,
                                                                                  dtype=torch.float64)
    for start in (None, h0):
        y, S = lightning_sequential(q, k, v, slope, start)
        y_b, S_b = lightning_chunked(q, k, v, slope, block_size, start)
        torch.testing.assert_close(y_b, y, rtol=0, atol=1e-12)
        torch.testing.assert_close(S_b, S, rtol=0, atol=1e-12)
    K = lightning_kernel(q, k, slope)
    torch.testing.assert_close(einsum(K, v, "b h j i, b i h v -> b j h v"), lightning_sequential(q, k, v, slope)[0],
                               rtol=0, atol=1e-12)
    idx = torch.tensor([10, 0, 4, 4])
    assert torch.equal(lightning_kernel_rows(q, k, slope, idx), K[:, :, idx])
    assert torch.equal(lightning_kernel_cols(q, k, slope, idx), K[..., idx])


def mixer_run(model, layer: int, toks, fwd_hooks=()):
    where = f"blocks.{layer}.mixer"
    names = [f"{where}.hook_{n}" for n in ("q", "k", "v", "h", "kernel", "y")]
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks, names_filter=names) if not fwd_hooks else (None, None)
        if fwd_hooks:
            logits = model.run_with_hooks(toks, fwd_hooks=list(fwd_hooks))
    return logits, cache


def test_kernel_and_states_reconstruct_y():
    model = copy.deepcopy(tiny("minimax")).double()
    toks = tokens(pos=11)
    for layer, block in enumerate(model.blocks):
        if not isinstance(block.sublayer("mixer"), LightningMixer):
            continue
        _, c = mixer_run(model, layer, toks)
        p = f"blocks.{layer}.mixer.hook_"
        y = c[p + "y"]
        torch.testing.assert_close(einsum(c[p + "kernel"], c[p + "v"], "b h j i, b i h v -> b j h v"), y,
                                   rtol=0, atol=1e-12 * y.abs().max().item())
        torch.testing.assert_close(einsum(c[p + "h"], c[p + "q"], "b l h c v, b l h c -> b l h v"), y,
                                   rtol=0, atol=1e-12 * y.abs().max().item())


@pytest.mark.parametrize("channels", [None, [0, 2]])
def test_knockout_equals_zeroing_the_dense_kernels_entries(channels):
    model = copy.deepcopy(tiny("minimax")).double()
    layers = [l for l, b in enumerate(model.blocks) if isinstance(b.sublayer("mixer"), LightningMixer)]
    check_knockout_zeroes_head_entries(model, tokens(pos=11), layers, [1, 3, 6], [4, 6, 9, 10], channels, 4, knockout)


def test_the_heads_are_the_maps_units():
    model = copy.deepcopy(tiny("minimax")).double()
    check_heads_are_map_units(model, 4, tokens(pos=7), scale=model.cfg.lightning_beta)
