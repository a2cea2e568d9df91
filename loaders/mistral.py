"""Mistral checkpoints (HF `MistralForCausalLM`, model_type "mistral") -> `hooked.models.mistral.Mistral`.

The tensors are Llama's (same names, same layout): the key map is loaders/llama.py's. The config
adds `sliding_window` (None in Mistral v0.2+ configs: full attention). A Mistral config with
`layer_types` (alternating windows) is HF's Ministral, which this loader refuses.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hooked.models.llama import build
from hooked.models.mistral import MistralConfig
from loaders import llama
from loaders.registry import Architecture, register


def config_from_hf(hf: dict[str, Any]) -> MistralConfig:
    types = set(hf.get("layer_types") or ())
    if len(types) > 1:
        raise NotImplementedError(f"a Mistral config with mixed layer_types {sorted(types)} is Ministral's; "
                                  "not supported")
    return MistralConfig(**asdict(llama.config_from_hf(hf)), sliding_window=hf.get("sliding_window"))


ARCHITECTURE = register(Architecture(
    name="mistral",
    hf_classes=("MistralForCausalLM", "MistralModel"),
    model_types=("mistral",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=llama.key_map,
))
