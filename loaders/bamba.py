"""BambaForCausalLM checkpoints (model_type "bamba") -> hooked.models.bamba (build).

Glossary of HF config fields (BambaConfig) and ours (hooked.models.bamba.BambaConfig):
    num_hidden_layers -> n_layers, hidden_size -> d_model, vocab_size -> d_vocab, intermediate_size -> d_mlp,
    attn_layer_indices -> layer_types ("attention" at those indices, "mamba" elsewhere),
    mamba_n_heads -> n_heads, mamba_d_head -> d_head, mamba_expand * hidden_size -> d_inner,
    mamba_d_state -> d_state, mamba_n_groups -> n_groups, mamba_d_conv -> d_conv, mamba_chunk_size -> chunk_size,
    time_step_limit -> dt_limit, mamba_conv_bias -> conv_bias, mamba_proj_bias -> proj_bias,
    num_attention_heads -> n_attn_heads, num_key_value_heads -> n_attn_kv_heads,
    rope_parameters (rope_theta, partial_rotary_factor, rope_type) -> rope_theta, partial_rotary_factor,
    rope_scaling, attention_bias, mlp_bias, hidden_act -> act_fn, rms_norm_eps -> eps,
    tie_word_embeddings -> tied, max_position_embeddings -> n_ctx.

Key layout: `model.layers.{l}.{input_layernorm,pre_ff_layernorm}.weight`, Mamba layers
`model.layers.{l}.mamba.*` (conv1d weight [conv_dim 1 d_conv] squeezed), attention layers
`model.layers.{l}.self_attn.{q,k,v,o}_proj.*`, `model.layers.{l}.feed_forward.{gate,up,down}_proj.*`.
"""

from __future__ import annotations

from typing import Any

from hooked.models.bamba import BambaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import (attention_fields, attention_keys, gated_mlp_keys, lm_head_keys, mamba2_fields, mamba2_keys,
                             rope_fields)


def config_from_hf(hf: dict[str, Any]) -> BambaConfig:
    """Our config from an HF BambaConfig dict; refuses what the model does not implement."""
    n_layers, d_model = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    attn = set(hf.get("attn_layer_indices") or [])
    if attn - set(range(n_layers)):
        raise ValueError(f"attn_layer_indices {sorted(attn)} name layers outside the model's {n_layers}")
    return BambaConfig(
        n_layers=n_layers, d_model=d_model, d_vocab=int(hf["vocab_size"]), d_mlp=int(hf["intermediate_size"]),
        layer_types=tuple("attention" if i in attn else "mamba" for i in range(n_layers)),
        **mamba2_fields(hf, d_inner=int(hf.get("mamba_expand", 2) * d_model)),
        **attention_fields(hf), **rope_fields(hf, default_partial=0.5),
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        act_fn=hf.get("hidden_act", "silu"), eps=float(hf.get("rms_norm_eps", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 262144),
    )


def key_map(cfg: BambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "pre_ff_layernorm.weight")
        if kind == "attention":
            keys |= attention_keys(ours + "attn.", theirs + "self_attn.", cfg.attention_bias, cfg.attention_bias)
        else:
            keys |= mamba2_keys(ours + "mixer.", theirs + "mamba.", cfg.conv_bias, cfg.proj_bias)
        keys |= gated_mlp_keys(ours + "mlp.", theirs + "feed_forward.", cfg.mlp_bias)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="bamba",
    hf_classes=("BambaForCausalLM",),
    model_types=("bamba",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
