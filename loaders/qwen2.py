"""Qwen2 / Qwen2.5 checkpoints (HF `Qwen2ForCausalLM`, model_type "qwen2") -> `hooked.models.qwen2.Qwen2`.

Glossary
    layer_types   read as HF writes it after its own __post_init__, else HF's rule (keymaps.sliding_windows)
    biases        q_proj, k_proj, v_proj have `.bias`; o_proj has none

Tensor names and layout are Llama's (keymaps.decoder_keys), plus the three biases.
"""

from __future__ import annotations

from typing import Any

from hooked.models.llama import build
from hooked.models.qwen2 import Qwen2Config
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields, sliding_windows


def config_from_hf(hf: dict[str, Any]) -> Qwen2Config:
    # Qwen2's biases are q, k, v only (qkv_bias), whatever attention_bias says
    return Qwen2Config(**(llama_fields(hf) | {"attention_bias": False}), qkv_bias=True, **sliding_windows(hf))


def key_map(cfg: Qwen2Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.qkv_bias or cfg.attention_bias,
                        o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="qwen2",
    hf_classes=("Qwen2ForCausalLM", "Qwen2Model"),
    model_types=("qwen2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
