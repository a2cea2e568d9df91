"""GPT-NeoX / Pythia checkpoints (HF `GPTNeoXForCausalLM`, model_type "gpt_neox") -> `hooked.models.gpt_neox`.

Glossary
    query_key_value  the fused projection, weight [3 d_model, d_model] laid out per head:
               [head 0: q | k | v][head 1: q | k | v] ...; split into q_proj, k_proj, v_proj
               (keymaps.interleaved), bias likewise
    dense      the attention output projection -> o_proj; dense_h_to_4h / dense_4h_to_h -> the
               MLP's up_proj / down_proj
    norms      input_layernorm -> ln1 (attention), post_attention_layernorm -> ln2 (MLP; in a
               parallel block it reads the block's input, not the attention's output)
    prefix     GPTNeoXForCausalLM names tensors `gpt_neox.layers.0...`; a bare GPTNeoXModel `layers.0...`
    unembed    `embed_out.weight` (the released Pythia files) or `lm_head.weight` (transformers >= 5.14)
    rope       rotary_pct / rotary_emb_base (the released config.json) or rope_parameters'
               partial_rotary_factor / rope_theta (HF >= 5): both are read

Old checkpoints also hold the causal-mask buffers `attention.bias`, `attention.masked_bias` and
`attention.rotary_emb.inv_freq` (HF ignores them; so do we).
"""

from __future__ import annotations

from typing import Any

from hooked.models.gpt_neox import GPTNeoXConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import interleaved, rope_fields


def config_from_hf(hf: dict[str, Any]) -> GPTNeoXConfig:
    rope = rope_fields({"partial_rotary_factor": hf.get("rotary_pct", 0.25),
                        "rope_theta": hf.get("rotary_emb_base", 10000.0), **hf})
    return GPTNeoXConfig(
        n_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 2048),
        eps=hf.get("layer_norm_eps", 1e-5),
        act_fn=hf.get("hidden_act", "gelu"),
        rotary_pct=rope["partial_rotary_factor"],
        rope_theta=rope["rope_theta"],
        rope_scaling=rope["rope_scaling"],
        parallel=hf.get("use_parallel_residual", True),
        attention_bias=hf.get("attention_bias", True),
        tied=hf.get("tie_word_embeddings", False),
    )


def _key(name: str, transform: Any = None) -> Key:
    return Key.of(f"gpt_neox.{name}", name, transform=transform)


def key_map(cfg: GPTNeoXConfig) -> dict[str, Key]:
    keys = {"embed.weight": _key("embed_in.weight"), "ln_final.weight": _key("final_layer_norm.weight"),
            "ln_final.bias": _key("final_layer_norm.bias")}
    d_head, biases = cfg.d_head, ("weight", "bias") if cfg.attention_bias else ("weight",)
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}.", f"layers.{l}."
        for norm, hf in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            keys |= {f"{ours}{norm}.{w}": _key(f"{theirs}{hf}.{w}") for w in ("weight", "bias")}
        for i, proj in enumerate("qkv"):
            for w in biases:
                keys[f"{ours}attn.{proj}_proj.{w}"] = _key(f"{theirs}attention.query_key_value.{w}",
                                                           interleaved(cfg.n_heads, [d_head] * 3, [i]))
        keys |= {f"{ours}attn.o_proj.{w}": _key(f"{theirs}attention.dense.{w}") for w in biases}
        for mine, hf in (("up_proj", "dense_h_to_4h"), ("down_proj", "dense_4h_to_h")):
            keys |= {f"{ours}mlp.{mine}.{w}": _key(f"{theirs}mlp.{hf}.{w}") for w in ("weight", "bias")}
    if not cfg.tied:
        keys["unembed.weight"] = Key.of("lm_head.weight", "embed_out.weight")
    return keys


ARCHITECTURE = Architecture(
    name="gpt_neox",
    hf_classes=("GPTNeoXForCausalLM", "GPTNeoXModel"),
    model_types=("gpt_neox",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    ignore=(r"(^|\.)attention\.(masked_)?bias$",),
)
