"""Zamba2ForCausalLM checkpoints (model_type "zamba2") -> hooked.models.zamba2 (build).

Glossary of HF config fields (Zamba2Config) and ours (hooked.models.zamba2.Zamba2Config):
    num_hidden_layers -> n_layers, hidden_size -> d_model, vocab_size -> d_vocab,
    layers_block_type ("linear_attention" or legacy "mamba", "hybrid") -> layer_types ("mamba", "hybrid"),
    n_mamba_heads -> n_heads, mamba_headdim -> d_head, mamba_expand * hidden_size -> d_inner,
    mamba_d_state -> d_state, mamba_ngroups -> n_groups, mamba_d_conv -> d_conv, chunk_size,
    (time_step_min, inf) -> dt_limit, add_bias_linear -> proj_bias,
    num_attention_heads -> n_attn_heads, num_key_value_heads -> n_attn_kv_heads,
    attention_head_dim -> d_attn_head, intermediate_size -> d_mlp, hidden_act -> act_fn,
    num_mem_blocks, use_shared_attention_adapter, adapter_rank, use_mem_rope,
    rope_parameters / rope_theta -> rope_theta + rope_scaling, rms_norm_eps -> eps,
    tie_word_embeddings -> tied, max_position_embeddings -> n_ctx.

Key layout. Mamba layer l: `model.layers.{l}.mamba.*`, `model.layers.{l}.input_layernorm.weight`.
Hybrid layer l: `model.layers.{l}.mamba_decoder.{mamba,input_layernorm}.*`, `model.layers.{l}.linear`,
and `model.layers.{l}.shared_transformer.*`. HF ties the shared blocks (`_tied_weights_keys`), so a
saved checkpoint holds shared block k once, under its FIRST hybrid layer f_k; invocation i's adapters
live there too, at index i of f_k's adapter lists (`linear_{q,k,v}_adapter_list.{i}.{0,1}`,
`gate_up_proj_adapter_list.{i}.{0,1}`: 0 = down, 1 = up). Each of these keys also accepts the
invocation's own layer as a second name (a checkpoint that stores the tied copies). In memory
(`from_hf`), HF's state_dict lists every tied copy; load.py recognises them as the same tensor.
HF's conv1d weight [conv_dim 1 d_conv] becomes our conv_weight [conv_dim d_conv].
"""

from __future__ import annotations

import math
from typing import Any

from hooked.models.zamba2 import Zamba2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import attention_fields, lm_head_keys, mamba2_keys, rope_from_hf

LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "m": "mamba", "hybrid": "hybrid", "g": "hybrid"}


def config_from_hf(hf: dict[str, Any]) -> Zamba2Config:
    """Our config from an HF Zamba2Config dict; refuses what the model does not implement."""
    d_model, n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        raise ValueError("Zamba2 config without layers_block_type")
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"Zamba2 layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    d_inner = int(hf.get("mamba_expand", 2) * d_model)
    n_heads = int(hf["n_mamba_heads"])
    theta, scaling = rope_from_hf(hf)
    return Zamba2Config(
        n_layers=n_layers,
        d_model=d_model,
        d_vocab=int(hf["vocab_size"]),
        layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        n_heads=n_heads,
        d_head=int(hf.get("mamba_headdim") or d_inner // n_heads),
        d_inner=d_inner,
        d_state=int(hf.get("mamba_d_state", 64)),
        n_groups=int(hf.get("mamba_ngroups", 1)),
        d_conv=int(hf.get("mamba_d_conv", 4)),
        chunk_size=int(hf.get("chunk_size", 256)),
        dt_limit=(float(hf.get("time_step_min", 0.001)), math.inf),
        proj_bias=bool(hf.get("add_bias_linear", False)),
        **attention_fields(hf, d_attn_head=int(hf.get("attention_head_dim")
                                               or 2 * d_model // int(hf["num_attention_heads"]))),
        d_mlp=int(hf.get("intermediate_size") or 4 * d_model),
        act_fn=hf.get("hidden_act", "gelu"),
        num_mem_blocks=int(hf.get("num_mem_blocks", 1)),
        use_shared_attention_adapter=bool(hf.get("use_shared_attention_adapter", False)),
        adapter_rank=int(hf.get("adapter_rank", 128)),
        use_mem_rope=bool(hf.get("use_mem_rope", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        eps=float(hf.get("rms_norm_eps", 1e-5)),
        tied=bool(hf.get("tie_word_embeddings", True)),
        n_ctx=int(16384 if hf.get("use_long_context") else hf.get("max_position_embeddings") or 4096),
    )


def _mamba_keys(cfg: Zamba2Config, layer: int, theirs: str) -> dict[str, Key]:
    """ln1 and the Mamba-2 mixer of one layer; `theirs` is the HF prefix of its Mamba decoder."""
    ours = f"blocks.{layer}."
    keys = {ours + "ln1.weight": Key.of(theirs + "input_layernorm.weight")}
    return keys | mamba2_keys(ours + "mixer.", theirs + "mamba.", conv_bias=True, proj_bias=cfg.proj_bias)


def _shared_keys(cfg: Zamba2Config, layer: int, invocation: int, first: int) -> dict[str, Key]:
    """Invocation `invocation` at `layer`: its adapters, and the shared weights if it owns them."""
    ours = f"blocks.{layer}.shared."

    def key(name: str) -> Key:  # the first owner's copy, else this layer's own
        names = [f"model.layers.{first}.shared_transformer.{name}", f"model.layers.{layer}.shared_transformer.{name}"]
        return Key.of(*dict.fromkeys(names))

    keys: dict[str, Key] = {}
    adapted = {"mlp.gate_up_proj": f"feed_forward.gate_up_proj_adapter_list.{invocation}"}
    if cfg.use_shared_attention_adapter:
        adapted.update({f"attn.{p}_proj": f"self_attn.linear_{p}_adapter_list.{invocation}" for p in "qkv"})
    for proj, theirs in adapted.items():
        keys[f"{ours}{proj}.down.weight"] = key(f"{theirs}.0.weight")
        keys[f"{ours}{proj}.up.weight"] = key(f"{theirs}.1.weight")
    if layer != first:  # the shared weights are parameters of the first invocation only
        return keys
    qkv = ".base" if cfg.use_shared_attention_adapter else ""
    keys[ours + "ln1.weight"] = key("input_layernorm.weight")
    keys[ours + "ln2.weight"] = key("pre_ff_layernorm.weight")
    for p in "qkv":
        keys[f"{ours}attn.{p}_proj{qkv}.weight"] = key(f"self_attn.{p}_proj.weight")
    keys[ours + "attn.o_proj.weight"] = key("self_attn.o_proj.weight")
    for p in ["weight", "bias"][: 1 + cfg.proj_bias]:
        keys[f"{ours}mlp.gate_up_proj.base.{p}"] = key(f"feed_forward.gate_up_proj.{p}")
        keys[f"{ours}mlp.down_proj.{p}"] = key(f"feed_forward.down_proj.{p}")
    return keys


def key_map(cfg: Zamba2Config) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"),
            "ln_final.weight": Key.of("model.final_layernorm.weight")}
    firsts: dict[int, int] = {}  # shared block -> its first hybrid layer
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "mamba":
            keys.update(_mamba_keys(cfg, layer, f"model.layers.{layer}."))
            continue
        keys.update(_mamba_keys(cfg, layer, f"model.layers.{layer}.mamba_decoder."))
        keys[f"blocks.{layer}.linear.weight"] = Key.of(f"model.layers.{layer}.linear.weight")
        invocation = cfg.hybrid_layer_ids.index(layer)
        first = firsts.setdefault(cfg.shared_block_of(layer), layer)
        keys.update(_shared_keys(cfg, layer, invocation, first))
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="zamba2",
    hf_classes=("Zamba2ForCausalLM",),
    model_types=("zamba2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
