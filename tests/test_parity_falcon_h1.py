"""HookedFalconH1 against HF's FalconH1ForCausalLM: parallel attention + Mamba-2, every muP multiplier.

float32 parity on logits and every residual (1e-4 of the max magnitude) for each gate/norm variant of
the SSM branch, mamba_d_ssm, biases, GQA/MHA; left padding; float64 SSM invariants; ablating one
branch (zeroing its hook_*_out) == HF with that branch's output projection zeroed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from loaders.falcon_h1 import config_from_hf, key_map
from loaders.load import from_hf
from tests.hybrid_checks import (
    check_against_hf,
    check_knockout_equals_kernel_zeroing,
    check_padding,
    check_ssm_invariants,
    perturbed,
)

MUP = dict(embedding_multiplier=2.0, lm_head_multiplier=0.7, mlp_multipliers=[1.3, 0.6], key_multiplier=0.8,
           attention_in_multiplier=1.4, attention_out_multiplier=0.9, ssm_multipliers=[0.5, 1.2, 0.8, 1.5, 0.7],
           ssm_in_multiplier=1.1, ssm_out_multiplier=0.6)
# name: (HF config overrides, batch, length)
CASES = {
    "silu_gate": (dict(), 2, 13),
    "silu_gate_mup": (dict(**MUP), 2, 13),
    "norm_before_gate_mup": (dict(mamba_rms_norm=True, **MUP), 2, 21),
    "gate_before_norm_mup": (dict(mamba_rms_norm=True, mamba_norm_before_gate=False, **MUP), 2, 13),
    "d_ssm_24_heads_3": (dict(mamba_d_ssm=24, mamba_n_heads=3, mamba_n_groups=1, **MUP), 2, 13),
    "biases_mha_tied": (dict(mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True,
                             num_key_value_heads=4, tie_word_embeddings=True, mamba_rms_norm=True, **MUP), 2, 13),
    "dt_limit_rope_linear": (dict(time_step_limit=(0.01, 0.4), rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 300.0}, **MUP), 2, 13),
    "len_1": (dict(**MUP), 2, 1),
    "len_ragged_long": (dict(mamba_rms_norm=True, **MUP), 1, 29),
}


def make_hf(**overrides) -> transformers.FalconH1ForCausalLM:
    kw = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
              mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, intermediate_size=24, vocab_size=61,
              max_position_embeddings=64, mamba_d_ssm=32)  # HF's default mamba_d_ssm is 1024
    kw.update(overrides)
    config = transformers.FalconH1Config(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(transformers.FalconH1ForCausalLM(config))


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


@pytest.mark.parametrize("name", ["norm_before_gate_mup", "silu_gate"])
def test_left_padding_equals_prompt_alone(name):
    hf = make_hf(**CASES[name][0])
    check_padding(hf, from_hf(hf))


def test_config_mapping_and_weights():
    hf = make_hf(**CASES["biases_mha_tied"][0])
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.ssm_multipliers == (0.5, 1.2, 0.8, 1.5, 0.7) and (cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier) == (1.3, 0.6)
    assert cfg.out_bias and cfg.proj_bias and cfg.ssm_norm and cfg.norm_before_gate and cfg.tied
    model = from_hf(hf)
    assert set(key_map(cfg)) == set(dict(model.named_parameters()))
    torch.testing.assert_close(model.blocks[0].mixer.in_scale, hf.model.layers[0].mamba.mup_vector.flatten())


@pytest.mark.parametrize("branch", ["attn", "mixer"])
@pytest.mark.parametrize("name", ["silu_gate_mup", "norm_before_gate_mup"])
def test_branch_ablation_equals_hf_with_its_output_projection_zeroed(name, branch):
    hf = make_hf(**CASES[name][0])
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens)
        ours = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.1.hook_{branch}_out", lambda t, hook: torch.zeros_like(t))])
        layer = hf.model.layers[1]
        (layer.self_attn.o_proj if branch == "attn" else layer.mamba.out_proj).weight.zero_()
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    assert not torch.allclose(ours, plain, atol=1e-3)


def test_head_ablation_on_either_branch():
    from analysis.interventions import ablate_heads

    hf = make_hf(**CASES["silu_gate_mup"][0])
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with ablate_heads(model, [(0, 1), ("blocks.1.mixer", 2)]):
            ours = model(tokens)
        hf.model.layers[0].self_attn.o_proj.weight[:, 4:8] = 0  # attention head 1 of d_head 4
        hf.model.layers[1].mamba.out_proj.weight[:, 16:24] = 0  # SSM head 2 of d_head 8
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_ssm_invariants_float64_and_knockout():
    from analysis.interventions.knockout import knockout

    model = from_hf(make_hf(**CASES["norm_before_gate_mup"][0]).double())
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    check_ssm_invariants(model, tokens, "blocks.0.mixer")
    check_knockout_equals_kernel_zeroing(model, tokens, 1, sources=[0, 4], targets=[5, 12], knockout=knockout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["norm_before_gate_mup", "len_ragged_long"])
def test_parity_gpu_float32(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), device="cuda")
    check_against_hf(hf, model, tokens)
