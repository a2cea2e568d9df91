"""HookedJamba against HF's JambaForCausalLM: Mamba-1 (weighted dt/B/C norms) + attention, MoE every other layer.

float32 parity on logits and every residual (1e-4 of the max magnitude) for several periods/offsets,
top-k 1..3; left padding; float64 Mamba-1 invariants and knockout; expert ablation == HF with that
expert's down_proj zeroed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from loaders.jamba import config_from_hf, key_map
from loaders.load import from_hf
from tests.hybrid_checks import (
    check_against_hf,
    check_knockout_equals_kernel_zeroing,
    check_padding,
    check_ssm_invariants,
    perturbed,
)

# name: (HF config overrides, batch, length)
CASES = {
    "attn_odd_moe_even": (dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                               expert_layer_offset=0), 2, 13),
    "attn_every_3_top3": (dict(num_hidden_layers=4, attn_layer_period=3, attn_layer_offset=2, num_experts_per_tok=3,
                               num_experts=5), 2, 21),
    "dense_only": (dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=1, num_experts=1), 2, 13),
    "top1_biases_tied": (dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=0, num_experts_per_tok=1,
                              mamba_proj_bias=True, mamba_conv_bias=False, tie_word_embeddings=True), 2, 13),
    "mha_dt_rank_3": (dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2, num_key_value_heads=4,
                           mamba_dt_rank=3), 2, 13),
    "len_1": (dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1), 2, 1),
    "len_long": (dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1), 1, 29),
}


def make_hf(**overrides) -> transformers.JambaForCausalLM:
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, mamba_d_state=8, intermediate_size=24,
              vocab_size=61, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    kw.update(overrides)
    config = transformers.JambaConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(transformers.JambaForCausalLM(config))


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    assert list(model.cfg.layer_types) == ["attention" if k == "attention" else "mamba" for k in hf.config.layers_block_type]
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


@pytest.mark.parametrize("name", ["attn_odd_moe_even", "attn_every_3_top3"])
def test_left_padding_equals_prompt_alone(name):
    hf = make_hf(**CASES[name][0])
    check_padding(hf, from_hf(hf))


def test_config_mapping_and_weights():
    hf = make_hf(**CASES["attn_every_3_top3"][0])
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_types == ("mamba", "mamba", "attention", "mamba")
    assert cfg.mlp_types == tuple("moe" if n > 1 else "mlp" for n in hf.config.layers_num_experts)
    assert (cfg.n_experts, cfg.top_k, cfg.dt_rank, cfg.n_heads) == (5, 3, 1, 32)
    model = from_hf(hf)
    assert set(key_map(cfg)) == set(dict(model.named_parameters()))


@pytest.mark.parametrize("name,layer,expert", [("attn_odd_moe_even", 2, 3), ("attn_every_3_top3", 1, 4)])
def test_expert_ablation_equals_hf_with_its_down_proj_zeroed(name, layer, expert):
    hf = make_hf(**CASES[name][0])
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    site, seen = f"blocks.{layer}.mlp", {}
    hooks = [(f"{site}.hook_chosen", lambda c, hook: seen.update(c=c)),
             (f"{site}.hook_routing_weights", lambda w, hook: w.masked_fill(seen["c"] == expert, 0.0))]
    with torch.no_grad():
        ours = model.run_with_hooks(tokens, fwd_hooks=hooks)
        assert (seen["c"] == expert).any()
        hf.model.layers[layer].feed_forward.experts.down_proj[expert].zero_()
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_channel_ablation_equals_hf_with_its_out_proj_column_zeroed():
    from analysis.interventions import ablate_heads

    hf = make_hf(**CASES["attn_odd_moe_even"][0])
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with ablate_heads(model, [(0, 5), (0, 17), (1, 2)]):
            ours = model(tokens)
        hf.model.layers[0].mamba.out_proj.weight[:, [5, 17]] = 0
        hf.model.layers[1].self_attn.o_proj.weight[:, 8:12] = 0
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_ssm_invariants_float64_and_knockout():
    from analysis.interventions.knockout import knockout

    model = from_hf(make_hf(**CASES["attn_odd_moe_even"][0]).double())
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    check_ssm_invariants(model, tokens, "blocks.2.mixer")
    check_knockout_equals_kernel_zeroing(model, tokens, 0, sources=[0, 3], targets=[4, 12], knockout=knockout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attn_every_3_top3", "len_long"])
def test_parity_gpu_float32(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), device="cuda")
    check_against_hf(hf, model, tokens)
