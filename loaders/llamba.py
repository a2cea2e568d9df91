"""Llamba checkpoints in Cartesia's layout (cartesia-pytorch's LlambaLMHeadModel) -> hooked.models.llamba.

Glossary of Cartesia's config.json (LlambaConfig; often saved without model_type, so the layout is
recognised by its `ssm_cfg` with `n_qk_heads` and its `mlp_cfg`) and ours:
    n_layer -> n_layers, d_model, vocab_size rounded up to pad_vocab_size_multiple -> d_vocab,
    mlp_cfg.{intermediate_size, bias, act_fn} -> d_mlp, mlp_bias, act_fn,
    ssm_cfg.{n_v_heads, n_qk_heads, d_state, expand, d_conv, conv_bias, bias, chunk_size} -> n_heads,
    n_groups, d_state, d_inner = expand * d_model, d_conv, conv_bias, proj_bias, chunk_size,
    norm_epsilon -> final_eps (the block norms use 1e-5 in Cartesia's code), tie_embeddings -> tied.
Refused: ssm_cfg.activation other than "identity", lm_head_bias (no unembedding bias here).

Keys: `backbone.embedding.weight`, `backbone.layers.{l}.{input_layernorm, post_attention_layernorm}.weight`,
`backbone.layers.{l}.mixer.{in_proj, z_bias, conv1d, D, out_proj}` (conv1d weight [conv_dim 1 d_conv]
squeezed), `backbone.layers.{l}.mlp.{gate,up,down}_proj`, `backbone.final_layernorm.weight`, `lm_head.weight`.
"""

from __future__ import annotations

from typing import Any

from hooked.models.llamba import LlambaConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import gated_mlp_keys, lm_head_keys, squeeze_conv


def is_llamba(hf: dict[str, Any]) -> bool:
    """A config in Cartesia's Llamba layout, with or without model_type."""
    ssm, mlp = hf.get("ssm_cfg"), hf.get("mlp_cfg")
    return isinstance(ssm, dict) and "n_qk_heads" in ssm and isinstance(mlp, dict) and "d_model" in hf


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def config_from_hf(hf: dict[str, Any]) -> LlambaConfig:
    """Our config from Cartesia's Llamba config dict; refuses what the model does not implement."""
    ssm, mlp = dict(hf.get("ssm_cfg") or {}), dict(hf.get("mlp_cfg") or {})
    if ssm.get("activation", "identity") != "identity":
        raise ValueError(f"Llamba with ssm_cfg.activation={ssm['activation']!r} is not supported (only identity)")
    if hf.get("lm_head_bias", False):
        raise ValueError("Llamba with lm_head_bias=True is not supported (the unembedding has no bias)")
    d_model = int(hf["d_model"])
    return LlambaConfig(
        n_layers=int(hf.get("n_layer", 32)),
        d_model=d_model,
        d_vocab=padded_vocab(int(hf["vocab_size"]), int(hf.get("pad_vocab_size_multiple", 8))),
        d_mlp=int(mlp.get("intermediate_size", 14336)),
        n_heads=int(ssm.get("n_v_heads", 32)),
        n_groups=int(ssm.get("n_qk_heads", 32)),
        d_state=int(ssm.get("d_state", 64)),
        d_inner=int(ssm.get("expand", 1) * d_model),
        d_conv=int(ssm.get("d_conv", 4)),
        chunk_size=int(ssm.get("chunk_size", 128)),
        conv_bias=bool(ssm.get("conv_bias", True)),
        proj_bias=bool(ssm.get("bias", False)),
        mlp_bias=bool(mlp.get("bias", False)),
        act_fn=str(mlp.get("act_fn", "silu")),
        final_eps=float(hf.get("norm_epsilon", 1e-5)),
        tied=bool(hf.get("tie_embeddings", False)),
    )


def key_map(cfg: LlambaConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("backbone.embedding.weight"),
            "ln_final.weight": Key.of("backbone.final_layernorm.weight")}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"backbone.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "post_attention_layernorm.weight")
        mixer, src = ours + "mixer.", theirs + "mixer."
        names = ["in_proj.weight", "D", "out_proj.weight"]
        names += ["in_proj.bias", "out_proj.bias"] if cfg.proj_bias else ["z_bias"]
        keys |= {mixer + n: Key.of(src + n) for n in names}
        keys[mixer + "conv_weight"] = Key.of(src + "conv1d.weight", transform=squeeze_conv)
        if cfg.conv_bias:
            keys[mixer + "conv_bias"] = Key.of(src + "conv1d.bias")
        keys |= gated_mlp_keys(ours + "mlp.", theirs + "mlp.", cfg.mlp_bias)
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="llamba",
    hf_classes=("LlambaLMHeadModel", "LlambaForCausalLM"),
    model_types=("llamba",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    recognise=is_llamba,
)
