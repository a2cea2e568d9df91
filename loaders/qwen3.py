"""Qwen3 checkpoints (HF `Qwen3ForCausalLM`, model_type "qwen3") -> `hooked.models.qwen3.Qwen3`.

Tensor names and layout are Llama's (loaders/llama.py), plus per layer
`self_attn.q_norm.weight` and `self_attn.k_norm.weight` [head_dim]. Windows are read as for Qwen2.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hooked.models.llama import build
from hooked.models.qwen3 import Qwen3Config
from loaders import llama
from loaders.qwen2 import windows_from_hf
from loaders.registry import Architecture, Key, register


def config_from_hf(hf: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**asdict(llama.config_from_hf(hf)), qkv_bias=False, **windows_from_hf(hf))


def qk_norm_keys(n_layers: int) -> dict[str, Key]:
    """The per-head q / k RMSNorm weights of every layer (Qwen3, Gemma 3)."""
    return {f"blocks.{l}.attn.{norm}.weight": Key.of(f"model.layers.{l}.self_attn.{norm}.weight",
                                                     f"layers.{l}.self_attn.{norm}.weight")
            for l in range(n_layers) for norm in ("q_norm", "k_norm")}


def key_map(cfg: Qwen3Config) -> dict[str, Key]:
    return llama.key_map(cfg) | qk_norm_keys(cfg.n_layers)


ARCHITECTURE = register(Architecture(
    name="qwen3",
    hf_classes=("Qwen3ForCausalLM", "Qwen3Model"),
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
))
