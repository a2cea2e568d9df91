"""FalconH1ForCausalLM checkpoints (model_type "falcon_h1") -> hooked.models.falcon_h1 (build).

Glossary of HF config fields (FalconH1Config) and ours: Bamba's Mamba-2 fields (loaders/bamba.py) with
mamba_d_ssm -> d_inner (when set), projectors_bias -> out_bias, mamba_rms_norm -> ssm_norm,
mamba_norm_before_gate -> norm_before_gate, head_dim -> d_attn_head; every muP multiplier by its HF
name (mlp_multipliers -> mlp_gate_multiplier, mlp_down_multiplier; ssm_multipliers kept as 5 scales).

Key layout: `model.layers.{l}.{input_layernorm,pre_ff_layernorm}.weight`, `mamba.*` (conv1d weight
squeezed; `mamba.norm.weight` only with mamba_rms_norm), `self_attn.{q,k,v,o}_proj.*`,
`feed_forward.{gate,up,down}_proj.*`, `model.final_layernorm.weight`, `lm_head.weight`.
The mup vector is a non-persistent HF buffer, recomputed from ssm_multipliers.
"""

from __future__ import annotations

from typing import Any

from hooked.models.falcon_h1 import FalconH1Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import (attention_fields, attention_keys, gated_mlp_keys, lm_head_keys, mamba2_fields, mamba2_keys,
                             rope_fields)


def config_from_hf(hf: dict[str, Any]) -> FalconH1Config:
    d_model = int(hf["hidden_size"])
    rope = rope_fields(hf)
    if rope.pop("partial_rotary_factor") != 1.0:
        raise ValueError("Falcon-H1 with partial rotary is not supported")
    gate_m, down_m = hf.get("mlp_multipliers") or (1.0, 1.0)
    return FalconH1Config(
        n_layers=int(hf["num_hidden_layers"]), d_model=d_model, d_vocab=int(hf["vocab_size"]),
        d_mlp=int(hf["intermediate_size"]),
        **mamba2_fields(hf, d_inner=int(hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * d_model)),
        out_bias=bool(hf.get("projectors_bias", False)),
        ssm_norm=bool(hf.get("mamba_rms_norm", False)), norm_before_gate=bool(hf.get("mamba_norm_before_gate", True)),
        **attention_fields(hf), **rope,
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        act_fn=hf.get("hidden_act", "silu"),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        lm_head_multiplier=float(hf.get("lm_head_multiplier", 1.0)),
        attention_in_multiplier=float(hf.get("attention_in_multiplier", 1.0)),
        attention_out_multiplier=float(hf.get("attention_out_multiplier", 1.0)),
        key_multiplier=float(hf.get("key_multiplier", 1.0)),
        ssm_in_multiplier=float(hf.get("ssm_in_multiplier", 1.0)),
        ssm_multipliers=tuple(hf.get("ssm_multipliers") or (1.0,) * 5),
        ssm_out_multiplier=float(hf.get("ssm_out_multiplier", 1.0)),
        mlp_gate_multiplier=float(gate_m), mlp_down_multiplier=float(down_m),
        eps=float(hf.get("rms_norm_eps", 1e-5)), tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 8192),
    )


def key_map(cfg: FalconH1Config) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "pre_ff_layernorm.weight")
        keys |= attention_keys(ours + "attn.", theirs + "self_attn.", cfg.attention_bias, cfg.attention_bias)
        keys |= mamba2_keys(ours + "mixer.", theirs + "mamba.", cfg.conv_bias, cfg.proj_bias, cfg.out_bias,
                            norm=cfg.ssm_norm)
        keys |= gated_mlp_keys(ours + "mlp.", theirs + "feed_forward.", cfg.mlp_bias)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="falcon_h1",
    hf_classes=("FalconH1ForCausalLM",),
    model_types=("falcon_h1",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
