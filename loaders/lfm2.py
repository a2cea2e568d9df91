"""Lfm2ForCausalLM checkpoints (model_type "lfm2") -> hooked.models.lfm2.

Glossary of HF config fields (Lfm2Config) and ours: hooked/models/lfm2.py's glossary.

Key layout (as on disk): `model.embed_tokens`, `model.layers.{l}.{operator_norm,ffn_norm}`,
`conv.{in_proj,conv,out_proj}` (conv layers; conv.weight [d 1 L] squeezed), `self_attn.{q,k,v,out}_proj`
and `self_attn.{q,k}_layernorm` (attention layers), `feed_forward.{w1,w3,w2}` (gate, up, down),
`model.embedding_norm` (the final norm), `lm_head` (absent when tied).
"""

from __future__ import annotations

from typing import Any

from hooked.models.lfm2 import Lfm2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import lfm2_feed_forward_keys, lfm2_operator_keys, lm_head_keys, rope_from_hf

LAYER_TYPES = {"conv": "conv", "full_attention": "attention"}


def mlp_width(hf: dict[str, Any]) -> int:
    """HF's Lfm2MLP width: intermediate_size, or (block_auto_adjust_ff_dim) 2/3 of it, times the multiplier,
    rounded up to block_multiple_of."""
    width = int(hf["intermediate_size"])
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier, multiple = hf.get("block_ffn_dim_multiplier", 1.0), int(hf.get("block_multiple_of", 256))
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def config_from_hf(hf: dict[str, Any]) -> Lfm2Config:
    n_layers, n_heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    kinds = hf.get("layer_types")
    if kinds is None:
        full = hf.get("full_attn_idxs")
        kinds = ["full_attention" if full is None or l in full else "conv" for l in range(n_layers)]
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"LFM2 layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    theta, scaling = rope_from_hf(hf)
    return Lfm2Config(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_head=int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads), d_mlp=mlp_width(hf),
        d_conv=int(hf.get("conv_L_cache", 3)), conv_bias=bool(hf.get("conv_bias", False)), rope_theta=theta,
        rope_scaling=scaling, eps=float(hf.get("norm_eps", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
        n_ctx=int(hf.get("max_position_embeddings") or 128000),
    )


def key_map(cfg: Lfm2Config) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"), "ln_final.weight": Key.of("model.embedding_norm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        keys |= lfm2_operator_keys(cfg, layer, kind) | lfm2_feed_forward_keys(layer)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="lfm2",
    hf_classes=("Lfm2ForCausalLM",),
    model_types=("lfm2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
