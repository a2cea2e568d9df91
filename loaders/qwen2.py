"""Qwen2 / Qwen2.5 checkpoints (HF `Qwen2ForCausalLM`, model_type "qwen2") -> `hooked.models.qwen2.Qwen2`.

Glossary
    layer_types   read as HF writes it after its own __post_init__ (`to_dict()` of a loaded config);
                  a raw config.json without it gets HF's rule: with use_sliding_window, layers
                  l >= max_window_layers slide, all others (and all, without it) are full
    biases        q_proj, k_proj, v_proj have `.bias`; o_proj has none

Tensor names and layout are Llama's (loaders/llama.py), plus the three biases.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hooked.models.llama import build
from hooked.models.qwen2 import Qwen2Config
from loaders import llama
from loaders.registry import Architecture, Key, register


def windows_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """{sliding_window, layer_types} as HF's Qwen2/Qwen3 configs resolve them."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first_sliding = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and l >= first_sliding else "full_attention"
                 for l in range(hf["num_hidden_layers"])]
    return dict(sliding_window=window, layer_types=tuple(types))


def config_from_hf(hf: dict[str, Any]) -> Qwen2Config:
    base = asdict(llama.config_from_hf(hf))
    base["attention_bias"] = False  # Qwen2's biases are q, k, v only (qkv_bias)
    return Qwen2Config(**base, qkv_bias=True, **windows_from_hf(hf))


def key_map(cfg: Qwen2Config) -> dict[str, Key]:
    keys = llama.key_map(cfg)
    for l in range(cfg.n_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            keys[f"blocks.{l}.attn.{proj}.bias"] = Key.of(f"model.layers.{l}.self_attn.{proj}.bias",
                                                          f"layers.{l}.self_attn.{proj}.bias")
    return keys


ARCHITECTURE = register(Architecture(
    name="qwen2",
    hf_classes=("Qwen2ForCausalLM", "Qwen2Model"),
    model_types=("qwen2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
))
