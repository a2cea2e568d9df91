"""One tiny random model of every family, loaded through `from_hf` (the path users take).

`tiny(name)` builds (and keeps) the hooked model; `FAMILIES` lists the names. Shared by the tests
that must hold on every family (hook shapes, the block protocol, attribution sums).
"""

from __future__ import annotations

import functools

import torch
import transformers
from delta_oracles import TINY as DELTA
from llamba_reference import LlambaReference, LlambaReferenceConfig

from loaders.load import from_hf

V = 64
_SMALL = dict(vocab_size=V, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
_MAMBA2 = dict(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4)
_GEMMA = dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
_T = transformers
CONFIGS = {
    "gpt2": lambda: (_T.GPT2LMHeadModel, _T.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64)),
    "llama": lambda: (_T.LlamaForCausalLM, _T.LlamaConfig(**_SMALL, intermediate_size=24, num_hidden_layers=2)),
    "mistral": lambda: (_T.MistralForCausalLM, _T.MistralConfig(**_SMALL, intermediate_size=24, num_hidden_layers=2,
                                                                 sliding_window=4)),
    "qwen2": lambda: (_T.Qwen2ForCausalLM, _T.Qwen2Config(**_SMALL, intermediate_size=24, num_hidden_layers=2)),
    "qwen3": lambda: (_T.Qwen3ForCausalLM, _T.Qwen3Config(**_SMALL, intermediate_size=24, num_hidden_layers=2,
                                                           head_dim=8)),
    "gemma2": lambda: (_T.Gemma2ForCausalLM, _T.Gemma2Config(**_SMALL, **_GEMMA, intermediate_size=24,
                                                              num_hidden_layers=3, attn_logit_softcapping=2.0,
                                                              final_logit_softcapping=3.0)),
    "gemma3": lambda: (_T.Gemma3ForCausalLM, _T.Gemma3TextConfig(**_SMALL, **_GEMMA, intermediate_size=24,
                                                                  num_hidden_layers=3)),
    "mamba": lambda: (_T.MambaForCausalLM, _T.MambaConfig(vocab_size=V, hidden_size=16, state_size=4,
                                                           num_hidden_layers=2, expand=2, conv_kernel=4,
                                                           time_step_rank=4)),
    "falcon_mamba": lambda: (_T.FalconMambaForCausalLM, _T.FalconMambaConfig(
        vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4)),
    "mamba2": lambda: (_T.Mamba2ForCausalLM, _T.Mamba2Config(
        vocab_size=V, hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=2, expand=2, chunk_size=4,
        num_hidden_layers=2)),
    "zamba2": lambda: (_T.Zamba2ForCausalLM, _T.Zamba2Config(
        vocab_size=V, hidden_size=16, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
        mamba_d_state=4, mamba_headdim=8, n_mamba_heads=4, mamba_ngroups=2, mamba_expand=2, chunk_size=4,
        num_attention_heads=2, num_key_value_heads=2, attention_head_dim=8, intermediate_size=32,
        num_mem_blocks=1, use_mem_rope=True, pad_token_id=0)),
    "bamba": lambda: (_T.BambaForCausalLM, _T.BambaConfig(**_SMALL, **_MAMBA2, num_hidden_layers=2,
                                                           attn_layer_indices=[1], intermediate_size=24)),
    "granite": lambda: (_T.GraniteMoeHybridForCausalLM, _T.GraniteMoeHybridConfig(
        **_SMALL, **_MAMBA2, layer_types=["mamba", "attention"], num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=12, shared_intermediate_size=20, position_embedding_type="rope",
        residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=2.5)),
    "falcon_h1": lambda: (_T.FalconH1ForCausalLM, _T.FalconH1Config(
        **_SMALL, **_MAMBA2, num_hidden_layers=2, mamba_d_ssm=32, intermediate_size=24,
        ssm_multipliers=[0.5, 1.2, 0.8, 1.5, 0.7], lm_head_multiplier=0.7, embedding_multiplier=1.3,
        attention_out_multiplier=0.8, ssm_out_multiplier=1.2)),
    "nemotron_h": lambda: (_T.NemotronHForCausalLM, _T.NemotronHConfig(
        **_SMALL, hybrid_override_pattern="M*-E", head_dim=4, mamba_num_heads=4, mamba_head_dim=8, n_groups=1,
        ssm_state_size=8, chunk_size=4, intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=12, moe_shared_expert_intermediate_size=10)),
    "jamba": lambda: (_T.JambaForCausalLM, _T.JambaConfig(**_SMALL, num_hidden_layers=2, attn_layer_period=2,
                                                           attn_layer_offset=1, mamba_d_state=8, intermediate_size=24,
                                                           num_experts=4, expert_layer_period=1,
                                                           expert_layer_offset=0)),
    "gpt_neox": lambda: (_T.GPTNeoXForCausalLM, _T.GPTNeoXConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                                                  num_attention_heads=2, intermediate_size=24,
                                                                  rotary_pct=0.5)),
    "gemma": lambda: (_T.GemmaForCausalLM, _T.GemmaConfig(**_SMALL, head_dim=8, intermediate_size=24,
                                                           num_hidden_layers=2)),
    "phi3": lambda: (_T.Phi3ForCausalLM, _T.Phi3Config(**_SMALL, intermediate_size=24, num_hidden_layers=2,
                                                        sliding_window=4, partial_rotary_factor=0.5)),
    "olmo2": lambda: (_T.Olmo2ForCausalLM, _T.Olmo2Config(**_SMALL, intermediate_size=24, num_hidden_layers=2)),
    "olmo3": lambda: (_T.Olmo3ForCausalLM, _T.Olmo3Config(**_SMALL, intermediate_size=24, num_hidden_layers=2,
                                                           sliding_window=4, layer_types=["sliding_attention",
                                                                                          "full_attention"])),
    # issue 42's mixtures of experts (GPT-OSS: sinks, alternating windows, clamped SwiGLU experts with biases)
    "mixtral": lambda: (_T.MixtralForCausalLM, _T.MixtralConfig(**_SMALL, intermediate_size=12, num_hidden_layers=2,
                                                                 num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": lambda: (_T.OlmoeForCausalLM, _T.OlmoeConfig(**_SMALL, intermediate_size=12, num_hidden_layers=2,
                                                           num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": lambda: (_T.Qwen3MoeForCausalLM, _T.Qwen3MoeConfig(
        **_SMALL, head_dim=8, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=2, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    "gpt_oss": lambda: (_T.GptOssForCausalLM, _T.GptOssConfig(**_SMALL, head_dim=8, intermediate_size=12,
                                                               num_hidden_layers=2, num_local_experts=4,
                                                               num_experts_per_tok=2, sliding_window=4)),
}
for _name in DELTA:  # the delta-rule families and LFM2, as tests/delta_oracles.py builds them
    CONFIGS[_name] = lambda _name=_name: (DELTA[_name][1], DELTA[_name][0](**DELTA[_name][2]))
CONFIGS["llamba"] = lambda: (LlambaReference, LlambaReferenceConfig())  # Cartesia's layout, no HF class
CONFIGS["lfm2_moe"] = lambda: (_T.Lfm2MoeForCausalLM, _T.Lfm2MoeConfig(
    vocab_size=V, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
    layer_types=["conv", "full_attention", "conv"]))
CONFIGS["bailing_hybrid"] = lambda: (_T.BailingHybridForCausalLM, _T.BailingHybridConfig(
    vocab_size=V, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    kv_lora_rank=8, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    layer_group_size=2, pad_token_id=0, eos_token_id=1))
CONFIGS["minimax"] = lambda: (_T.MiniMaxForCausalLM, _T.MiniMaxConfig(  # lightning attention, blocks of 4 positions
    **_SMALL, head_dim=8, intermediate_size=12, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
    block_size=4, layer_types=["linear_attention", "full_attention", "linear_attention"]))
CONFIGS["recurrent_gemma"] = lambda: (_T.RecurrentGemmaForCausalLM, _T.RecurrentGemmaConfig(  # RG-LRU + local MQA
    vocab_size=V, hidden_size=16, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
    num_hidden_layers=3, lru_width=24, attention_window_size=4, block_types=["recurrent", "recurrent", "attention"]))
CONFIGS["rwkv"] = lambda: (_T.RwkvForCausalLM, _T.RwkvConfig(  # RWKV-4 time and channel mixing, rescaled every 2
    vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=3, rescale_every=2))  # (HF caches assume att = d_model)
CONFIGS["zamba"] = lambda: (_T.ZambaForCausalLM, _T.ZambaConfig(  # grouped Mamba-1 + one shared attention block
    **_SMALL, intermediate_size=24, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
    n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=4))
CONFIGS["xlstm"] = lambda: (_T.xLSTMForCausalLM, _T.xLSTMConfig(  # mLSTM; widths that are multiples of 64 (HF's cache)
    vocab_size=V, hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=1.0, chunk_size=4, ffn_proj_factor=0.5,
    ffn_round_up_to_multiple_of=8, pad_token_id=0))
CONFIGS["qwen4_exp"] = lambda: (_T.Qwen4ExpForCausalLM, _T.Qwen4ExpTextConfig(  # streams, PLE, QSA top-k blocks
    vocab_size=V, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=12, shared_expert_intermediate_size=10, num_experts=4, num_experts_per_tok=2, hc_count=2,
    hc_lowrank=6, ple_layer_ids=[1], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
    indexer_compress_ratio=2, eos_token_id=1, pad_token_id=0,
    layer_types=["linear_attention", "indexed_attention", "linear_attention"]))
FAMILIES = tuple(CONFIGS)


@functools.cache
def hf_pair(name: str):
    """(HF model, hooked model) of family `name`, float32, eval mode, random weights (seeded)."""
    cls, config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf, from_hf(hf).eval()


def tiny(name: str):
    return hf_pair(name)[1]
