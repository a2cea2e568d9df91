"""OlmoHybridForCausalLM checkpoints (model_type "olmo_hybrid") -> hooked.models.olmo_hybrid.

Glossary of HF config fields (OlmoHybridConfig) and ours: hooked/models/olmo_hybrid.py's glossary;
rope_parameters["rope_theta"] None -> rope_theta None (NoPE).

Key layout (HF 5.x in memory): `model.layers.{l}.{input_layernorm,post_attention_layernorm}` and
`linear_attn.{q,k,v,g,a,b,o}_proj`, `linear_attn.{conv1d,A_log,dt_bias,o_norm}` (delta layers);
`post_attention_layernorm`, `post_feedforward_layernorm`, `self_attn.{q,k,v,o}_proj`,
`self_attn.{q,k}_norm` (attention layers); `mlp.{gate,up,down}_proj`. On disk (and as save_pretrained
writes it) the conv is three tensors `{q,k,v}_conv1d.weight` (read back as one: their concatenation,
whatever the split) and the first two layer norms are `attention_layer_norm` / `feedforward_layer_norm`
on every layer: both spellings are accepted.
"""

from __future__ import annotations

from typing import Any

from hooked.models.olmo_hybrid import OlmoHybridConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import concat_view
from loaders.keymaps import attention_keys, delta_mixer_keys, gated_mlp_keys, lm_head_keys, qk_norm_keys, rope_from_hf

LAYER_TYPES = {"linear_attention": "delta", "full_attention": "attention"}


def config_from_hf(hf: dict[str, Any]) -> OlmoHybridConfig:
    n_layers, n_heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    kinds = hf.get("layer_types") or ["full_attention" if l % 4 == 3 else "linear_attention" for l in range(n_layers)]
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    params = hf.get("rope_parameters") or {}
    nope = params.get("rope_theta", hf.get("rope_theta", 10000.0)) is None
    theta, scaling = (None, None) if nope else rope_from_hf(hf)
    n_k_heads = int(hf.get("linear_num_key_heads") or n_heads)
    d_k = int(hf.get("linear_key_head_dim") or int(0.75 * int(hf["hidden_size"]) / n_k_heads))
    return OlmoHybridConfig(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_heads=int(hf.get("linear_num_value_heads") or n_heads), n_k_heads=n_k_heads, d_k=d_k,
        d_v=int(hf.get("linear_value_head_dim") or 2 * d_k), d_mlp=int(hf["intermediate_size"]),
        d_conv=int(hf.get("linear_conv_kernel_dim", 4)), neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)),
        n_attn_heads=n_heads, n_attn_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_attn_head=int(hf["hidden_size"]) // n_heads, rope_theta=theta, rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", False)), act_fn=hf.get("hidden_act", "silu"),
        eps=float(hf.get("rms_norm_eps", 1e-6)), tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 65536),
    )


def key_map(cfg: OlmoHybridConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"), "ln_final.weight": Key.of("model.norm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        first = Key.of(theirs + "post_attention_layernorm.weight", theirs + "feedforward_layer_norm.weight")
        if kind == "delta":
            keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight", theirs + "attention_layer_norm.weight")
            keys[ours + "ln2.weight"] = first
            names = {f"{p}_proj.weight": f"{p}_proj.weight" for p in "qkvgab"}
            names |= {"A_log": "A_log", "dt_bias": "dt_bias", "norm.weight": "o_norm.weight",
                      "out_proj.weight": "o_proj.weight"}
            keys |= delta_mixer_keys(ours + "mixer.", theirs + "linear_attn.", names)
        else:
            keys[ours + "ln1_post.weight"] = first
            keys[ours + "ln2_post.weight"] = Key.of(theirs + "post_feedforward_layernorm.weight")
            keys |= attention_keys(ours + "attn.", theirs + "self_attn.", cfg.attention_bias, cfg.attention_bias)
            keys |= qk_norm_keys(ours + "attn.", theirs + "self_attn.")
        keys |= gated_mlp_keys(ours + "mlp.", theirs + "mlp.", False)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="olmo_hybrid",
    hf_classes=("OlmoHybridForCausalLM",),
    model_types=("olmo_hybrid",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=concat_view(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), "conv1d.weight"),
)
