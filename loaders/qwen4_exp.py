"""Qwen4-Exp (text) checkpoints -> hooked.models.qwen4_exp.

    ARCHITECTURE   Qwen4ExpForCausalLM ("qwen4_exp_text") and the vision-language Qwen4ExpForConditionalGeneration
                   ("qwen4_exp": its `text_config`, weights under `model.language_model.`; `model.visual.*` and
                   `mtp.*` ignored). A vision-language config without a text_config is refused by name.

HF config fields and ours: hooked/models/qwen4_exp.py's glossary. "full_attention" and "indexed_attention" layers
are both QSA attention (HF reads one as the other); QSA's five indexer fields are required (HF's attention layers
cannot be built without them).

Key layout (after `model.` or `model.language_model.`): `embed_tokens`, `layers.{l}.` with
`{attn,mlp}_hyper_connection.{hc_norm,input_mix_weight_down,input_mix_weight_up,block_inject_weight}` (our ln1, ln2),
`linear_attn.*` (Qwen3.5's plain delta projections), `self_attn.{q_proj ([query_h | gate_h] per head),k_proj,v_proj,
o_proj,q_norm,k_norm,indexer.{index_qk_proj,q_layernorm,k_layernorm}}`, `mlp.{gate,experts.*,shared_expert.*,
shared_expert_gate}`, `ple.{ple_embedding.ngram_embedding,key_proj,value_proj,norm_key,norm_query,norm_conv,conv1d}`;
`hyper_connection_mixer.*` (our ln_final); `lm_head`. On disk the n-gram table is split in `split_ngram_parts`
shards (`ngram_embedding.shard_{i}.weight`, concatenated on dim 0: `shard_view`), experts one tensor each
(`expert_view` stacks them); the n-gram hash buffers (multipliers, table sizes, offsets) are derived from the
config and ignored.
"""

from __future__ import annotations

import re
from typing import Any

from hooked.models.qwen4_exp import Qwen4ExpConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import chained, expert_view, shard_view
from loaders.keymaps import (PER_EXPERT_STACKS, delta_mixer_keys, gated_attention_keys, lm_head_keys,
                             qwen_fields, sigmoid_shared_moe_keys, squeeze_conv)

LAYER_TYPES = {"linear_attention": "delta", "indexed_attention": "attention", "full_attention": "attention"}
QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") == "qwen4_exp" or "vision_config" in hf:
        if not isinstance(hf.get("text_config"), dict):
            raise ValueError("a Qwen4-Exp vision-language config (model_type 'qwen4_exp') without a text_config: "
                             "hooked loads the text model only, from text_config")
        return {**hf, **hf["text_config"]}
    return hf


def config_from_hf(hf: dict[str, Any]) -> Qwen4ExpConfig:
    hf = text_config(hf)
    fields = qwen_fields(hf, LAYER_TYPES, attention="indexed_attention")
    n_layers = len(fields["layer_types"])
    missing = [f for f in QSA if hf.get(f) is None]
    if missing:
        raise ValueError(f"Qwen4-Exp's attention layers need the QSA indexer fields; missing {missing}")
    if int(hf["indexer_kv_heads"]) != 1:
        raise ValueError(f"Qwen4-Exp QSA has one index key head (indexer_kv_heads=1), got {hf['indexer_kv_heads']}")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    ple_ids = sorted(set(hf.get("ple_layer_ids") or ()))
    bad = [i for i in ple_ids if not 1 <= int(i) <= n_layers]
    if bad:
        raise ValueError(f"ple_layer_ids are one-indexed layers in [1, {n_layers}], got {bad}")
    return Qwen4ExpConfig(
        **fields,
        mlp_types=("moe",) * n_layers, n_experts=int(hf.get("num_experts", 512)),
        top_k=int(hf.get("num_experts_per_tok", 10)), d_expert=int(hf.get("moe_intermediate_size", 512)),
        d_shared=int(hf.get("shared_expert_intermediate_size", 512)), renormalise=bool(hf.get("norm_topk_prob", True)),
        n_streams=int(hf.get("hc_count", 4)), hc_rank=int(hf.get("hc_lowrank", 320)),
        ple_layers=tuple(int(i) - 1 for i in ple_ids), ple_dim=hf.get("ple_embed_dim"),
        ple_width=int(hf.get("ple_conv_kernel_size", 4)), ngram_size=int(hf.get("ngram_size", 3)),
        heads_per_ngram=int(hf.get("heads_per_ngram", 8)), ngram_base=int(hf.get("ngram_vocab_size_base", 20_000_000)),
        ngram_divisor=int(hf.get("make_ngram_vocab_size_divisible_by", 128)), seed=int(hf.get("seed", 1234)),
        eos=None if eos is None else int(eos), n_idx_heads=int(hf["indexer_n_heads"]),
        d_idx=int(hf["indexer_head_dim"]), idx_budget=int(hf["indexer_budget"]),
        idx_ratio=int(hf["indexer_compress_ratio"]), gate_fn=hf.get("output_gate_type") or hf.get("hidden_act", "silu"),
    )


def hyper_keys(ours: str, theirs: str, combine: bool = True) -> dict[str, Key]:
    parts = ("hc_norm", "input_mix_weight_down", "input_mix_weight_up") + (("block_inject_weight",) if combine else ())
    return {f"{ours}{p}.weight": Key.of(f"{theirs}{p}.weight") for p in parts}


def layer_keys(cfg: Qwen4ExpConfig, layer: int) -> dict[str, Key]:
    ours, theirs = f"blocks.{layer}.", f"layers.{layer}."
    keys = hyper_keys(ours + "ln1.", theirs + "attn_hyper_connection.")
    keys |= hyper_keys(ours + "ln2.", theirs + "mlp_hyper_connection.")
    if cfg.layer_types[layer] == "attention":
        keys |= gated_attention_keys(ours + "attn.", theirs + "self_attn.", cfg.n_attn_heads, cfg.d_attn_head,
                                     cfg.attention_bias)
        keys |= {f"{ours}attn.indexer.{p}.weight": Key.of(f"{theirs}self_attn.indexer.{p}.weight")
                 for p in ("index_qk_proj", "q_layernorm", "k_layernorm")}
    else:
        names = {p: p for p in ("A_log", "dt_bias", "norm.weight", "out_proj.weight")}
        names |= {f"{p}.weight": f"{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
        keys |= delta_mixer_keys(ours + "mixer.", theirs + "linear_attn.", names)
    if layer in cfg.ple_layers:
        keys |= {f"{ours}ple.{p}.weight": Key.of(f"{theirs}ple.{p}.weight")
                 for p in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv")}
        keys[ours + "ple.ngram.weight"] = Key.of(theirs + "ple.ple_embedding.ngram_embedding.weight")
        keys[ours + "ple.conv_weight"] = Key.of(theirs + "ple.conv1d.weight", transform=squeeze_conv)
    return keys | sigmoid_shared_moe_keys(ours + "mlp.", theirs + "mlp.")


def key_map(cfg: Qwen4ExpConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("embed_tokens.weight")} | hyper_keys("ln_final.", "hyper_connection_mixer.", False)
    for layer in range(cfg.n_layers):
        keys |= layer_keys(cfg, layer)
    prefixes = ("model.", "model.language_model.")
    keys = {ours: Key(tuple(p + n for n in key.names for p in prefixes), key.transform) for ours, key in keys.items()}
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="qwen4_exp",
    hf_classes=("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"),
    model_types=("qwen4_exp_text", "qwen4_exp"),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    ignore=(r"^mtp\.", r"^model\.visual\.",
            r"\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$"),
    adapt=chained(shard_view(re.compile(r"^(?P<target>.*\.ngram_embedding)\.shard_(?P<i>\d+)\.weight$"), "weight"),
                  expert_view(stacks=PER_EXPERT_STACKS)),
)
