"""Qwen3 checkpoints (HF `Qwen3ForCausalLM`, model_type "qwen3") -> `hooked.models.qwen3.Qwen3`.

Tensor names and layout are Llama's (keymaps.decoder_keys), plus per layer
`self_attn.q_norm.weight` and `self_attn.k_norm.weight` [head_dim]. Windows are read as for Qwen2.
"""

from __future__ import annotations

from typing import Any

from hooked.models.llama import build
from hooked.models.qwen3 import Qwen3Config
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields, sliding_windows


def config_from_hf(hf: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**llama_fields(hf), qkv_bias=False, **sliding_windows(hf))


def key_map(cfg: Qwen3Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.qkv_bias or cfg.attention_bias,
                        o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, qk_norm=True, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="qwen3",
    hf_classes=("Qwen3ForCausalLM", "Qwen3Model"),
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
