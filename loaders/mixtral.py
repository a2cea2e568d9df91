"""Mixtral checkpoints (HF `MixtralForCausalLM`, model_type "mixtral") -> hooked.models.mixtral (build).

Glossary of HF config fields and ours: llama.py's, plus num_local_experts -> n_experts,
num_experts_per_tok -> top_k, sliding_window (None in the releases), intermediate_size -> d_mlp (an
expert's width).

Key layout: Llama's attention and norms (keymaps.decoder_keys); per layer `mlp.gate.weight` (the router)
and `mlp.experts.{gate_up_proj [E 2F m], down_proj [E m F]}` (transformers 5's in-memory layout).
Checkpoints on disk hold `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{i}.{w1,w2,w3}.weight`
(w1 gate, w3 up, w2 down): `adapt` renames and stacks them, as HF's conversion mapping does.
"""

from __future__ import annotations

from typing import Any

from hooked.models.mixtral import MixtralConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import LLAMA_NORMS, decoder_keys, llama_fields, stacked_experts_keys


def config_from_hf(hf: dict[str, Any]) -> MixtralConfig:
    return MixtralConfig(**llama_fields(hf), sliding_window=hf.get("sliding_window"),
                         n_experts=int(hf.get("num_local_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)))


def key_map(cfg: MixtralConfig) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, tied=cfg.tied)
    keys = {ours: key for ours, key in keys.items() if ".mlp." not in ours}  # the MoE replaces the dense MLP
    for l in range(cfg.n_layers):
        moe = {f"blocks.{l}.mlp.router.weight": Key.of(f"layers.{l}.mlp.gate.weight")}
        moe |= stacked_experts_keys(f"blocks.{l}.mlp.", f"layers.{l}.mlp.experts.")
        keys |= {ours: Key(tuple(p + n for n in key.names for p in ("model.", "")), key.transform)
                 for ours, key in moe.items()}
    return keys


ARCHITECTURE = Architecture(
    name="mixtral",
    hf_classes=("MixtralForCausalLM", "MixtralModel"),
    model_types=("mixtral",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(renames=[(r"\.block_sparse_moe\.", ".mlp.")],
                      stacks={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
)
