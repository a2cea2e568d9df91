"""NemotronHForCausalLM checkpoints (model_type "nemotron_h") -> hooked.models.nemotron_h (build).

Glossary of HF config fields (NemotronHConfig) and ours: layers_block_type / layer_types, or the legacy
hybrid_override_pattern string -> layer_types; mamba_num_heads -> n_heads, mamba_head_dim -> d_head,
ssm_state_size -> d_state, n_groups, conv_kernel -> d_conv, chunk_size, (time_step_min, inf) -> dt_limit,
use_conv_bias -> conv_bias, use_bias -> proj_bias, num_attention_heads -> n_attn_heads,
num_key_value_heads -> n_attn_kv_heads, head_dim -> d_attn_head, intermediate_size -> d_mlp,
mlp_hidden_act -> act_fn, mlp_bias, n_routed_experts -> n_experts, num_experts_per_tok -> top_k,
moe_intermediate_size -> d_expert, moe_shared_expert_intermediate_size -> d_shared, n_group, topk_group,
norm_topk_prob -> renormalise, routed_scaling_factor -> routed_scaling, layer_norm_epsilon -> eps.
Refused: moe_latent_size (latent expert projections), mamba_hidden_act other than silu.

Key layout: `model.embeddings.weight`, `model.layers.{l}.norm.weight`, `model.layers.{l}.mixer.*`
(Mamba-2, attention q/k/v/o, MLP up/down, or MoE `gate.weight`, `gate.e_score_correction_bias`,
`experts.up_proj` [E F m], `experts.down_proj` [E m F], `shared_experts.{up,down}_proj.weight`),
`model.norm_f.weight`, `lm_head.weight`. Checkpoints on disk say `backbone.` for `model.` and keep one
tensor per expert (`experts.{i}.{up,down}_proj.weight`): `adapt` presents them stacked.
"""

from __future__ import annotations

import math
from typing import Any

from hooked.models.nemotron_h import NemotronHConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import attention_fields, attention_keys, lm_head_keys, mamba2_keys, mlp_keys, stacked_experts_keys

LAYER_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
               "mlp": "mlp", "moe": "moe"}


def config_from_hf(hf: dict[str, Any]) -> NemotronHConfig:
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None and hf.get("hybrid_override_pattern"):
        kinds = NemotronHConfig.layer_types_of(hf["hybrid_override_pattern"])
    if not kinds:
        raise ValueError("NemotronH config without layers_block_type or hybrid_override_pattern")
    n_layers = hf.get("num_hidden_layers")
    if n_layers is not None and n_layers != len(kinds):
        raise ValueError(f"NemotronH config: num_hidden_layers={n_layers} but the layer pattern has {len(kinds)} "
                         f"entries ({''.join(kinds) if isinstance(kinds, str) else list(kinds)})")
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"NemotronH layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    if hf.get("moe_latent_size") is not None:
        raise ValueError("NemotronH with moe_latent_size (latent expert projections) is not supported")
    if hf.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"NemotronH mamba_hidden_act {hf['mamba_hidden_act']!r} is not supported (silu only)")
    return NemotronHConfig(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_heads=int(hf["mamba_num_heads"]), d_head=int(hf["mamba_head_dim"]), d_state=int(hf.get("ssm_state_size", 128)),
        n_groups=int(hf.get("n_groups", 8)), d_conv=int(hf.get("conv_kernel", 4)), chunk_size=int(hf.get("chunk_size", 128)),
        dt_limit=(float(hf.get("time_step_min", 0.001)), math.inf), conv_bias=bool(hf.get("use_conv_bias", True)),
        proj_bias=bool(hf.get("use_bias", False)), **attention_fields(hf),
        d_mlp=int(hf["intermediate_size"]), mlp_bias=bool(hf.get("mlp_bias", False)),
        act_fn=hf.get("mlp_hidden_act", "relu2"), n_experts=int(hf.get("n_routed_experts", 8)),
        top_k=int(hf.get("num_experts_per_tok", 2)), d_expert=int(hf.get("moe_intermediate_size", 7688)),
        d_shared=int(hf.get("moe_shared_expert_intermediate_size", 7688)), n_group=int(hf.get("n_group", 1)),
        topk_group=int(hf.get("topk_group", 1)), renormalise=bool(hf.get("norm_topk_prob", True)),
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tied=False,  # HF's NemotronHForCausalLM never ties lm_head (_tied_weights_keys = {}), whatever the config says
        n_ctx=int(hf.get("max_position_embeddings") or 4096),
    )


def key_map(cfg: NemotronHConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embeddings.weight"), "ln_final.weight": Key.of("model.norm_f.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "norm.weight")
        if kind == "mamba":
            keys |= mamba2_keys(ours + "mixer.", theirs + "mixer.", cfg.conv_bias, cfg.proj_bias)
        elif kind == "attention":
            keys |= attention_keys(ours + "attn.", theirs + "mixer.", False, False)
        elif kind == "mlp":
            keys |= mlp_keys(ours + "mlp.", theirs + "mixer.", cfg.mlp_bias)
        else:
            keys[ours + "mlp.router.weight"] = Key.of(theirs + "mixer.gate.weight")
            keys[ours + "mlp.select.correction_bias"] = Key.of(theirs + "mixer.gate.e_score_correction_bias")
            keys |= stacked_experts_keys(ours + "mlp.", theirs + "mixer.experts.", gated=False)
            keys |= mlp_keys(ours + "mlp.shared.", theirs + "mixer.shared_experts.", cfg.mlp_bias)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="nemotron_h",
    hf_classes=("NemotronHForCausalLM",),
    model_types=("nemotron_h",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(renames=[(r"^backbone\.", "model.")],  # checkpoints: backbone.*, experts.{i}.*
                      stacks={"up_proj": ("up_proj",), "down_proj": ("down_proj",)}),
)
