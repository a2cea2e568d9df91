"""Mistral checkpoints (HF `MistralForCausalLM`, model_type "mistral") -> `hooked.models.mistral.Mistral`.

The tensors are Llama's (same names, same layout: keymaps.decoder_keys with Llama's norms). The config
adds `sliding_window` (None in Mistral v0.2+ configs: full attention). A Mistral config with
`layer_types` (alternating windows) is HF's Ministral, which this loader refuses.
"""

from __future__ import annotations

from typing import Any

from hooked.models.llama import build
from hooked.models.mistral import MistralConfig
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields


def config_from_hf(hf: dict[str, Any]) -> MistralConfig:
    types = set(hf.get("layer_types") or ())
    if len(types) > 1:
        raise NotImplementedError(f"a Mistral config with mixed layer_types {sorted(types)} is Ministral's; "
                                  "not supported")
    return MistralConfig(**llama_fields(hf), sliding_window=hf.get("sliding_window"))


def key_map(cfg: MistralConfig) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=cfg.mlp_bias, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="mistral",
    hf_classes=("MistralForCausalLM", "MistralModel"),
    model_types=("mistral",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
