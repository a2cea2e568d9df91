"""GraniteMoeHybridForCausalLM checkpoints (Granite 4 hybrid) -> hooked.models.granitemoehybrid.

Glossary of HF config fields (GraniteMoeHybridConfig) and ours:
    Bamba's fields (loaders/bamba.py) for the Mamba-2 and attention layers, and
    layer_types / layers_block_type ("mamba" / "linear_attention", "attention" / "full_attention") -> layer_types,
    position_embedding_type == "rope" -> use_rope, num_local_experts -> n_experts,
    num_experts_per_tok -> top_k, intermediate_size -> d_mlp, shared_intermediate_size -> d_shared,
    embedding_multiplier, residual_multiplier, attention_multiplier, 1 / logits_scaling -> logit_multiplier.

Key layout (HF 5.x in memory; checkpoints on disk name the experts `block_sparse_moe.input_linear` /
`output_linear` and the router `router.layer`, seen under these names through `adapt`): `model.layers.{l}.{input_layernorm,post_attention_layernorm}.weight`,
`mamba.*` or `self_attn.*`, `shared_mlp.input_linear.weight` [2 d_shared d_model] (gate rows first,
then up: split into our gate_proj / up_proj), `shared_mlp.output_linear.weight`, and with experts
`block_sparse_moe.router.weight`, `block_sparse_moe.experts.gate_up_proj` [E 2F d_model] (split
likewise) and `experts.down_proj` [E d_model F]; `model.norm.weight`, `lm_head.weight`.
"""

from __future__ import annotations

from typing import Any

from hooked.models.granitemoehybrid import GraniteMoeHybridConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import (attention_fields, attention_keys, first_half, lm_head_keys, mamba2_fields, mamba2_keys,
                             rope_fields, second_half, stacked_experts_keys)

LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def config_from_hf(hf: dict[str, Any]) -> GraniteMoeHybridConfig:
    n_layers, d_model = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n_layers
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"Granite 4 layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    pos = hf.get("position_embedding_type")
    if pos not in (None, "rope"):
        raise ValueError(f"position_embedding_type {pos!r} is not supported (None or 'rope')")
    rope = rope_fields(hf)
    if rope.pop("partial_rotary_factor") != 1.0:
        raise ValueError("Granite 4 with partial rotary is not supported")
    return GraniteMoeHybridConfig(
        n_layers=n_layers, d_model=d_model, d_vocab=int(hf["vocab_size"]),
        layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        **mamba2_fields(hf, d_inner=int(hf.get("mamba_expand", 2) * d_model)),
        **attention_fields(hf, d_attn_head=d_model // int(hf["num_attention_heads"])), use_rope=pos == "rope", **rope,
        attention_bias=bool(hf.get("attention_bias", False)),
        n_experts=int(hf.get("num_local_experts") or 0) or None, top_k=int(hf.get("num_experts_per_tok", 2)),
        d_mlp=int(hf["intermediate_size"]), d_shared=int(hf.get("shared_intermediate_size", 1024)),
        act_fn=hf.get("hidden_act", "silu"),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
        logit_multiplier=1.0 / float(hf.get("logits_scaling", 1.0)),
        eps=float(hf.get("rms_norm_eps", 1e-6)), tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 2048),
    )


def key_map(cfg: GraniteMoeHybridConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"), "ln_final.weight": Key.of("model.norm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "post_attention_layernorm.weight")
        if kind == "attention":
            keys |= attention_keys(ours + "attn.", theirs + "self_attn.", cfg.attention_bias, cfg.attention_bias)
        else:
            keys |= mamba2_keys(ours + "mixer.", theirs + "mamba.", cfg.conv_bias, cfg.proj_bias)
        shared = ours + ("mlp.shared." if cfg.n_experts else "mlp.")
        keys[shared + "gate_proj.weight"] = Key.of(theirs + "shared_mlp.input_linear.weight", transform=first_half)
        keys[shared + "up_proj.weight"] = Key.of(theirs + "shared_mlp.input_linear.weight", transform=second_half)
        keys[shared + "down_proj.weight"] = Key.of(theirs + "shared_mlp.output_linear.weight")
        if cfg.n_experts:
            keys[ours + "mlp.router.weight"] = Key.of(theirs + "block_sparse_moe.router.weight")
            keys |= stacked_experts_keys(ours + "mlp.", theirs + "block_sparse_moe.experts.")
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="granitemoehybrid",
    hf_classes=("GraniteMoeHybridForCausalLM",),
    model_types=("granitemoehybrid",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(renames=[  # the original GraniteMoe names (what save_pretrained writes)
        (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
        (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
        (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight")]),
)
