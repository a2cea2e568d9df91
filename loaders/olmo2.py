"""OLMo 2 checkpoints (HF `Olmo2ForCausalLM`, model_type "olmo2") -> `hooked.models.olmo2`.

Tensor names are Llama's (keymaps.decoder_keys) with the norms after the sublayers:
post_attention_layernorm -> ln1_post, post_feedforward_layernorm -> ln2_post, plus per layer
`self_attn.q_norm.weight` [n_heads d_head] and `self_attn.k_norm.weight` [n_kv_heads d_head]
(heads_norm.py keeps HF's flat layout). Nothing is transformed.
"""

from __future__ import annotations

from typing import Any

from hooked.models.olmo2 import Olmo2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import decoder_keys, llama_fields

OLMO_NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}


def config_from_hf(hf: dict[str, Any]) -> Olmo2Config:
    return Olmo2Config(**llama_fields(hf) | dict(eps=hf.get("rms_norm_eps", 1e-5)))


def key_map(cfg: Olmo2Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, OLMO_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, qk_norm=True, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="olmo2",
    hf_classes=("Olmo2ForCausalLM", "Olmo2Model"),
    model_types=("olmo2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
