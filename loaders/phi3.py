"""Phi-3 checkpoints (HF `Phi3ForCausalLM`, model_type "phi3") -> `hooked.models.phi3` (Llama's build).

Glossary
    qkv_proj      fused [n_heads d_head + 2 n_kv_heads d_head, d_model]: rows [q | k | v], split into
                  q_proj, k_proj, v_proj
    gate_up_proj  fused [2 d_mlp, d_model]: rows [gate | up] (HF chunks gate first), split into
                  gate_proj and up_proj
Every other name is Llama's (model.layers.{l}.input_layernorm, post_attention_layernorm,
self_attn.o_proj, mlp.down_proj, model.norm, lm_head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from hooked.models.llama import build
from hooked.models.phi3 import Phi3Config
from loaders.architecture import Architecture, Key
from loaders.keymaps import LLAMA_NORMS, decoder_keys, first_half, llama_fields, rope_fields, second_half


def config_from_hf(hf: dict[str, Any]) -> Phi3Config:
    rope = rope_fields(hf)
    fields = llama_fields(hf) | dict(rope_theta=rope["rope_theta"], rope_scaling=rope["rope_scaling"],
                                     n_ctx=hf.get("max_position_embeddings", 4096), eps=hf.get("rms_norm_eps", 1e-5))
    return Phi3Config(**fields, sliding_window=hf.get("sliding_window"),
                      partial_rotary_factor=rope["partial_rotary_factor"])


def _rows(start: int, stop: int) -> Callable[[Tensor], Tensor]:
    return lambda w: w[start:stop]


def key_map(cfg: Phi3Config) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=False, o_bias=False, mlp_bias=False, tied=cfg.tied)
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    rows = {"q": _rows(0, q), "k": _rows(q, q + kv), "v": _rows(q + kv, q + 2 * kv)}
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}.", f"layers.{l}."
        fused = {f"attn.{p}_proj.weight": ("self_attn.qkv_proj.weight", rows[p]) for p in "qkv"}
        fused |= {"mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", first_half),
                  "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", second_half)}
        for mine, (name, transform) in fused.items():
            keys[ours + mine] = Key.of(f"model.{theirs}{name}", theirs + name, transform=transform)
    return keys


ARCHITECTURE = Architecture(
    name="phi3",
    hf_classes=("Phi3ForCausalLM", "Phi3Model"),
    model_types=("phi3",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
