"""Mamba2ForCausalLM checkpoints -> hooked.models.mamba2 (build).

Glossary of HF config fields (Mamba2Config) and ours (hooked.models.mamba2.Mamba2Config):
    hidden_size -> d_model, num_hidden_layers -> n_layers, num_heads -> n_heads (SSM heads),
    head_dim -> d_head, expand * hidden_size -> d_inner, state_size -> d_state, n_groups,
    conv_kernel -> d_conv, chunk_size, time_step_limit -> dt_limit, use_conv_bias -> conv_bias,
    use_bias -> proj_bias, layer_norm_epsilon -> eps, tie_word_embeddings -> tied,
    vocab_size -> d_vocab.

Key layouts: HF's `backbone.embeddings.weight`, and the original state-spaces layout
`backbone.embedding.weight` (which HF renames on load); everything else is shared. HF's conv1d
weight [conv_dim 1 d_conv] becomes our conv_weight [conv_dim d_conv].
"""

from __future__ import annotations

from typing import Any

from hooked.models.mamba2 import Mamba2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import dt_limit_from_hf, lm_head_keys, mamba2_keys


def config_from_hf(hf: dict[str, Any]) -> Mamba2Config:
    """Our config from an HF Mamba2Config dict; refuses what the model does not implement."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Mamba-2 with hidden_act={act!r} is not supported (only silu)")
    if hf.get("norm_before_gate", False):
        raise ValueError("Mamba-2 with norm_before_gate=True is not supported (HF normalises after the gate)")
    d_model = int(hf["hidden_size"])
    return Mamba2Config(
        n_layers=int(hf["num_hidden_layers"]),
        d_model=d_model,
        n_heads=int(hf["num_heads"]),
        d_head=int(hf["head_dim"]),
        d_inner=int(hf.get("expand", 2) * d_model),
        d_state=int(hf["state_size"]),
        n_groups=int(hf.get("n_groups", 1)),
        d_conv=int(hf.get("conv_kernel", 4)),
        chunk_size=int(hf.get("chunk_size", 256)),
        dt_limit=dt_limit_from_hf(hf),
        conv_bias=bool(hf.get("use_conv_bias", True)),
        proj_bias=bool(hf.get("use_bias", False)),
        eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", False)),
        d_vocab=int(hf["vocab_size"]),
        n_ctx=int(hf.get("max_position_embeddings") or 2048),
    )


def key_map(cfg: Mamba2Config) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("backbone.embeddings.weight", "backbone.embedding.weight"),
            "ln_final.weight": Key.of("backbone.norm_f.weight")}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"backbone.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "norm.weight")
        keys |= mamba2_keys(ours + "mixer.", theirs + "mixer.", cfg.conv_bias, cfg.proj_bias)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="mamba2",
    hf_classes=("Mamba2ForCausalLM",),
    model_types=("mamba2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
