"""OLMo 3 checkpoints (HF `Olmo3ForCausalLM`, model_type "olmo3") -> `hooked.models.olmo3` (OLMo 2's build).

Tensor names are OLMo 2's (loaders/olmo2.py). Config:
    layer_types   read from the config; without it HF's rule (layer l is full when l + 1 is a multiple of 4)
    rope          HF >= 5 writes rope_parameters per layer kind ({"full_attention": {...},
                  "sliding_attention": {...}}); an older config's rope_theta serves both kinds and its
                  rope_scaling the full layers only (as HF's Olmo3Config reads them)
"""

from __future__ import annotations

from typing import Any

from hooked.models.olmo2 import build
from hooked.models.olmo3 import Olmo3Config
from loaders.architecture import Architecture, Key
from loaders.keymaps import decoder_keys, llama_fields, rope_from_hf

OLMO_NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}
DEFAULT_THETA = 500_000.0


def ropes_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_theta": DEFAULT_THETA}
        local = params.get("sliding_attention") or {"rope_theta": DEFAULT_THETA}
    else:
        theta = hf.get("rope_theta", params.get("rope_theta", DEFAULT_THETA))
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": theta}
        local = {"rope_theta": theta}
    theta, scaling = rope_from_hf({"rope_parameters": full})
    local_theta, local_scaling = rope_from_hf({"rope_parameters": local})
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, rope_local_scaling=local_scaling)


def config_from_hf(hf: dict[str, Any]) -> Olmo3Config:
    types = hf.get("layer_types") or ["sliding_attention" if (l + 1) % 4 else "full_attention"
                                      for l in range(hf["num_hidden_layers"])]
    fields = llama_fields(hf) | dict(eps=hf.get("rms_norm_eps", 1e-5)) | ropes_from_hf(hf)
    return Olmo3Config(**fields, sliding_window=hf.get("sliding_window", 4096), layer_types=tuple(types))


def key_map(cfg: Olmo3Config) -> dict[str, Key]:
    return decoder_keys(cfg.n_layers, OLMO_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, qk_norm=True, tied=cfg.tied)


ARCHITECTURE = Architecture(
    name="olmo3",
    hf_classes=("Olmo3ForCausalLM", "Olmo3Model"),
    model_types=("olmo3",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
