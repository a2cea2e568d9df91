"""MiniMax checkpoints (HF `MiniMaxForCausalLM`, model_type "minimax") -> hooked.models.minimax (build).

Glossary of HF config fields and ours: mixtral.py's, plus layer_types (linear_attention -> "lightning",
full_attention -> "attention"), block_size, and the six residual factors {full_attn, linear_attn,
mlp}_{alpha, beta}_factor -> {attn, lightning, mlp}_{alpha, beta}. rope_theta defaults to HF's 1e6.

Key layout: Mixtral's (norms, softmax attention `self_attn.{q,k,v,o}_proj`, MoE `mlp.gate` + stacked
`mlp.experts`; on disk `block_sparse_moe.experts.{i}.{w1,w3,w2}`, stacked by `adapt`), except the
lightning layers: `self_attn.{qkv_proj, output_gate, out_proj, norm}` -> `mixer.{qkv_proj, output_gate,
out_proj, norm}`. HF's lightning buffers (slope_rate, query_decay, key_decay, diagonal_decay) are
functions of the config, which the mixer recomputes: they are ignored, not loaded.
"""

from __future__ import annotations

from typing import Any

from hooked.models.minimax import MiniMaxConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields, stacked_experts_keys

LAYER_TYPES = {"linear_attention": "lightning", "full_attention": "attention"}
FACTORS = {"attn": "full_attn", "lightning": "linear_attn", "mlp": "mlp"}


def config_from_hf(hf: dict[str, Any]) -> MiniMaxConfig:
    fields = llama_fields(hf)
    if not (hf.get("rope_parameters") or {}).get("rope_theta") and "rope_theta" not in hf:
        fields["rope_theta"] = 1e6  # MiniMaxConfig.default_theta
    kinds = hf.get("layer_types") or ()
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"MiniMax layer types {unknown} are not supported (known: {', '.join(LAYER_TYPES)})")
    factors = {f"{ours}_{ab}": float(hf.get(f"{theirs}_{ab}_factor", 1)) for ours, theirs in FACTORS.items()
               for ab in ("alpha", "beta")}
    return MiniMaxConfig(**fields, sliding_window=hf.get("sliding_window"),
                         n_experts=int(hf.get("num_local_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
                         layer_types=tuple(LAYER_TYPES[k] for k in kinds), block_size=int(hf.get("block_size", 256)),
                         **factors)


def key_map(cfg: MiniMaxConfig) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, tied=cfg.tied)
    keys = {ours: key for ours, key in keys.items() if ".mlp." not in ours}  # the MoE replaces the dense MLP
    for l, kind in enumerate(cfg.layer_types):
        theirs = f"layers.{l}."
        moe = {f"blocks.{l}.mlp.router.weight": Key.of(theirs + "mlp.gate.weight")}
        moe |= stacked_experts_keys(f"blocks.{l}.mlp.", theirs + "mlp.experts.")
        if kind == "lightning":
            keys = {ours: key for ours, key in keys.items() if not ours.startswith(f"blocks.{l}.attn.")}
            moe |= {f"blocks.{l}.mixer.{m}.weight": Key.of(f"{theirs}self_attn.{m}.weight")
                    for m in ("qkv_proj", "output_gate", "out_proj", "norm")}
        keys |= {ours: Key(tuple(p + n for n in key.names for p in ("model.", "")), key.transform)
                 for ours, key in moe.items()}
    return keys


ARCHITECTURE = Architecture(
    name="minimax",
    hf_classes=("MiniMaxForCausalLM", "MiniMaxModel"),
    model_types=("minimax",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    ignore=(r"self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$",),
    adapt=expert_view(renames=[(r"\.block_sparse_moe\.", ".mlp.")],
                      stacks={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
)
