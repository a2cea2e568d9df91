"""HookedGraniteMoeHybrid (Granite 4 hybrid) against HF's GraniteMoeHybridForCausalLM, and its invariants.

float32 parity on logits and every residual (1e-4 of the max magnitude), dense and MoE MLPs (top-k 2
and 3), every multiplier away from 1, rope on and off; left padding; float64 SSM invariants; expert
ablation (routing weight zeroed) == HF with that expert's down-projection zeroed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from loaders.granitemoehybrid import config_from_hf, key_map
from loaders.load import from_hf
from tests.hybrid_checks import (
    check_against_hf,
    check_knockout_equals_kernel_zeroing,
    check_padding,
    check_ssm_invariants,
    perturbed,
)

M, A = "mamba", "attention"
MUP = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5)
# name: (HF config overrides, batch, length)
CASES = {
    "dense_rope": (dict(layer_types=[M, A, M], num_local_experts=0, position_embedding_type="rope", **MUP), 2, 13),
    "moe_top2_rope": (dict(layer_types=[M, A, M], num_local_experts=4, position_embedding_type="rope", **MUP), 2, 13),
    "moe_top3_nope": (dict(layer_types=[A, M, M, A], num_local_experts=5, num_experts_per_tok=3, **MUP), 2, 21),
    "moe_top1_plain": (dict(layer_types=[M, A], num_local_experts=3, num_experts_per_tok=1), 2, 13),
    "all_mamba_tied_groups1": (dict(layer_types=[M, M], num_local_experts=4, mamba_n_groups=1,
                                    tie_word_embeddings=True, time_step_limit=(0.01, 0.5)), 2, 13),
    "attn_bias_mha": (dict(layer_types=[A, M], num_local_experts=4, attention_bias=True, num_key_value_heads=4,
                           position_embedding_type="rope", **MUP), 2, 13),
    "len_1": (dict(layer_types=[M, A, M], num_local_experts=4, **MUP), 2, 1),
    "len_ragged_long": (dict(layer_types=[M, A, M], num_local_experts=4, position_embedding_type="rope", **MUP), 1, 29),
}


def make_hf(**overrides) -> transformers.GraniteMoeHybridForCausalLM:
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_n_groups=2,
              mamba_d_state=8, mamba_chunk_size=8, intermediate_size=12, shared_intermediate_size=20, vocab_size=61,
              max_position_embeddings=64)
    kw.update(overrides)
    kw["num_hidden_layers"] = len(kw["layer_types"])
    config = transformers.GraniteMoeHybridConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(transformers.GraniteMoeHybridForCausalLM(config))


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


@pytest.mark.parametrize("name", ["moe_top2_rope", "moe_top3_nope"])
def test_left_padding_equals_prompt_alone(name):
    hf = make_hf(**CASES[name][0])
    check_padding(hf, from_hf(hf))


def test_config_mapping_and_weights():
    hf = make_hf(**CASES["moe_top3_nope"][0])
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_types == ("attention", "mamba", "mamba", "attention") and not cfg.use_rope
    assert (cfg.n_experts, cfg.top_k, cfg.d_mlp, cfg.d_shared) == (5, 3, 12, 20)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier) == (3.0, 0.5, 0.3)
    assert cfg.logit_multiplier == pytest.approx(1 / 2.5)
    model = from_hf(hf)
    assert set(key_map(cfg)) == set(dict(model.named_parameters()))
    moe = model.blocks[1].mlp
    state = hf.state_dict()
    fused = state["model.layers.1.block_sparse_moe.experts.gate_up_proj"]
    assert torch.equal(torch.cat([moe.gate_proj, moe.up_proj], dim=1), fused)
    shared = state["model.layers.1.shared_mlp.input_linear.weight"]
    assert torch.equal(torch.cat([moe.shared.gate_proj.weight, moe.shared.up_proj.weight]), shared)
    with pytest.raises(ValueError, match="layer types"):
        config_from_hf({**hf.config.to_dict(), "layer_types": ["mamba", "mlp", "mamba", "mamba"]})


# --------------------------------------------------------------------------- experts and invariants
@pytest.mark.parametrize("name,layer,expert", [("moe_top2_rope", 0, 1), ("moe_top3_nope", 3, 4),
                                               ("moe_top1_plain", 1, 0)])
def test_expert_ablation_equals_hf_with_its_down_proj_zeroed(name, layer, expert):
    hf = make_hf(**CASES[name][0])
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    site = f"blocks.{layer}.mlp"
    seen = {}

    def chosen(c, hook):
        seen["chosen"] = c

    def zero(w, hook):
        return w.masked_fill(seen["chosen"] == expert, 0.0)

    with torch.no_grad():
        ours = model.run_with_hooks(tokens, fwd_hooks=[(f"{site}.hook_chosen", chosen),
                                                       (f"{site}.hook_routing_weights", zero)])
        assert (seen["chosen"] == expert).any(), "the expert must be routed to"
        hf.model.layers[layer].block_sparse_moe.experts.down_proj[expert].zero_()
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_ssm_invariants_float64_and_knockout():
    from analysis.interventions.knockout import knockout

    model = from_hf(make_hf(**CASES["moe_top3_nope"][0]).double())
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    check_ssm_invariants(model, tokens, "blocks.1.mixer")
    check_knockout_equals_kernel_zeroing(model, tokens, 2, sources=[1, 5], targets=[6, 12], knockout=knockout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["moe_top3_nope", "len_ragged_long"])
def test_parity_gpu_float32(name):
    overrides, batch, length = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), device="cuda")
    check_against_hf(hf, model, tokens)
