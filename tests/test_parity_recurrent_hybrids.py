"""Parity with HF transformers of issue 41's families built on mixers we have (LFM2-MoE, Bailing-hybrid).

One table: family -> (HF model class, tiny config, released-size config). For each: logits, the
embedding and every resid_post within 1e-4 of HF's max magnitude in float32 (tests/hybrid_checks.py),
float64 closer (`F64` says how close HF allows), left padding == each prompt alone (HF and ours),
decoding with a DecodeState == recomputing the whole sequence == HF, save_pretrained -> from_pretrained
== from_hf bit for bit, and the released-size config built on meta with HF's shape for every tensor.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hybrid_checks import (check_against_hf, check_decoding, check_padding, check_released_on_meta,
                           check_save_pretrained, perturbed)

from loaders.load import from_hf

V = 64
_T = transformers
FAMILIES = {
    "lfm2_moe": (_T.Lfm2MoeForCausalLM, lambda: _T.Lfm2MoeConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        layer_types=["conv", "full_attention", "conv", "conv"], routed_scaling_factor=1.5)),
    "bailing_hybrid": (_T.BailingHybridForCausalLM, lambda: _T.BailingHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, kv_lora_rank=16, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, layer_group_size=2, routed_scaling_factor=1.5, pad_token_id=0, eos_token_id=1)),
}
VARIANTS = {  # family -> {variant: config changes}
    "lfm2_moe": {"expert_bias": {}, "no_expert_bias_no_renorm": dict(use_expert_bias=False, norm_topk_prob=False)},
    "bailing_hybrid": {"safe_gate": {}, "softplus_gate_q_lora": dict(kda_safe_gate=False, q_lora_rank=12)},
}
CASES = [(f, v) for f in FAMILIES for v in VARIANTS[f]]
F64 = {  # how close a float64 model of HF's comes: 1e-10 where HF computes in float64 throughout
    "lfm2_moe": 1e-5,  # HF's RMSNorm casts to float32 in a float64 model (and renormalises by sum + 1e-6)
    "bailing_hybrid": 1e-5,  # HF's RMSNorms and its KDA output norm compute in float32 in a float64 model
}
RELEASED = {  # HF config.json fields of a released checkpoint
    "lfm2_moe": dict(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], vocab_size=65536, hidden_size=2048,
                     intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=24,
                     num_attention_heads=32, num_key_value_heads=8, num_dense_layers=2, num_experts=32,
                     num_experts_per_tok=4, norm_topk_prob=True, use_expert_bias=True, conv_L_cache=3,
                     layer_types=["full_attention" if l in (2, 6, 10, 14, 18, 21) else "conv" for l in range(24)]),
    "bailing_hybrid": dict(model_type="bailing_hybrid", architectures=["BailingHybridForCausalLM"]),  # HF's defaults
}


def make_hf(family: str, variant: str, dtype: torch.dtype = torch.float32):
    cls, config = FAMILIES[family][0], FAMILIES[family][1]()
    for k, v in VARIANTS[family][variant].items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # HF's grouped_mm path refuses float64
    torch.manual_seed(0)
    hf = perturbed(cls(config), scale=0.2)
    with torch.no_grad():  # buffers HF does not perturb (the MoE choice biases) get values too
        for name, b in hf.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.normal_()
    return hf.to(dtype)


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, variant", CASES)
def test_float32_logits_resid_and_padding_equal_hf(family, variant):
    hf = make_hf(family, variant)
    model = from_hf(hf)
    check_against_hf(hf, model, tokens())
    check_padding(hf, model)


@pytest.mark.parametrize("family, variant", CASES)
def test_float64_logits_and_resid_equal_hf(family, variant):
    hf = make_hf(family, variant, torch.float64)
    model, toks, rel = from_hf(hf), tokens(), F64.get(family, 1e-10)
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
    ours = [cache[f"blocks.{l}.hook_resid_post"] for l in range(model.cfg.n_layers - 1)] + [logits]
    for what, a, b in zip([f"resid_post {l}" for l in range(model.cfg.n_layers - 1)] + ["logits"], ours,
                          list(out.hidden_states[1:-1]) + [out.logits]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=rel * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("family, variant", CASES)
def test_decoding_with_the_state_equals_recomputing_and_hf(family, variant):
    hf = make_hf(family, variant)
    check_decoding(hf, from_hf(hf), tokens(pos=11), padded_then_step=False)


@pytest.mark.parametrize("family, variant", CASES)
def test_save_pretrained_loads_like_the_model_in_memory(family, variant, tmp_path):
    check_save_pretrained(make_hf(family, variant), tokens(), tmp_path)


@pytest.mark.parametrize("family", list(RELEASED))
def test_released_config_builds_hf_shapes_on_meta(family):
    # HF's stored buffers (expert_bias) are parameters here
    check_released_on_meta(RELEASED[family], family, FAMILIES[family][0], read="raw", stored_buffers=True)
