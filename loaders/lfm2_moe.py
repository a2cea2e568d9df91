"""Lfm2MoeForCausalLM checkpoints (model_type "lfm2_moe") -> hooked.models.lfm2_moe.

Glossary of HF config fields (Lfm2MoeConfig) and ours: hooked/models/lfm2_moe.py's and lfm2.py's glossaries;
intermediate_size is the dense MLPs' width as it is (no LFM2 auto-adjustment).

Key layout (as on disk): loaders/lfm2.py's for the norms, conv and attention layers; dense layers
`feed_forward.{w1,w3,w2}` (gate, up, down); MoE layers `feed_forward.gate.weight` (the router),
`feed_forward.experts.{gate_up_proj, down_proj}` (stacked in memory; on disk per expert `experts.{i}.{w1,w3,w2}`,
stacked by checkpoint_view.expert_view) and `feed_forward.expert_bias` (the choice bias; absent without
use_expert_bias, where it is zero).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from hooked.models.lfm2_moe import Lfm2MoeConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import lfm2_feed_forward_keys, lfm2_operator_keys, lm_head_keys, rope_from_hf, stacked_experts_keys

LAYER_TYPES = {"conv": "conv", "full_attention": "attention"}


def config_from_hf(hf: dict[str, Any]) -> Lfm2MoeConfig:
    kinds, n_heads = hf.get("layer_types"), int(hf["num_attention_heads"])
    if kinds is None:
        raise ValueError("an LFM2-MoE config must list layer_types (HF's model needs them too)")
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"LFM2-MoE layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    theta, scaling = rope_from_hf(hf)
    return Lfm2MoeConfig(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_head=int(hf["hidden_size"]) // n_heads, d_mlp=int(hf["intermediate_size"]),
        d_conv=int(hf.get("conv_L_cache", 3)), conv_bias=bool(hf.get("conv_bias", False)), rope_theta=theta,
        rope_scaling=scaling, eps=float(hf.get("norm_eps", 1e-5)), tied=bool(hf.get("tie_word_embeddings", True)),
        n_ctx=int(hf.get("max_position_embeddings") or 128000),
        n_experts=int(hf["num_experts"]), top_k=int(hf["num_experts_per_tok"]),
        d_expert=int(hf["moe_intermediate_size"]), n_dense=int(hf.get("num_dense_layers", 2)),
        renormalise=bool(hf.get("norm_topk_prob", True)), routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        expert_bias=bool(hf.get("use_expert_bias", True)),
    )


def zero_bias(router: Tensor) -> Tensor:
    """The choice bias of a checkpoint without use_expert_bias: zeros, one per expert (the router's rows)."""
    return router.new_zeros(router.shape[0])


def key_map(cfg: Lfm2MoeConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.embedding_norm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        keys |= lfm2_operator_keys(cfg, layer, kind)
        if layer < cfg.n_dense:
            keys |= lfm2_feed_forward_keys(layer)
            continue
        ours, ff = f"blocks.{layer}.", f"model.layers.{layer}.feed_forward."
        keys[ours + "mlp.router.weight"] = Key.of(ff + "gate.weight")
        keys[ours + "mlp.select.correction_bias"] = (Key.of(ff + "expert_bias") if cfg.expert_bias
                                                     else Key.of(ff + "gate.weight", transform=zero_bias))
        keys |= stacked_experts_keys(ours + "mlp.", ff + "experts.")
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="lfm2_moe",
    hf_classes=("Lfm2MoeForCausalLM",),
    model_types=("lfm2_moe",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(stacks={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),  # on disk: experts.{i}.w1/w3/w2
)
