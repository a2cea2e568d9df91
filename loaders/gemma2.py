"""Gemma 2 checkpoints (HF `Gemma2ForCausalLM`, model_type "gemma2") -> `hooked.models.gemma2.Gemma2`.

Glossary
    norms      HF input_layernorm -> ln1, post_attention_layernorm -> ln1_post (after attention,
               before the residual add), pre_feedforward_layernorm -> ln2, post_feedforward_layernorm
               -> ln2_post; weights copied as stored (the "1 +" lives in UnitOffsetRMSNorm)
    layer_types  read from the config; a config without it gets HF's rule (layer l slides when
               l + 1 is odd, i.e. even layers)

Every tensor keeps HF's layout (nn.Linear [out in]); nothing is transformed.
"""

from __future__ import annotations

from typing import Any

from hooked.models.gemma2 import Gemma2Config, build
from loaders.llama import rope_from_hf
from loaders.registry import Architecture, Key, register

NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
         "ln2_post": "post_feedforward_layernorm"}


def shared_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 fields read the same way (all but rope and the defaults that differ)."""
    if hf.get("use_bidirectional_attention"):
        raise NotImplementedError("bidirectional Gemma attention (use_bidirectional_attention) is not supported")
    n_heads = hf["num_attention_heads"]
    return dict(
        n_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 8192),
        eps=hf.get("rms_norm_eps", 1e-6),
        act_fn=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        attention_bias=hf.get("attention_bias", False),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=hf.get("sliding_window"),
        tied=hf.get("tie_word_embeddings", True),
    )


def layer_types_from_hf(hf: dict[str, Any], period: int) -> tuple[str, ...]:
    """HF's layer_types, or its default: layer l slides unless (l + 1) is a multiple of `period`."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (l + 1) % period else "full_attention" for l in range(hf["num_hidden_layers"])]
    return tuple(types)


def config_from_hf(hf: dict[str, Any]) -> Gemma2Config:
    theta, scaling = rope_from_hf(hf)
    return Gemma2Config(**shared_fields(hf), rope_theta=theta, rope_scaling=scaling,
                        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
                        final_softcap=hf.get("final_logit_softcapping", 30.0),
                        layer_types=layer_types_from_hf(hf, period=2))


def _key(name: str) -> Key:
    return Key.of(f"model.{name}", name)


def key_map(cfg: Gemma2Config) -> dict[str, Key]:
    keys = {"embed.weight": _key("embed_tokens.weight"), "ln_final.weight": _key("norm.weight")}
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}", f"layers.{l}"
        for norm, hf_norm in NORMS.items():
            keys[f"{ours}.{norm}.weight"] = _key(f"{theirs}.{hf_norm}.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for p in ("weight", "bias")[: 1 + cfg.attention_bias]:
                keys[f"{ours}.attn.{proj}.{p}"] = _key(f"{theirs}.self_attn.{proj}.{p}")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys[f"{ours}.mlp.{proj}.weight"] = _key(f"{theirs}.mlp.{proj}.weight")
    if not cfg.tied:
        keys["unembed.weight"] = Key.of("lm_head.weight")
    return keys


ARCHITECTURE = register(Architecture(
    name="gemma2",
    hf_classes=("Gemma2ForCausalLM", "Gemma2Model"),
    model_types=("gemma2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
))
