"""RecurrentGemmaForCausalLM checkpoints (model_type "recurrent_gemma") -> hooked.models.recurrent_gemma.

Glossary of HF config fields and ours: hooked/models/recurrent_gemma.py's glossary.

Key layout (as on disk): `model.embed_tokens`, `model.layers.{l}.{temporal_pre_norm,channel_pre_norm}`,
`temporal_block.{linear_x,linear_y,linear_out,conv_1d}` and `temporal_block.rg_lru.{recurrent_param,
input_gate_weight,input_gate_bias,recurrent_gate_weight,recurrent_gate_bias}` (recurrent layers; conv_1d.weight
[w 1 d_conv] squeezed), `temporal_block.{q,k,v,o}_proj` (attention layers), `mlp_block.{gate,up,down}_proj`
(weights and biases), `model.final_norm`, `lm_head` (absent when tied).
"""

from __future__ import annotations

from typing import Any

from hooked.models.recurrent_gemma import RecurrentGemmaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import lm_head_keys, rope_fields, squeeze_conv

HF_LAYER_TYPES = {"recurrent": "recurrent", "attention": "attention"}


def config_from_hf(hf: dict[str, Any]) -> RecurrentGemmaConfig:
    n_layers, n_heads, d_model = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]), int(hf["hidden_size"])
    block_types = list(hf.get("block_types") or ("recurrent", "recurrent", "attention"))
    unknown = sorted(set(block_types) - set(HF_LAYER_TYPES))
    if unknown:
        raise ValueError(f"RecurrentGemma block types {unknown} are not supported (known: {', '.join(HF_LAYER_TYPES)})")
    rope = rope_fields(hf, default_partial=0.5)
    if rope["rope_scaling"] is not None:
        raise ValueError(f"RecurrentGemma supports the default rotary embedding only (as HF), got {rope['rope_scaling']}")
    return RecurrentGemmaConfig(
        d_model=d_model, d_vocab=int(hf["vocab_size"]),
        layer_types=tuple(HF_LAYER_TYPES[k] for k in (block_types * n_layers)[:n_layers]),
        n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), d_head=d_model // n_heads,
        d_mlp=int(hf["intermediate_size"]) // 2, lru_width=int(hf.get("lru_width") or d_model),
        d_conv=int(hf.get("conv1d_width", 4)), window=int(hf.get("attention_window_size", 2048)),
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        attention_bias=bool(hf.get("attention_bias", False)), final_softcap=float(hf.get("logits_soft_cap", 30.0)),
        eps=float(hf.get("rms_norm_eps", 1e-6)), act_fn=str(hf.get("hidden_activation", "gelu_pytorch_tanh")),
        tied=bool(hf.get("tie_word_embeddings", True)),
    )


def key_map(cfg: RecurrentGemmaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"), "ln_final.weight": Key.of("model.final_norm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        block = theirs + "temporal_block."
        keys[ours + "ln1.weight"] = Key.of(theirs + "temporal_pre_norm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "channel_pre_norm.weight")
        if kind == "attention":
            for p in ("q", "k", "v", "o"):
                params = ("weight", "bias") if p == "o" or cfg.attention_bias else ("weight",)
                keys |= {f"{ours}attn.{p}_proj.{w}": Key.of(f"{block}{p}_proj.{w}") for w in params}
        else:
            mixer = ours + "mixer."
            for mine, hf_name in (("linear_x", "linear_x"), ("linear_y", "linear_y"), ("out_proj", "linear_out")):
                keys |= {f"{mixer}{mine}.{w}": Key.of(f"{block}{hf_name}.{w}") for w in ("weight", "bias")}
            keys[mixer + "conv_weight"] = Key.of(block + "conv_1d.weight", transform=squeeze_conv)
            keys[mixer + "conv_bias"] = Key.of(block + "conv_1d.bias")
            for p in ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                      "recurrent_gate_bias"):
                keys[mixer + p] = Key.of(f"{block}rg_lru.{p}")
        keys |= {f"{ours}mlp.{m}_proj.{w}": Key.of(f"{theirs}mlp_block.{m}_proj.{w}")
                 for m in ("gate", "up", "down") for w in ("weight", "bias")}
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="recurrent_gemma",
    hf_classes=("RecurrentGemmaForCausalLM",),
    model_types=("recurrent_gemma",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
