"""HookedBamba against Hugging Face's BambaForCausalLM (eager attention, torch SSM path), and its invariants.

Parity: float32, logits and every residual within 1e-4 of the reference's max magnitude, tiny random
models with every parameter perturbed, chunk_size 8 (lengths 13, 21 and 29 are not multiples).
Invariants (float64, tests/hybrid_checks.py): chunked == scan == kernel, an edit of h == the
brute-force recurrence, knockout == zeroing kernel entries, attention knockout on an attention layer.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hooked.models.bamba import BambaConfig
from loaders.bamba import config_from_hf, key_map
from loaders.load import from_hf
from tests.hybrid_checks import (
    check_against_hf,
    check_knockout_equals_kernel_zeroing,
    check_padding,
    check_ssm_invariants,
    perturbed,
)

# name: (HF BambaConfig overrides, batch, length)
CASES = {
    "attn_middle": (dict(num_hidden_layers=3, attn_layer_indices=[1]), 2, 13),
    "attn_first_last": (dict(num_hidden_layers=4, attn_layer_indices=[0, 3]), 2, 21),
    "all_mamba": (dict(num_hidden_layers=2, attn_layer_indices=[]), 2, 13),
    "all_attention": (dict(num_hidden_layers=2, attn_layer_indices=[0, 1]), 2, 13),
    "mha_groups1_biases": (dict(num_hidden_layers=3, attn_layer_indices=[2], num_key_value_heads=4, mamba_n_groups=1,
                                attention_bias=True, mlp_bias=True, mamba_proj_bias=True), 2, 13),
    "dt_limit_no_conv_bias_tied": (dict(num_hidden_layers=3, attn_layer_indices=[1], time_step_limit=(0.01, 0.5),
                                        mamba_conv_bias=False, tie_word_embeddings=True), 2, 13),
    "rope_linear": (dict(num_hidden_layers=2, attn_layer_indices=[1],
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}), 2, 13),
    "len_1": (dict(num_hidden_layers=3, attn_layer_indices=[1]), 2, 1),
    "len_ragged_long": (dict(num_hidden_layers=3, attn_layer_indices=[1]), 1, 29),
}


def make_hf(**overrides) -> transformers.BambaForCausalLM:
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_n_groups=2,
              mamba_d_state=8, mamba_chunk_size=8, intermediate_size=24, vocab_size=61, max_position_embeddings=64)
    kw.update(overrides)
    config = transformers.BambaConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(transformers.BambaForCausalLM(config))


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    assert model.cfg.layer_types == tuple("attention" if k == "full_attention" else "mamba"
                                          for k in hf.config.layers_block_type)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


@pytest.mark.parametrize("name", ["attn_first_last", "dt_limit_no_conv_bias_tied"])
def test_left_padding_equals_prompt_alone(name):
    """(With mamba_proj_bias HF's padded rows differ from the prompt alone: in_proj's bias enters the
    conv at padded positions. Ours zero them, so ours equal the prompt alone; not compared here.)"""
    hf = make_hf(**CASES[name][0])
    check_padding(hf, from_hf(hf))


def test_partial_rotary_rotates_half_of_each_head():
    cfg = config_from_hf(make_hf(**CASES["attn_middle"][0]).config.to_dict())
    assert cfg.partial_rotary_factor == 0.5 and cfg.rotary.d_rot == cfg.d_attn_head // 2 == 2


def test_weights_equal_hf():
    hf = make_hf(**CASES["mha_groups1_biases"][0])
    model = from_hf(hf)
    params, state = dict(model.named_parameters()), hf.state_dict()
    keys = key_map(model.cfg)
    assert set(keys) == set(params)
    for name, key in keys.items():
        ref = state[key.names[0]]
        assert torch.equal(params[name], key.transform(ref) if key.transform else ref), name


def test_save_pretrained_and_reload(tmp_path):
    from loaders.load import from_pretrained

    hf = make_hf(**CASES["attn_middle"][0])
    hf.save_pretrained(tmp_path)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    check_against_hf(hf, from_pretrained(tmp_path), tokens)


def test_config_refuses_bad_layer_indices():
    hf = make_hf(**CASES["attn_middle"][0])
    with pytest.raises(ValueError, match="outside"):
        config_from_hf({**hf.config.to_dict(), "attn_layer_indices": [7]})
    with pytest.raises(ValueError, match="layer_types"):
        BambaConfig(n_layers=2, d_model=16, d_vocab=5, d_mlp=8, layer_types=("mamba", "mlp"), n_heads=4)


# ------------------------------------------------------------------------------ float64 invariants
def model64() -> HookedBamba:
    return from_hf(make_hf(**CASES["attn_first_last"][0]).double())


def test_ssm_invariants_float64():
    model = model64()
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    for layer in (1, 2):
        check_ssm_invariants(model, tokens, f"blocks.{layer}.mixer")


def test_knockout_equals_zeroing_kernel_entries():
    from analysis.interventions.knockout import knockout

    model = model64()
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    check_knockout_equals_kernel_zeroing(model, tokens, 1, sources=[2, 3, 7], targets=[9, 12], knockout=knockout)


def test_attention_knockout_equals_pattern_zeroing_and_hook_sites():
    from analysis.interventions.knockout import knockout, knockout_sites

    model = model64()
    assert knockout_sites(model, 0) == (["blocks.0.attn"], []) and knockout_sites(model, 1) == ([], ["blocks.1.mixer"])
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))

    def zero(p, hook):
        p = p.clone()
        p[..., 12, 3] = 0
        return p

    with torch.no_grad():
        with knockout(model, sources=[3], targets=[12], layers=[0, 3], attention="pattern"):
            cut = model(tokens)
        ref = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith("attn.hook_pattern"), zero)])
    torch.testing.assert_close(cut, ref, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attn_first_last", "len_ragged_long"])
def test_parity_gpu_float32(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), device="cuda")
    check_against_hf(hf, model, tokens)
