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
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**llama_fields(hf))


def key_map(cfg: LlamaConfig) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=cfg.mlp_bias, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="llama",
    hf_classes=("LlamaForCausalLM", "LlamaModel"),
    model_types=("llama",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
