"""HF MambaForCausalLM / FalconMambaForCausalLM checkpoints -> hooked.models.mamba (build).

Glossary (HF config field -> MambaConfig field)
    num_hidden_layers -> n_layers      hidden_size -> d_model       vocab_size -> d_vocab
    intermediate_size (or expand * hidden_size) -> d_inner          state_size -> d_state (N)
    conv_kernel -> d_conv              time_step_rank ("auto" = ceil(d_model / 16)) -> dt_rank (R)
    layer_norm_epsilon -> eps          use_conv_bias -> conv_bias   use_bias -> proj_bias
    tie_word_embeddings -> tied        mixer_rms_eps (FalconMamba only, default 1e-6) -> mixer_rms_eps

Key layout (HF names; the original state-spaces checkpoints say `backbone.embedding.weight`, which
HF renames on load, so both are candidates):
    backbone.embeddings.weight                      -> embed.weight
    backbone.layers.{l}.norm.weight                 -> blocks.{l}.ln1.weight
    backbone.layers.{l}.mixer.conv1d.weight [d 1 w] -> blocks.{l}.mixer.conv_weight [d w]
    backbone.layers.{l}.mixer.{in_proj,x_proj,dt_proj,out_proj,A_log,D,conv1d.bias} -> same names
    backbone.norm_f.weight                          -> ln_final.weight
    lm_head.weight                                  -> unembed.weight (untied checkpoints only)
HF's residual_in_fp32 is not modelled: the residual stream keeps the model's dtype.
"""

from __future__ import annotations

import math
from typing import Any

from hooked.models.mamba import MambaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import lm_head_keys, mamba1_keys


def _mamba_config(c: dict[str, Any], mixer_rms_eps: float | None) -> MambaConfig:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Mamba checkpoints with hidden_act={act!r} are not supported (only 'silu')")
    d_model = int(c["hidden_size"])
    rank = c.get("time_step_rank", "auto")
    d_inner = c.get("intermediate_size") or int(c.get("expand", 2) * d_model)
    return MambaConfig(
        n_layers=int(c["num_hidden_layers"]),
        d_model=d_model,
        d_vocab=int(c["vocab_size"]),
        d_inner=int(d_inner),
        d_state=int(c.get("state_size", 16)),
        d_conv=int(c.get("conv_kernel", 4)),
        dt_rank=math.ceil(d_model / 16) if rank == "auto" else int(rank),
        eps=float(c.get("layer_norm_epsilon", 1e-5)),
        conv_bias=bool(c.get("use_conv_bias", True)),
        proj_bias=bool(c.get("use_bias", False)),
        tied=bool(c.get("tie_word_embeddings", True)),
        mixer_rms_eps=mixer_rms_eps,
    )


def config_from_hf(c: dict[str, Any]) -> MambaConfig:
    """MambaConfig of an HF `mamba` config dict (no mixer norms)."""
    return _mamba_config(c, None)


def falcon_config_from_hf(c: dict[str, Any]) -> MambaConfig:
    """MambaConfig of an HF `falcon_mamba` config dict: the mixer norms are on."""
    eps = c.get("mixer_rms_eps")
    return _mamba_config(c, float(1e-6 if eps is None else eps))


def key_map(cfg: MambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("backbone.embeddings.weight", "backbone.embedding.weight")}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"backbone.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "norm.weight")
        keys |= mamba1_keys(ours + "mixer.", theirs + "mixer.", cfg.conv_bias, cfg.proj_bias)
    keys["ln_final.weight"] = Key.of("backbone.norm_f.weight")
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="mamba",
    hf_classes=("MambaForCausalLM",),
    model_types=("mamba",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)

FALCON_MAMBA = Architecture(
    name="falcon_mamba",
    hf_classes=("FalconMambaForCausalLM",),
    model_types=("falcon_mamba",),
    config_from_hf=falcon_config_from_hf,
    build=build,
    key_map=key_map,
)
