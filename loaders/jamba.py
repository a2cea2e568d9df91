"""JambaForCausalLM checkpoints (model_type "jamba") -> hooked.models.jamba (build).

Glossary of HF config fields (JambaConfig) and ours: attn_layer_period / attn_layer_offset -> layer_types,
expert_layer_period / expert_layer_offset -> mlp_types, mamba_expand * hidden_size -> d_inner,
mamba_d_state -> d_state, mamba_d_conv -> d_conv, mamba_dt_rank -> dt_rank, mamba_conv_bias -> conv_bias,
mamba_proj_bias -> proj_bias, num_attention_heads -> n_attn_heads, num_key_value_heads -> n_attn_kv_heads,
num_experts -> n_experts, num_experts_per_tok -> top_k, intermediate_size -> d_mlp, hidden_act -> act_fn,
rms_norm_eps -> eps, tie_word_embeddings -> tied.

Key layout: `model.layers.{l}.{input_layernorm,pre_ff_layernorm}.weight`; Mamba layers
`mamba.{in_proj,x_proj,dt_proj,out_proj}.*`, `mamba.conv1d.*` (weight squeezed), `mamba.A_log`, `mamba.D`,
`mamba.{dt,b,c}_layernorm.weight`; attention `self_attn.{q,k,v,o}_proj.weight`; `feed_forward.
{gate,up,down}_proj.weight` or `feed_forward.router.weight` + `feed_forward.experts.{gate_up_proj,down_proj}` (checkpoints on disk hold
`experts.{i}.{gate,up,down}_proj.weight`: `adapt` stacks them).
"""

from __future__ import annotations

import math
from typing import Any

from hooked.models.jamba import JambaConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import (attention_fields, attention_keys, gated_mlp_keys, lm_head_keys, mamba1_keys,
                             stacked_experts_keys)


def config_from_hf(hf: dict[str, Any]) -> JambaConfig:
    n_layers, d_model = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    a_period, a_offset = int(hf.get("attn_layer_period", 8)), int(hf.get("attn_layer_offset", 4))
    e_period, e_offset = int(hf.get("expert_layer_period", 2)), int(hf.get("expert_layer_offset", 1))
    n_experts = int(hf.get("num_experts", 16))
    dt_rank = hf.get("mamba_dt_rank", "auto")
    return JambaConfig(
        n_layers=n_layers, d_model=d_model, d_vocab=int(hf["vocab_size"]), d_mlp=int(hf["intermediate_size"]),
        layer_types=tuple("attention" if l % a_period == a_offset else "mamba" for l in range(n_layers)),
        mlp_types=tuple("moe" if n_experts > 1 and l % e_period == e_offset else "mlp" for l in range(n_layers)),
        d_inner=int(hf.get("mamba_expand", 2) * d_model), d_state=int(hf.get("mamba_d_state", 16)),
        d_conv=int(hf.get("mamba_d_conv", 4)),
        dt_rank=math.ceil(d_model / 16) if dt_rank in (None, "auto") else int(dt_rank),
        conv_bias=bool(hf.get("mamba_conv_bias", True)), proj_bias=bool(hf.get("mamba_proj_bias", False)),
        **attention_fields(hf, d_attn_head=d_model // int(hf["num_attention_heads"])),
        n_experts=n_experts, top_k=int(hf.get("num_experts_per_tok", 2)),
        act_fn=hf.get("hidden_act", "silu"), eps=float(hf.get("rms_norm_eps", 1e-6)),
        tied=bool(hf.get("tie_word_embeddings", False)), n_ctx=int(hf.get("max_position_embeddings") or 262144),
    )


def key_map(cfg: JambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    for layer, (kind, mlp_kind) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "pre_ff_layernorm.weight")
        if kind == "attention":
            keys |= attention_keys(ours + "attn.", theirs + "self_attn.", False, False)
        else:
            keys |= mamba1_keys(ours + "mixer.", theirs + "mamba.", cfg.conv_bias, cfg.proj_bias)
            keys |= {f"{ours}mixer.{x}_norm_weight": Key.of(f"{theirs}mamba.{hf_x}_layernorm.weight")
                     for x, hf_x in (("dt", "dt"), ("B", "b"), ("C", "c"))}
        if mlp_kind == "moe":
            keys[ours + "mlp.router.weight"] = Key.of(theirs + "feed_forward.router.weight")
            keys |= stacked_experts_keys(ours + "mlp.", theirs + "feed_forward.experts.")
        else:
            keys |= gated_mlp_keys(ours + "mlp.", theirs + "feed_forward.", False)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="jamba",
    hf_classes=("JambaForCausalLM",),
    model_types=("jamba",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(stacks={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
)
