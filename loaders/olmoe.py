"""OLMoE checkpoints (HF `OlmoeForCausalLM`, model_type "olmoe") -> hooked.models.olmoe (build).

Glossary of HF config fields and ours: llama.py's, plus num_experts -> n_experts, num_experts_per_tok ->
top_k, norm_topk_prob -> renormalise, intermediate_size -> d_mlp (an expert's width). clip_qkv must be
None (every release): a value is refused.

Key layout: Llama's attention and norms plus `self_attn.{q_norm,k_norm}.weight` over the whole projection
([n_heads * d_head], [n_kv_heads * d_head]); per layer `mlp.gate.weight` (the router) and
`mlp.experts.{gate_up_proj, down_proj}`. Checkpoints on disk keep one tensor per expert: `adapt` stacks them.
"""

from __future__ import annotations

from typing import Any

from hooked.models.olmoe import OlmoeConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import LLAMA_NORMS, PER_EXPERT_STACKS, decoder_keys, llama_fields, stacked_experts_keys


def config_from_hf(hf: dict[str, Any]) -> OlmoeConfig:
    if hf.get("clip_qkv") is not None:
        raise NotImplementedError(f"OLMoE with clip_qkv={hf['clip_qkv']} (q, k, v clamped) is not supported; "
                                  "the released checkpoints have clip_qkv=None")
    return OlmoeConfig(**{**llama_fields(hf), "eps": hf.get("rms_norm_eps", 1e-5)},
                       n_experts=int(hf.get("num_experts", 64)), top_k=int(hf.get("num_experts_per_tok", 8)),
                       renormalise=bool(hf.get("norm_topk_prob", False)))


def key_map(cfg: OlmoeConfig) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, qk_norm=True, tied=cfg.tied)
    keys = {ours: key for ours, key in keys.items() if ".mlp." not in ours}  # the MoE replaces the dense MLP
    for l in range(cfg.n_layers):
        moe = {f"blocks.{l}.mlp.router.weight": Key.of(f"layers.{l}.mlp.gate.weight")}
        moe |= stacked_experts_keys(f"blocks.{l}.mlp.", f"layers.{l}.mlp.experts.")
        keys |= {ours: Key(tuple(p + n for n in key.names for p in ("model.", "")), key.transform)
                 for ours, key in moe.items()}
    return keys


ARCHITECTURE = Architecture(
    name="olmoe",
    hf_classes=("OlmoeForCausalLM", "OlmoeModel"),
    model_types=("olmoe",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(stacks=PER_EXPERT_STACKS),
)
