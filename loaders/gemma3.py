"""Gemma 3 text checkpoints (HF `Gemma3ForCausalLM`, model_type "gemma3_text") -> `hooked.models.gemma3.Gemma3`.

Glossary
    rope       HF >= 5 writes `rope_parameters` per layer kind ({"full_attention": {...},
               "sliding_attention": {...}}); older configs write rope_theta (global),
               rope_local_base_freq (local) and rope_scaling (global only): both are read
    layer_types  read from the config; without it HF's rule with `sliding_window_pattern` (default
               6): layer l is global when l + 1 is a multiple of the pattern

Soft-caps: `final_logit_softcapping` is applied as in Gemma 2; `attn_logit_softcapping` is not,
because HF's Gemma 3 attention ignores it (transformers 5.24; every released Gemma 3 sets it to None).

Tensor names are Gemma 2's plus `self_attn.q_norm.weight`, `self_attn.k_norm.weight`
[head_dim].

Multimodal checkpoints (HF `Gemma3ForConditionalGeneration`, model_type "gemma3": Gemma 3 4B, 12B,
27B) load as their language model: the config is `text_config`, the tensors are the text model's
under `model.language_model.` (transformers >= 5) or `language_model.model.` (the released files),
and the vision tower and projector are left out (listed in `ignore`). Images are not supported.
No soft-cap is applied there: HF's multimodal class never reads final_logit_softcapping (None in
every released Gemma 3 anyway).
"""

from __future__ import annotations

from typing import Any

from hooked.models.gemma2 import build
from hooked.models.gemma3 import Gemma3Config
from loaders.architecture import Architecture, Key
from loaders.keymaps import GEMMA_NORMS, decoder_keys, gemma_fields, gemma_layer_types, rope_from_hf


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
    return Gemma3Config(**gemma_fields(hf), **ropes_from_hf(hf),
                        attn_softcap=None,  # HF's Gemma3Attention never reads attn_logit_softcapping
                        final_softcap=hf.get("final_logit_softcapping"),
                        layer_types=gemma_layer_types(hf, period=hf.get("sliding_window_pattern", 6)))


def key_map(cfg: Gemma3Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, GEMMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, qk_norm=True, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="gemma3",
    hf_classes=("Gemma3ForCausalLM", "Gemma3TextModel"),
    model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)


MULTIMODAL_PREFIXES = ("model.language_model.", "language_model.model.")


def multimodal_config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """The language model's config; the top-level tie flag wins where both are written."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError("a Gemma3ForConditionalGeneration config without text_config")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    text["final_logit_softcapping"] = None  # HF's Gemma3ForConditionalGeneration never applies it
    return config_from_hf(text)


def multimodal_key_map(cfg: Gemma3Config) -> dict[str, Key]:
    """The text key map with each `model.X` name read under the multimodal prefixes."""
    keys = {}
    for ours, key in key_map(cfg).items():
        if ours == "unembed.weight":
            keys[ours] = Key.of("lm_head.weight", "language_model.lm_head.weight")
            continue
        inner = key.names[0].removeprefix("model.")
        keys[ours] = Key.of(*(prefix + inner for prefix in MULTIMODAL_PREFIXES))
    return keys


MULTIMODAL = Architecture(
    name="gemma3_multimodal",
    hf_classes=("Gemma3ForConditionalGeneration",),
    model_types=("gemma3",),
    config_from_hf=multimodal_config_from_hf,
    build=build,
    key_map=multimodal_key_map,
    ignore=(r"^(model\.)?vision_tower\.", r"^(model\.)?multi_modal_projector\."),
)
