"""ZambaForCausalLM checkpoints (model_type "zamba", Zamba v1) -> hooked.models.zamba (build).

Glossary of HF config fields (ZambaConfig) and ours (hooked.models.zamba.ZambaConfig):
    num_hidden_layers -> n_layers, hidden_size -> d_model, vocab_size -> d_vocab,
    layers_block_type ("linear_attention" or legacy "mamba", "hybrid"; HF derives it from attn_layer_period /
    attn_layer_offset when absent) -> layer_types ("mamba", "hybrid"),
    n_mamba_heads -> n_groups, mamba_expand * hidden_size -> d_inner, mamba_d_state -> d_state,
    mamba_d_conv -> d_conv, mamba_dt_rank -> dt_rank, mamba_conv_bias -> conv_bias, mamba_proj_bias -> proj_bias,
    num_attention_heads -> n_attn_heads, num_key_value_heads -> n_attn_kv_heads, attention_head_dim -> d_attn_head,
    intermediate_size -> d_mlp, hidden_act -> act_fn, rms_norm_eps -> eps, tie_word_embeddings -> tied,
    max_position_embeddings -> n_ctx. Refused: hidden_mamba_act other than silu (the mixer's conv activation),
    attention_hidden_size other than 2 * hidden_size (the shared block reads [hidden, embedding]: HF cannot run it).

Key layout. Mamba layer l: `model.layers.{l}.mamba.*`, `model.layers.{l}.input_layernorm.weight`; hybrid layer l:
`model.layers.{l}.mamba_decoder.{mamba,input_layernorm}.*`, `model.layers.{l}.linear.weight` and the shared block
`model.layers.{l}.shared_transf.{input_layernorm, self_attn.{q,k,v,o}_proj, pre_ff_layernorm,
feed_forward.{gate,up,down}_proj}`, which HF ties (`_tied_weights_keys`, applied only with tie_word_embeddings):
a saved checkpoint holds it once, under the first hybrid layer; copies under later layers, when a tied checkpoint
has them, are what HF leaves unread (`ignore`). Untied, every hybrid layer's own block is read. The mixer's tensors, HF -> ours:
    in_proj [2 d_inner, d_model]: rows interleaved per channel [x_c ; z_c] -> [x ; z] halves (the bias alike)
    x_proj_weight [G, R + 2N, P] -> x_proj.weight; dt_proj_weight [G, P, R], dt_proj_bias [G, P] -> dt_proj.*
    A_log [G, P, N] -> [d_inner, N]; D [G, P] -> [d_inner]; conv1d.weight [d_inner 1 w] -> conv_weight [d_inner w]
"""

from __future__ import annotations

import math
from typing import Any

from hooked.models.zamba import ZambaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import attention_keys, gated_mlp_keys, interleaved, lm_head_keys, squeeze_conv

LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}


def config_from_hf(hf: dict[str, Any]) -> ZambaConfig:
    """Our config from an HF ZambaConfig dict; refuses what the model does not implement."""
    d_model, n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        raise ValueError("Zamba config without layers_block_type")
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"Zamba layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    if hf.get("hidden_mamba_act", "silu") != "silu":
        raise ValueError(f"Zamba hidden_mamba_act={hf['hidden_mamba_act']!r} is not supported (only 'silu')")
    if int(hf.get("attention_hidden_size") or 2 * d_model) != 2 * d_model:
        raise ValueError(f"Zamba attention_hidden_size={hf['attention_hidden_size']} must be 2 * hidden_size = "
                         f"{2 * d_model}: the shared block reads [hidden, embedding] (HF's forward fails otherwise)")
    n_heads = int(hf["num_attention_heads"])
    rank = hf.get("mamba_dt_rank", "auto")
    return ZambaConfig(
        n_layers=n_layers,
        d_model=d_model,
        d_vocab=int(hf["vocab_size"]),
        layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_groups=int(hf.get("n_mamba_heads", 2)),
        d_inner=int(hf.get("mamba_expand", 2) * d_model),
        d_state=int(hf.get("mamba_d_state", 16)),
        d_conv=int(hf.get("mamba_d_conv", 4)),
        dt_rank=math.ceil(d_model / 16) if rank == "auto" else int(rank),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        n_attn_heads=n_heads,
        n_attn_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_attn_head=int(hf.get("attention_head_dim") or 2 * d_model // n_heads),
        d_mlp=int(hf["intermediate_size"]),
        act_fn=hf.get("hidden_act", "gelu"),
        eps=float(hf.get("rms_norm_eps", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", True)),  # HF ties the shared blocks only then (shared_tied)
        n_ctx=int(hf.get("max_position_embeddings") or 4096),
    )


def _flat_channels(w):
    """[G, P, ...] per-group tensors (A_log, D) -> [d_inner, ...]."""
    return w.flatten(0, 1)


def mixer_keys(cfg: ZambaConfig, ours: str, theirs: str) -> dict[str, Key]:
    """Our GroupedMambaMixer from HF's ZambaMambaMixer (module docstring)."""
    x_then_z = interleaved(cfg.d_inner, [1, 1], [0, 1])
    keys = {ours + "in_proj.weight": Key.of(theirs + "in_proj.weight", transform=x_then_z),
            ours + "x_proj.weight": Key.of(theirs + "x_proj_weight"),
            ours + "dt_proj.weight": Key.of(theirs + "dt_proj_weight"),
            ours + "dt_proj.bias": Key.of(theirs + "dt_proj_bias"),
            ours + "A_log": Key.of(theirs + "A_log", transform=_flat_channels),
            ours + "D": Key.of(theirs + "D", transform=_flat_channels),
            ours + "out_proj.weight": Key.of(theirs + "out_proj.weight"),
            ours + "conv_weight": Key.of(theirs + "conv1d.weight", transform=squeeze_conv)}
    if cfg.conv_bias:
        keys[ours + "conv_bias"] = Key.of(theirs + "conv1d.bias")
    if cfg.proj_bias:
        keys[ours + "in_proj.bias"] = Key.of(theirs + "in_proj.bias", transform=x_then_z)
        keys[ours + "out_proj.bias"] = Key.of(theirs + "out_proj.bias")
    return keys


def shared_keys(layer: int) -> dict[str, Key]:
    """The shared block of hybrid layer `layer` (tied: of the first hybrid layer only, where HF saves it)."""
    ours, theirs = f"blocks.{layer}.shared.", f"model.layers.{layer}.shared_transf."
    keys = {ours + "ln1.weight": Key.of(theirs + "input_layernorm.weight"),
            ours + "ln2.weight": Key.of(theirs + "pre_ff_layernorm.weight")}
    keys |= attention_keys(ours + "attn.", theirs + "self_attn.", False, False)
    return keys | gated_mlp_keys(ours + "mlp.", theirs + "feed_forward.", False)


def key_map(cfg: ZambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    for layer, kind in enumerate(cfg.layer_types):
        decoder = f"model.layers.{layer}." + ("mamba_decoder." if kind == "hybrid" else "")
        keys[f"blocks.{layer}.ln1.weight"] = Key.of(decoder + "input_layernorm.weight")
        keys |= mixer_keys(cfg, f"blocks.{layer}.mixer.", decoder + "mamba.")
        if kind == "hybrid":
            keys[f"blocks.{layer}.linear.weight"] = Key.of(f"model.layers.{layer}.linear.weight")
    for layer in cfg.hybrid_layer_ids[:1] if cfg.shared_tied else cfg.hybrid_layer_ids:
        keys |= shared_keys(layer)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="zamba",
    hf_classes=("ZambaForCausalLM",),
    model_types=("zamba",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    ignore=(r"model\.layers\.\d+\.shared_transf\.",),  # a tied block's later copies (the read ones are read)
)
