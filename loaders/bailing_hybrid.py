"""BailingHybridForCausalLM checkpoints (model_type "bailing_hybrid") -> hooked.models.bailing_hybrid.

Glossary of HF config fields (BailingHybridConfig) and ours: hooked/models/bailing_hybrid.py's glossary.
HF derives linear_head_dim from head_dim and then sets head_dim = qk_rope_head_dim; a dict from HF's config
class (read_config, from_hf) carries linear_head_dim as HF's model uses it, which is what is read here.

Key layout, in memory (transformers 5.x): `model.layers.{l}.self_attn.{q,k,v,b,g}_proj`, `conv1d` (q, k, v
taps stacked), `forget_gate.{f_proj, A_log, dt_bias}`, `o_norm`, `o_proj` (KDA layers), MLA names
(`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`, `g_proj`), `mlp.gate.{weight,
e_score_correction_bias}`, `mlp.experts.{gate_up_proj, down_proj}`, `mlp.shared_experts.*`. On disk (what
save_pretrained writes): `model.word_embeddings`, `.attention.`, `attention.dense`, `q/k/v_conv1d`,
`f_proj`/`A_log`/`dt_bias` beside the projections, `mlp.gate.expert_bias`, per-expert `experts.{i}.*`;
the Architecture's `adapt` presents those under the in-memory names.
MLA rope rows (q_proj's or q_b_proj's last d_rope rows of each head, kv_a_proj's last d_rope rows) are read
as [even | odd] (the model's glossary says why).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hooked.models.bailing_hybrid import BailingHybridConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import chained, concat_view, expert_view
from loaders.keymaps import KDA_LAYER_TYPES as LAYER_TYPES
from loaders.keymaps import KDA_MLP_TYPES as MLP_TYPES
from loaders.keymaps import PER_EXPERT_STACKS, first_of, kda_key_map, rope_from_hf


def config_from_hf(hf: dict[str, Any]) -> BailingHybridConfig:
    n_layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    group, dense = int(hf.get("layer_group_size", 6)), int(hf.get("first_k_dense_replace", 2))
    kinds = hf.get("layer_types") or ["full_attention" if (l + 1) % group == 0 else "linear_attention"
                                      for l in range(n_layers)]
    mlps = hf.get("mlp_layer_types") or ["dense" if l < dense else "sparse" for l in range(n_layers)]
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES} | {k for k in mlps if k not in MLP_TYPES})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (known: {', '.join([*LAYER_TYPES, *MLP_TYPES])})")
    if int(hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError("Bailing-hybrid MLA needs num_key_value_heads == num_attention_heads "
                         "(kv_b_proj writes every head)")
    theta, scaling = rope_from_hf(hf)
    if scaling is not None:
        raise ValueError(f"Bailing-hybrid with rope_type {scaling.get('rope_type')!r} is not supported (default rope "
                         "only: HF's MLA rescales its softmax by YaRN's mscale there)")
    q_rank = hf.get("q_lora_rank")
    return BailingHybridConfig(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        mlp_types=tuple(MLP_TYPES[k] for k in mlps), n_heads=int(hf.get("linear_num_heads") or heads),
        d_k=int(hf.get("linear_head_dim") or hf.get("head_dim") or 128), d_mlp=int(hf["intermediate_size"]),
        d_conv=int(hf.get("linear_conv_kernel_dim") or hf.get("short_conv_kernel_size") or 4),
        safe_gate=bool(hf.get("kda_safe_gate", True)), lower_bound=float(hf.get("kda_lower_bound", -5.0)),
        n_attn_heads=heads, d_nope=int(hf["qk_nope_head_dim"]), d_rope=int(hf["qk_rope_head_dim"]),
        d_attn_head=int(hf["v_head_dim"]), kv_rank=int(hf["kv_lora_rank"]),
        q_rank=None if q_rank is None else int(q_rank), attention_bias=bool(hf.get("attention_bias", False)),
        rope_theta=theta, n_experts=int(first_of(hf, "num_experts", "num_local_experts", default=512)),
        top_k=int(first_of(hf, "num_experts_per_token", "num_experts_per_tok", default=8)),
        d_expert=int(hf.get("moe_intermediate_size", 768)),
        n_shared=int(first_of(hf, "num_shared_experts", "n_shared_experts", default=1)),
        n_group=int(first_of(hf, "num_expert_group", "n_group", default=1)), topk_group=int(hf.get("topk_group") or 1),
        renormalise=bool(first_of(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling=float(hf.get("routed_scaling_factor", 2.5)),
        act_fn=hf.get("hidden_act", "silu"), eps=float(hf.get("rms_norm_eps", 1e-6)),
        tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(first_of(hf, "model_max_length", "max_position_embeddings", default=262144)),
    )


def rope_rows(d_rope: int, block: int) -> Any:
    """A transform reordering, in every `block` rows, the last d_rope rows from interleaved pairs to [even | odd]."""
    order = torch.cat([torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)]) + (block - d_rope)
    index = torch.cat([torch.arange(block - d_rope), order])

    def rows(w: Tensor) -> Tensor:
        blocks = w.unflatten(0, (-1, block))
        return blocks[:, index.to(w.device)].flatten(0, 1)
    return rows


def _latent_attention_keys(cfg: BailingHybridConfig, ours: str, theirs: str) -> dict[str, Key]:
    per_head, latent = rope_rows(cfg.d_rope, cfg.d_nope + cfg.d_rope), rope_rows(cfg.d_rope, cfg.kv_rank + cfg.d_rope)
    keys = {f"{ours}{m}.weight": Key.of(f"{theirs}{t}.weight") for m, t in (
        ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"), ("o_proj", "o_proj"), ("g_proj", "g_proj"))}
    keys[ours + "kv_a_proj.weight"] = Key.of(theirs + "kv_a_proj_with_mqa.weight", transform=latent)
    if cfg.q_rank is None:
        keys[ours + "q_proj.weight"] = Key.of(theirs + "q_proj.weight", transform=per_head)
    else:
        keys |= {f"{ours}{m}.weight": Key.of(f"{theirs}{t}.weight") for m, t in (("q_a_proj", "q_a_proj"),
                                                                                  ("q_a_norm", "q_a_layernorm"))}
        keys[ours + "q_b_proj.weight"] = Key.of(theirs + "q_b_proj.weight", transform=per_head)
    if cfg.attention_bias:
        keys[ours + "kv_a_proj.bias"] = Key.of(theirs + "kv_a_proj_with_mqa.bias", transform=latent)
        keys[ours + "o_proj.bias"] = Key.of(theirs + "o_proj.bias")
        if cfg.q_rank is not None:
            keys[ours + "q_a_proj.bias"] = Key.of(theirs + "q_a_proj.bias")
    return keys


_KDA: dict[str, str | Key] = {f"{p}_proj.weight": f"{p}_proj.weight" for p in ("q", "k", "v", "b", "g")}
_KDA |= {"f_proj.weight": "forget_gate.f_proj.weight", "A_log": "forget_gate.A_log", "dt_bias": "forget_gate.dt_bias",
         "norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}


def key_map(cfg: BailingHybridConfig) -> dict[str, Key]:
    return kda_key_map(cfg, _latent_attention_keys, _KDA)


ARCHITECTURE = Architecture(
    name="bailing_hybrid",
    hf_classes=("BailingHybridForCausalLM",),
    model_types=("bailing_hybrid",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=chained(
        expert_view(renames=[(r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.", ".self_attn."),
                             (r"self_attn\.(f_proj\.|dt_bias|A_log)", r"self_attn.forget_gate.\1"),
                             (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                             (r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias")],
                    stacks=PER_EXPERT_STACKS),
        concat_view(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), "conv1d.weight")),
)
