"""GPT-OSS checkpoints (HF `GptOssForCausalLM`, model_type "gpt_oss") -> hooked.models.gpt_oss (build).

Glossary of HF config fields and ours: llama.py's and qwen2.py's, plus num_local_experts -> n_experts,
num_experts_per_tok -> top_k, swiglu_alpha -> alpha, swiglu_limit -> limit, layer_types (HF's default:
even layers "sliding_attention") with sliding_window, rope_parameters (YaRN) -> rope_scaling.

Key layout: Llama's attention (with biases on q, k, v, o) and norms, plus per layer
    self_attn.sinks [n_heads]                          -> attn.sinks
    mlp.router.{weight, bias}                          -> mlp.router.{weight, bias}
    mlp.experts.gate_up_proj [E d_model 2F]            gate and up INTERLEAVED on the last axis (gate at even
                                                       columns), stored transposed: -> gate_proj, up_proj [E F d_model]
    mlp.experts.gate_up_proj_bias [E 2F]               -> gate_bias, up_bias (even / odd)
    mlp.experts.down_proj [E F d_model]                -> down_proj [E d_model F] (transposed)
    mlp.experts.down_proj_bias [E d_model]             -> down_bias
The released checkpoints store gate_up_proj and down_proj in MXFP4 (`<name>_blocks` [E rows groups 16] and
`<name>_scales` [E rows groups]): `adapt` (checkpoint_view.mxfp4_view) reads them dequantised, as HF's
`Mxfp4Config(dequantize=True)` does (exact in bf16), into the layout above; the config's `quantization_config`
describes only that storage.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from hooked.models.gpt_oss import GptOssConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import mxfp4_view
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields, rope_from_hf


def even_columns_t(w: Tensor) -> Tensor:
    """The gate half of the interleaved gate_up_proj [E m 2F] as [E F m]."""
    return w[..., 0::2].transpose(-1, -2)


def odd_columns_t(w: Tensor) -> Tensor:
    """The up half of the interleaved gate_up_proj [E m 2F] as [E F m]."""
    return w[..., 1::2].transpose(-1, -2)


def even(b: Tensor) -> Tensor:
    return b[..., 0::2]


def odd(b: Tensor) -> Tensor:
    return b[..., 1::2]


def transposed(w: Tensor) -> Tensor:
    return w.transpose(-1, -2)


def config_from_hf(hf: dict[str, Any]) -> GptOssConfig:
    n_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if (l + 1) % 2 else "full_attention" for l in range(n_layers)]
    theta, scaling = rope_from_hf(hf)
    return GptOssConfig(**{**llama_fields(hf), "rope_theta": theta, "rope_scaling": scaling,
                           "attention_bias": bool(hf.get("attention_bias", True)), "eps": hf.get("rms_norm_eps", 1e-5)},
                        sliding_window=hf.get("sliding_window", 128), layer_types=tuple(types),
                        n_experts=int(hf.get("num_local_experts", 32)), top_k=int(hf.get("num_experts_per_tok", 4)),
                        alpha=float(hf.get("swiglu_alpha", 1.702)), limit=float(hf.get("swiglu_limit", 7.0)))


def key_map(cfg: GptOssConfig) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, tied=cfg.tied)
    keys = {ours: key for ours, key in keys.items() if ".mlp." not in ours}  # the MoE replaces the dense MLP
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}.", f"layers.{l}."
        experts = theirs + "mlp.experts."
        layer = {ours + "attn.sinks": Key.of(theirs + "self_attn.sinks"),
                 ours + "mlp.router.weight": Key.of(theirs + "mlp.router.weight"),
                 ours + "mlp.router.bias": Key.of(theirs + "mlp.router.bias"),
                 ours + "mlp.gate_proj": Key.of(experts + "gate_up_proj", transform=even_columns_t),
                 ours + "mlp.up_proj": Key.of(experts + "gate_up_proj", transform=odd_columns_t),
                 ours + "mlp.gate_bias": Key.of(experts + "gate_up_proj_bias", transform=even),
                 ours + "mlp.up_bias": Key.of(experts + "gate_up_proj_bias", transform=odd),
                 ours + "mlp.down_proj": Key.of(experts + "down_proj", transform=transposed),
                 ours + "mlp.down_bias": Key.of(experts + "down_proj_bias")}
        keys |= {mine: Key(tuple(p + n for n in key.names for p in ("model.", "")), key.transform)
                 for mine, key in layer.items()}
    return keys


ARCHITECTURE = Architecture(
    name="gpt_oss",
    hf_classes=("GptOssForCausalLM", "GptOssModel"),
    model_types=("gpt_oss",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=mxfp4_view(),
)
