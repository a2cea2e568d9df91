"""Gemma 3 text checkpoints (HF `Gemma3ForCausalLM`, model_type "gemma3_text") -> `hooked.models.gemma3.Gemma3`.

Glossary
    rope       HF >= 5 writes `rope_parameters` per layer kind ({"full_attention": {...},
               "sliding_attention": {...}}); older configs write rope_theta (global),
               rope_local_base_freq (local) and rope_scaling (global only): both are read
    layer_types  read from the config; without it HF's rule with `sliding_window_pattern` (default
               6): layer l is global when l + 1 is a multiple of the pattern

Soft-caps: `final_logit_softcapping` is applied as in Gemma 2; `attn_logit_softcapping` is not,
because HF's Gemma 3 attention ignores it (transformers 5.24; every released Gemma 3 sets it to None).

Tensor names are Gemma 2's (loaders/gemma2.py) plus `self_attn.q_norm.weight`, `self_attn.k_norm.weight`
[head_dim]. The multimodal `Gemma3ForConditionalGeneration` checkpoints (language_model.* names,
a vision tower) are not read here.
"""

from __future__ import annotations

from typing import Any

from hooked.models.gemma3 import Gemma3, Gemma3Config
from loaders import gemma2
from loaders.llama import rope_from_hf
from loaders.registry import Architecture, Key, register


def ropes_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta/rope_scaling (global layers) and rope_local_theta/rope_local_scaling (local layers)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = rope_from_hf({"rope_parameters": params.get("full_attention") or {"rope_theta": 1e6}})
        local, local_scaling = rope_from_hf({"rope_parameters": params.get("sliding_attention") or {"rope_theta": 1e4}})
    else:
        theta, scaling = rope_from_hf({"rope_theta": hf.get("rope_theta", 1e6), "rope_scaling": hf.get("rope_scaling")})
        local, local_scaling = float(hf.get("rope_local_base_freq", 1e4)), None
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local, rope_local_scaling=local_scaling)


def config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    return Gemma3Config(**gemma2.shared_fields(hf), **ropes_from_hf(hf),
                        attn_softcap=None,  # HF's Gemma3Attention never reads attn_logit_softcapping
                        final_softcap=hf.get("final_logit_softcapping"),
                        layer_types=gemma2.layer_types_from_hf(hf, period=hf.get("sliding_window_pattern", 6)))


def key_map(cfg: Gemma3Config) -> dict[str, Key]:
    keys = gemma2.key_map(cfg)
    for l in range(cfg.n_layers):
        for norm in ("q_norm", "k_norm"):
            keys[f"blocks.{l}.attn.{norm}.weight"] = Key.of(f"model.layers.{l}.self_attn.{norm}.weight",
                                                            f"layers.{l}.self_attn.{norm}.weight")
    return keys


ARCHITECTURE = register(Architecture(
    name="gemma3",
    hf_classes=("Gemma3ForCausalLM", "Gemma3TextModel"),
    model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    build=Gemma3,
    key_map=key_map,
))
