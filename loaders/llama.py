"""Llama checkpoints (HF `LlamaForCausalLM`, model_type "llama") -> `hooked.models.llama.Llama`.

Glossary
    prefix     LlamaForCausalLM names tensors `model.layers.0...`; a bare LlamaModel `layers.0...`:
               both are accepted
    tied       with tie_word_embeddings `lm_head.weight` is `model.embed_tokens.weight`: our
               `unembed.weight` is then not in the key map
    rope       HF >= 5 writes `rope_parameters` (rope_theta inside); older configs write a
               top-level `rope_theta` and an optional `rope_scaling` dict: both are read

Every tensor keeps HF's layout (nn.Linear [out in]); nothing is transformed. Old checkpoints also
hold `*.rotary_emb.inv_freq` (recomputed by HF and by us); loaders/load.py ignores it.
"""

from __future__ import annotations

from typing import Any

from hooked.models.llama import LlamaConfig, build
from loaders.registry import Architecture, Key, register

def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for the default rope) from either config spelling."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:  # the pre-4.45 spelling
        params["rope_type"] = params.pop("type")
    rope_type = params.get("rope_type", "default")
    return float(theta), (None if rope_type == "default" else params)


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    theta, scaling = rope_from_hf(hf)
    n_heads = hf["num_attention_heads"]
    return LlamaConfig(
        n_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 2048),
        eps=hf.get("rms_norm_eps", 1e-6),
        act_fn=hf.get("hidden_act", "silu"),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        tied=hf.get("tie_word_embeddings", False),
    )


def _key(name: str) -> Key:
    return Key.of(f"model.{name}", name)


def key_map(cfg: LlamaConfig) -> dict[str, Key]:
    keys = {"embed.weight": _key("embed_tokens.weight"), "ln_final.weight": _key("norm.weight")}
    params = ["weight", "bias"]
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}", f"layers.{l}"
        keys[f"{ours}.ln1.weight"] = _key(f"{theirs}.input_layernorm.weight")
        keys[f"{ours}.ln2.weight"] = _key(f"{theirs}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for p in params[: 1 + cfg.attention_bias]:
                keys[f"{ours}.attn.{proj}.{p}"] = _key(f"{theirs}.self_attn.{proj}.{p}")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for p in params[: 1 + cfg.mlp_bias]:
                keys[f"{ours}.mlp.{proj}.{p}"] = _key(f"{theirs}.mlp.{proj}.{p}")
    if not cfg.tied:
        keys["unembed.weight"] = Key.of("lm_head.weight")
    return keys


ARCHITECTURE = register(Architecture(
    name="llama",
    hf_classes=("LlamaForCausalLM", "LlamaModel"),
    model_types=("llama",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
))
