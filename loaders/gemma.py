"""Gemma (1) checkpoints (HF `GemmaForCausalLM`, model_type "gemma") -> `hooked.models.gemma`.

Tensor names and layout are Llama's (keymaps.decoder_keys: input_layernorm -> ln1,
post_attention_layernorm -> ln2), norm weights copied as stored (the "1 +" lives in
UnitOffsetRMSNorm). The unembedding is the embedding (tie_word_embeddings, True by default and in
every release). The released config.json says hidden_act "gelu"; HF runs the tanh approximation
(gelu_pytorch_tanh) there, and so do we.
"""

from __future__ import annotations

from typing import Any

from hooked.models.gemma import GemmaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields


def config_from_hf(hf: dict[str, Any]) -> GemmaConfig:
    if hf.get("use_bidirectional_attention"):
        raise NotImplementedError("bidirectional Gemma attention (use_bidirectional_attention) is not supported")
    fields = llama_fields(hf)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    fields |= dict(act_fn="gelu_pytorch_tanh" if act == "gelu" else act, n_ctx=hf.get("max_position_embeddings", 8192),
                   tied=hf.get("tie_word_embeddings", True), mlp_bias=False)
    return GemmaConfig(**fields)


def key_map(cfg: GemmaConfig) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="gemma",
    hf_classes=("GemmaForCausalLM", "GemmaModel"),
    model_types=("gemma",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
