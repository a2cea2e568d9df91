"""Qwen3-MoE checkpoints (HF `Qwen3MoeForCausalLM`, model_type "qwen3_moe") -> hooked.models.qwen3_moe (build).

Glossary of HF config fields and ours: qwen3.py's, plus num_experts -> n_experts, num_experts_per_tok ->
top_k, moe_intermediate_size -> d_expert, norm_topk_prob -> renormalise, mlp_only_layers and
decoder_sparse_step -> mlp_types (layer l is MoE iff l not in mlp_only_layers, num_experts > 0 and
(l + 1) % decoder_sparse_step == 0), use_sliding_window + sliding_window -> every layer's window.

Key layout: Qwen3's attention (q/k norms) and norms; MoE layers `mlp.gate.weight` (the router) and
`mlp.experts.{gate_up_proj, down_proj}`; dense layers `mlp.{gate,up,down}_proj.weight`. Checkpoints on disk
keep one tensor per expert (`mlp.experts.{i}.{gate,up,down}_proj.weight`): `adapt` stacks them.
"""

from __future__ import annotations

from typing import Any

from hooked.models.qwen3_moe import Qwen3MoeConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import expert_view
from loaders.keymaps import LLAMA_NORMS, PER_EXPERT_STACKS, decoder_keys, llama_fields, stacked_experts_keys


def config_from_hf(hf: dict[str, Any]) -> Qwen3MoeConfig:
    n_layers = int(hf["num_hidden_layers"])
    n_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # HF 5 writes the latter
    only, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step", 1))
    mlp_types = tuple("moe" if l not in only and n_experts > 0 and (l + 1) % step == 0 else "dense"
                      for l in range(n_layers))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    top_k = int(hf.get("num_experts_per_tok", 8))
    return Qwen3MoeConfig(**llama_fields(hf), qkv_bias=False, sliding_window=window,
                          layer_types=("sliding_attention",) * n_layers if window is not None else None,
                          n_experts=n_experts or top_k, top_k=top_k,  # no MoE layer: both unused
                          d_expert=int(hf.get("moe_intermediate_size", 768)),
                          renormalise=bool(hf.get("norm_topk_prob", False)),
                          mlp_types=None if set(mlp_types) == {"moe"} else mlp_types)


def key_map(cfg: Qwen3MoeConfig) -> dict[str, Key]:
    keys = decoder_keys(cfg.n_layers, LLAMA_NORMS, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                        mlp_bias=False, qk_norm=True, tied=cfg.tied)
    for l in range(cfg.n_layers):
        if cfg.mlp_type(l) != "moe":
            continue  # a dense layer keeps decoder_keys' MLP
        keys = {ours: key for ours, key in keys.items() if not ours.startswith(f"blocks.{l}.mlp.")}
        moe = {f"blocks.{l}.mlp.router.weight": Key.of(f"layers.{l}.mlp.gate.weight")}
        moe |= stacked_experts_keys(f"blocks.{l}.mlp.", f"layers.{l}.mlp.experts.")
        keys |= {ours: Key(tuple(p + n for n in key.names for p in ("model.", "")), key.transform)
                 for ours, key in moe.items()}
    return keys


ARCHITECTURE = Architecture(
    name="qwen3_moe",
    hf_classes=("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
    model_types=("qwen3_moe",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=expert_view(stacks=PER_EXPERT_STACKS),
)
