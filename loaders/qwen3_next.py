"""Qwen3-Next and Qwen3.5 (text; dense and MoE) checkpoints -> hooked.models.qwen3_next (one loader: their
layers differ only in the delta projections' layout and the MLP pattern).

    ARCHITECTURE   Qwen3NextForCausalLM (model_type "qwen3_next")
    QWEN3_5        Qwen3_5ForCausalLM ("qwen3_5_text") and the vision-language Qwen3_5ForConditionalGeneration
                   ("qwen3_5": its `text_config`, weights under `model.language_model.`; `model.visual.*`
                   and `mtp.*` ignored, as the CausalLM does)
    QWEN3_5_MOE    the same for Qwen3_5Moe* ("qwen3_5_moe_text", "qwen3_5_moe"): every layer MoE

Glossary of HF config fields (Qwen3NextConfig) and ours: hooked/models/qwen3_next.py's glossary; layer l
is MoE iff l not in mlp_only_layers, num_experts > 0 and (l + 1) % decoder_sparse_step == 0.

Key layout: `model.embed_tokens`, `model.layers.{l}.{input_layernorm,post_attention_layernorm}`,
`linear_attn.{in_proj_qkvz,in_proj_ba,conv1d,A_log,dt_bias,norm,out_proj}` (delta layers),
`self_attn.{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}` (attention), `mlp.{gate,up,down}_proj` or
`mlp.{gate,experts.*,shared_expert.*,shared_expert_gate}`, `model.norm`, `lm_head`. in_proj_qkvz and
in_proj_ba are interleaved per key head ([q_g | k_g | v_g | z_g], [b_g | a_g]); q_proj per attention
head ([query_h | gate_h]): the key map's transforms de-interleave them into our plain projections.
Checkpoints on disk keep one tensor per expert (`adapt` stacks them) and the multi-token-prediction
head `mtp.*` (ignored, as HF does). Qwen3.5 stores its delta projections plainly
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: our names) and has no mlp_only_layers.
"""

from __future__ import annotations

from typing import Any

from hooked.models.qwen3_5 import Qwen3_5Config
from hooked.models.qwen3_next import Qwen3NextConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import (PER_EXPERT_STACKS, delta_mixer_keys, gated_attention_keys, gated_mlp_keys, interleaved,
                             lm_head_keys, qwen_fields, sigmoid_shared_moe_keys)

LAYER_TYPES = {"linear_attention": "delta", "full_attention": "attention"}


def config_from_hf(hf: dict[str, Any]) -> Qwen3NextConfig:
    n_layers, n_experts = int(hf["num_hidden_layers"]), int(hf.get("num_experts") or 0)
    only, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step", 1))
    mlp_types = tuple("moe" if l not in only and n_experts > 0 and (l + 1) % step == 0 else "dense"
                      for l in range(n_layers))
    return Qwen3NextConfig(
        **qwen_fields(hf, LAYER_TYPES), d_mlp=int(hf["intermediate_size"]), mlp_types=mlp_types, n_experts=n_experts or None,
        top_k=int(hf.get("num_experts_per_tok", 10)), d_expert=int(hf.get("moe_intermediate_size", 512)),
        d_shared=int(hf.get("shared_expert_intermediate_size", 512)), renormalise=bool(hf.get("norm_topk_prob", True)),
    )


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's text part (its `text_config`), or the config itself."""
    return {**hf, **hf["text_config"]} if isinstance(hf.get("text_config"), dict) else hf


def qwen3_5_config(hf: dict[str, Any], moe: bool) -> Qwen3_5Config:
    hf = text_config(hf)
    if not moe:
        return Qwen3_5Config(**qwen_fields(hf, LAYER_TYPES), d_mlp=int(hf["intermediate_size"]))
    return Qwen3_5Config(**qwen_fields(hf, LAYER_TYPES), mlp_types=("moe",) * int(hf["num_hidden_layers"]),
                         n_experts=int(hf["num_experts"]), top_k=int(hf.get("num_experts_per_tok", 8)),
                         d_expert=int(hf.get("moe_intermediate_size", 512)),
                         d_shared=int(hf.get("shared_expert_intermediate_size", 512)))


def layer_keys(cfg: Qwen3NextConfig, layer: int, mixer: dict[str, str | Key]) -> dict[str, Key]:
    """One Qwen decoder layer (names after `model.`); `mixer`: the delta layer's projections (delta_mixer_keys's)."""
    ours, theirs = f"blocks.{layer}.", f"layers.{layer}."
    keys = {ours + "ln1.weight": Key.of(theirs + "input_layernorm.weight"),
            ours + "ln2.weight": Key.of(theirs + "post_attention_layernorm.weight")}
    if cfg.layer_types[layer] == "attention":
        keys |= gated_attention_keys(ours + "attn.", theirs + "self_attn.", cfg.n_attn_heads, cfg.d_attn_head,
                                     cfg.attention_bias)
    else:
        names = {"A_log": "A_log", "dt_bias": "dt_bias", "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}
        keys |= delta_mixer_keys(ours + "mixer.", theirs + "linear_attn.", names | mixer)
    if cfg.mlp_types[layer] == "moe":
        return keys | sigmoid_shared_moe_keys(ours + "mlp.", theirs + "mlp.")
    return keys | gated_mlp_keys(ours + "mlp.", theirs + "mlp.", False)


def key_map(cfg: Qwen3NextConfig) -> dict[str, Key]:
    r, dk, dv = cfg.n_heads // cfg.n_k_heads, cfg.d_k, cfg.d_v
    qkvz = [dk, dk, r * dv, r * dv]  # rows of one key head in in_proj_qkvz
    mixer = {"in_proj_qkv.weight": Key.of("in_proj_qkvz.weight", transform=interleaved(cfg.n_k_heads, qkvz, [0, 1, 2])),
             "in_proj_z.weight": Key.of("in_proj_qkvz.weight", transform=interleaved(cfg.n_k_heads, qkvz, [3])),
             "in_proj_b.weight": Key.of("in_proj_ba.weight", transform=interleaved(cfg.n_k_heads, [r, r], [0])),
             "in_proj_a.weight": Key.of("in_proj_ba.weight", transform=interleaved(cfg.n_k_heads, [r, r], [1]))}
    return decoder(cfg, mixer, ("model.",))


def qwen3_5_key_map(cfg: Qwen3NextConfig) -> dict[str, Key]:
    mixer = {f"{p}.weight": f"{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    return decoder(cfg, mixer, ("model.", "model.language_model."))


def decoder(cfg: Qwen3NextConfig, mixer: dict[str, str | Key], prefixes: tuple[str, ...]) -> dict[str, Key]:
    """Every layer, the embedding and the final norm under each of `prefixes` (first present wins), lm_head."""
    keys = {"embed.weight": Key.of("embed_tokens.weight"), "ln_final.weight": Key.of("norm.weight")}
    for layer in range(cfg.n_layers):
        keys |= layer_keys(cfg, layer, mixer)
    keys = {ours: Key(tuple(p + n for n in key.names for p in prefixes), key.transform) for ours, key in keys.items()}
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="qwen3_next",
    hf_classes=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    ignore=(r"^mtp\.",),
    adapt=expert_view(stacks=PER_EXPERT_STACKS),
)

QWEN3_5 = Architecture(
    name="qwen3_5",
    hf_classes=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    model_types=("qwen3_5_text", "qwen3_5"),
    config_from_hf=lambda hf: qwen3_5_config(hf, moe=False),
    build=build,
    key_map=qwen3_5_key_map,
    ignore=(r"^mtp\.", r"^model\.visual\."),
)

QWEN3_5_MOE = Architecture(
    name="qwen3_5_moe",
    hf_classes=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    config_from_hf=lambda hf: qwen3_5_config(hf, moe=True),
    build=build,
    key_map=qwen3_5_key_map,
    ignore=(r"^mtp\.", r"^model\.visual\."),
    adapt=expert_view(stacks=PER_EXPERT_STACKS),
)
