"""BambaForCausalLM checkpoints (model_type "bamba") -> hooked.models.bamba.HookedBamba.

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

import math
from typing import Any

from einops import rearrange

from hooked.models.bamba import BambaConfig, build
from loaders.llama import rope_from_hf
from loaders.registry import Architecture, Key, register


def rope_fields(hf: dict[str, Any], default_partial: float = 1.0) -> dict[str, Any]:
    """rope_theta, rope_scaling and partial_rotary_factor from either config spelling."""
    theta, scaling = rope_from_hf(hf)
    params = dict(hf.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial)))
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)


def dt_limit_from_hf(hf: dict[str, Any], key: str = "time_step_limit") -> tuple[float, float]:
    limit = hf.get(key) or (0.0, math.inf)
    return float(limit[0]), float(limit[1])


def config_from_hf(hf: dict[str, Any]) -> BambaConfig:
    """Our config from an HF BambaConfig dict; refuses what the model does not implement."""
    n_layers, d_model = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    attn = set(hf.get("attn_layer_indices") or [])
    if attn - set(range(n_layers)):
        raise ValueError(f"attn_layer_indices {sorted(attn)} name layers outside the model's {n_layers}")
    n_attn_heads = int(hf["num_attention_heads"])
    d_inner = int(hf.get("mamba_expand", 2) * d_model)
    n_heads = int(hf["mamba_n_heads"])
    d_head = hf.get("mamba_d_head", "auto")
    return BambaConfig(
        n_layers=n_layers, d_model=d_model, d_vocab=int(hf["vocab_size"]), d_mlp=int(hf["intermediate_size"]),
        layer_types=tuple("attention" if i in attn else "mamba" for i in range(n_layers)),
        n_heads=n_heads, d_head=d_inner // n_heads if d_head in (None, "auto") else int(d_head), d_inner=d_inner,
        d_state=int(hf.get("mamba_d_state", 256)), n_groups=int(hf.get("mamba_n_groups", 1)),
        d_conv=int(hf.get("mamba_d_conv", 4)), chunk_size=int(hf.get("mamba_chunk_size", 256)),
        dt_limit=dt_limit_from_hf(hf), conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        n_attn_heads=n_attn_heads, n_attn_kv_heads=int(hf.get("num_key_value_heads") or n_attn_heads),
        d_attn_head=int(hf.get("head_dim") or d_model // n_attn_heads),
        **rope_fields(hf, default_partial=0.5),
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        act_fn=hf.get("hidden_act", "silu"), eps=float(hf.get("rms_norm_eps", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 262144),
    )


def squeeze_conv(w):
    return rearrange(w, "c 1 w -> c w")


def mamba2_keys(ours: str, theirs: str, conv_bias: bool, proj_bias: bool, out_bias: bool | None = None) -> dict[str, Key]:
    """Our Mamba2Mixer's parameters `ours`* from an HF Mamba-2 mixer at `theirs`* (every hybrid family's layout)."""
    out_bias = proj_bias if out_bias is None else out_bias
    names = ["in_proj.weight", "dt_bias", "A_log", "D", "out_proj.weight"]
    names += ["in_proj.bias"] if proj_bias else []
    names += ["out_proj.bias"] if out_bias else []
    keys = {ours + n: Key.of(theirs + n) for n in names}
    keys[ours + "conv_weight"] = Key.of(theirs + "conv1d.weight", transform=squeeze_conv)
    if conv_bias:
        keys[ours + "conv_bias"] = Key.of(theirs + "conv1d.bias")
    return keys


def attention_keys(ours: str, theirs: str, qkv_bias: bool, o_bias: bool) -> dict[str, Key]:
    keys = {f"{ours}{p}_proj.weight": Key.of(f"{theirs}{p}_proj.weight") for p in "qkvo"}
    for p in "qkv" if qkv_bias else "":
        keys[f"{ours}{p}_proj.bias"] = Key.of(f"{theirs}{p}_proj.bias")
    if o_bias:
        keys[f"{ours}o_proj.bias"] = Key.of(f"{theirs}o_proj.bias")
    return keys


def gated_mlp_keys(ours: str, theirs: str, bias: bool) -> dict[str, Key]:
    return {f"{ours}{p}_proj.{w}": Key.of(f"{theirs}{p}_proj.{w}")
            for p in ("gate", "up", "down") for w in ("weight", "bias")[: 1 + bias]}


def key_map(cfg: BambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "pre_ff_layernorm.weight")
        if kind == "attention":
            keys.update(attention_keys(ours + "attn.", theirs + "self_attn.", cfg.attention_bias, cfg.attention_bias))
        else:
            keys.update(mamba2_keys(ours + "mixer.", theirs + "mamba.", cfg.conv_bias, cfg.proj_bias))
            keys[ours + "mixer.norm.weight"] = Key.of(theirs + "mamba.norm.weight")
        keys.update(gated_mlp_keys(ours + "mlp.", theirs + "feed_forward.", cfg.mlp_bias))
    if not cfg.tied:
        keys["unembed.weight"] = Key.of("lm_head.weight")
    return keys


BAMBA = register(
    Architecture(
        name="bamba",
        hf_classes=("BambaForCausalLM",),
        model_types=("bamba",),
        config_from_hf=config_from_hf,
        build=build,
        key_map=key_map,
    )
)
