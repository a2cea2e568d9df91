"""Gemma 2 checkpoints (HF `Gemma2ForCausalLM`, model_type "gemma2") -> `hooked.models.gemma2.Gemma2`.

Glossary
    norms      HF input_layernorm -> ln1, post_attention_layernorm -> ln1_post (after attention,
               before the residual add), pre_feedforward_layernorm -> ln2, post_feedforward_layernorm
               -> ln2_post; weights copied as stored (the "1 +" lives in UnitOffsetRMSNorm)
    layer_types  read from the config; a config without it gets HF's rule (layer l slides when
               l + 1 is odd, i.e. even layers)

Every tensor keeps HF's layout (nn.Linear [out in]); nothing is transformed.
"""

from __future__ import annotations

from typing import Any

from hooked.models.gemma2 import Gemma2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import GEMMA_NORMS, decoder_keys, gemma_fields, gemma_layer_types, rope_from_hf


def config_from_hf(hf: dict[str, Any]) -> Gemma2Config:
    theta, scaling = rope_from_hf(hf)
    return Gemma2Config(**gemma_fields(hf), rope_theta=theta, rope_scaling=scaling,
                        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
                        final_softcap=hf.get("final_logit_softcapping", 30.0),
                        layer_types=gemma_layer_types(hf, period=2))


def key_map(cfg: Gemma2Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, GEMMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="gemma2",
    hf_classes=("Gemma2ForCausalLM", "Gemma2Model"),
    model_types=("gemma2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
