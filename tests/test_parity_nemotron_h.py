"""HookedNemotronH against HF's NemotronHForCausalLM: one mixer per layer from the pattern string.

float32 parity on logits and every residual (1e-4 of the max magnitude) for each pattern (M * - E),
sigmoid MoE routing with groups, top-k 2 and 3, correction bias perturbed; left padding; float64 SSM
invariants and knockout; expert ablation == HF with that expert's down_proj zeroed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hooked.models.nemotron_h import NemotronHConfig
from loaders.load import from_hf
from loaders.nemotron_h import config_from_hf, key_map
from tests.hybrid_checks import (
    check_against_hf,
    check_knockout_equals_kernel_zeroing,
    check_padding,
    check_ssm_invariants,
    perturbed,
)

# name: (HF hybrid_override_pattern, HF config overrides, batch, length)
CASES = {
    "M*-E": ("M*-E", dict(), 2, 13),
    "ME*M-": ("ME*M-", dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, num_experts_per_tok=3), 2, 21),
    "MMM": ("MMM", dict(), 2, 13),
    "*-*E": ("*-*E", dict(norm_topk_prob=False), 2, 13),
    "E_top1": ("EM", dict(num_experts_per_tok=1), 2, 13),
    "biases_groups1_tied": ("M-E", dict(use_bias=True, mlp_bias=True, n_groups=1, tie_word_embeddings=True,
                                         use_conv_bias=False, time_step_min=0.05), 2, 13),
    "len_1": ("M*E", dict(), 2, 1),
    "len_ragged_long": ("M*-E", dict(n_group=2, topk_group=1), 1, 29),
}


def make_hf(pattern: str, **overrides) -> transformers.NemotronHForCausalLM:
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, mamba_num_heads=4,
              mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8, intermediate_size=24, vocab_size=61,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
              moe_shared_expert_intermediate_size=10, max_position_embeddings=64)
    kw.update(overrides)
    config = transformers.NemotronHConfig(hybrid_override_pattern=pattern, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = perturbed(transformers.NemotronHForCausalLM(config))
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.add_(0.3 * torch.randn_like(buf))
    return hf


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    pattern, overrides, batch, length = CASES[name]
    hf = make_hf(pattern, **overrides)
    model = from_hf(hf)
    assert model.cfg.pattern == pattern == hf.config.hybrid_override_pattern
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


@pytest.mark.parametrize("name", ["M*-E", "ME*M-"])
def test_left_padding_equals_prompt_alone(name):
    pattern, overrides, _, _ = CASES[name]
    hf = make_hf(pattern, **overrides)
    check_padding(hf, from_hf(hf))


def test_config_mapping_and_weights():
    pattern, overrides, _, _ = CASES["ME*M-"]
    hf = make_hf(pattern, **overrides)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_types == ("mamba", "moe", "attention", "mamba", "mlp") and cfg.pattern == "ME*M-"
    assert (cfg.n_group, cfg.topk_group, cfg.top_k, cfg.routed_scaling) == (2, 1, 3, 2.5)
    legacy = {k: v for k, v in hf.config.to_dict().items() if k not in ("layers_block_type", "layer_types")}
    assert config_from_hf({**legacy, "hybrid_override_pattern": "M-*E"}).layer_types == ("mamba", "mlp", "attention", "moe")
    model = from_hf(hf)
    assert set(key_map(cfg)) == set(dict(model.named_parameters()))
    assert [type(getattr(b, b.kind)).__name__ for b in model.blocks] == ["Mamba2Mixer", "MoE", "Attention",
                                                                        "Mamba2Mixer", "MLP"]
    with pytest.raises(ValueError, match="unknown symbols"):
        NemotronHConfig.layer_types_of("M*X")
    with pytest.raises(ValueError, match="moe_latent_size"):
        config_from_hf({**hf.config.to_dict(), "moe_latent_size": 8})


@pytest.mark.parametrize("name,layer,expert", [("M*-E", 3, 2), ("ME*M-", 1, 0)])
def test_expert_ablation_equals_hf_with_its_down_proj_zeroed(name, layer, expert):
    pattern, overrides, _, _ = CASES[name]
    hf = make_hf(pattern, **overrides)
    model = from_hf(hf)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    site, seen = f"blocks.{layer}.mlp", {}
    hooks = [(f"{site}.hook_chosen", lambda c, hook: seen.update(c=c)),
             (f"{site}.hook_routing_weights", lambda w, hook: w.masked_fill(seen["c"] == expert, 0.0))]
    with torch.no_grad():
        ours = model.run_with_hooks(tokens, fwd_hooks=hooks)
        assert (seen["c"] == expert).any()
        hf.model.layers[layer].mixer.experts.down_proj[expert].zero_()
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_ssm_invariants_float64_and_knockout():
    from analysis.interventions.knockout import knockout

    pattern, overrides, _, _ = CASES["ME*M-"]
    model = from_hf(make_hf(pattern, **overrides).double())
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(4))
    check_ssm_invariants(model, tokens, "blocks.3.mixer")
    check_knockout_equals_kernel_zeroing(model, tokens, 0, sources=[1, 2], targets=[4, 12], knockout=knockout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ME*M-", "len_ragged_long"])
def test_parity_gpu_float32(name):
    pattern, overrides, batch, length = CASES[name]
    hf = make_hf(pattern, **overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, length), device="cuda")
    check_against_hf(hf, model, tokens)
