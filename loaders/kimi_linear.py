"""KimiLinearForCausalLM checkpoints (model_type "kimi_linear") -> hooked.models.kimi_linear.

Glossary of HF config fields (KimiLinearConfig; its to_dict spellings first) and ours:
hooked/models/kimi_linear.py's glossary; num_experts_per_token (num_experts_per_tok) -> top_k,
num_expert_group (n_group) -> n_group, moe_renormalize (norm_topk_prob) -> renormalise,
num_shared_experts (n_shared_experts) -> n_shared, model_max_length -> n_ctx. HF's own post-init
has already turned `linear_attn_config` (1-indexed kda_layers / full_attn_layers) into layer_types.

Key layout (HF 5.x in memory): `model.layers.{l}.{input_layernorm,post_attention_layernorm}`;
KDA layers `self_attn.{q,k,v,b,g_a,g_b,o}_proj`, `self_attn.conv1d`, `self_attn.o_norm`,
`self_attn.forget_gate.{f_a_proj,f_b_proj,A_log [1 1 h 1],dt_bias}`; MLA layers `self_attn.q_proj` (or
`q_a_proj`, `q_a_layernorm`, `q_b_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`;
`mlp.{gate,up,down}_proj` or `mlp.gate.{weight,e_score_correction_bias}`, `mlp.experts.*`,
`mlp.shared_experts.*`. On disk (and as save_pretrained writes it): `block_sparse_moe.` for `mlp.`
(dense layers too), experts one per index (`experts.{i}.w1/w2/w3` = gate/down/up), the forget gate's
tensors directly under `self_attn.`, and the conv as `{q,k,v}_conv1d`: `adapt` presents them as in memory.
"""

from __future__ import annotations

from typing import Any

from hooked.models.kimi_linear import KimiLinearConfig, build
from loaders.architecture import Architecture, Key
from loaders.checkpoint_view import chained, concat_view, expert_view
from loaders.keymaps import KDA_LAYER_TYPES as LAYER_TYPES
from loaders.keymaps import KDA_MLP_TYPES as MLP_TYPES
from loaders.keymaps import first_of, kda_key_map


def config_from_hf(hf: dict[str, Any]) -> KimiLinearConfig:
    n_layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["full_attention" if l and l % 4 == 0 else "linear_attention" for l in range(n_layers)]
    mlps = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    unknown = sorted({k for k in kinds if k not in LAYER_TYPES} | {k for k in mlps if k not in MLP_TYPES})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (known: {', '.join([*LAYER_TYPES, *MLP_TYPES])})")
    heads = int(hf["num_attention_heads"])
    if int(hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError("Kimi Linear MLA needs num_key_value_heads == num_attention_heads (kv_b_proj writes every head)")
    q_rank = hf.get("q_lora_rank")
    return KimiLinearConfig(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(LAYER_TYPES[k] for k in kinds),
        mlp_types=tuple(MLP_TYPES[k] for k in mlps), n_heads=int(hf.get("linear_num_heads", 32)),
        d_k=int(hf.get("linear_head_dim", 128)), d_mlp=int(hf["intermediate_size"]),
        d_conv=int(hf.get("linear_conv_kernel_dim", 4)), n_attn_heads=heads, d_nope=int(hf["qk_nope_head_dim"]),
        d_rope=int(hf["qk_rope_head_dim"]), d_attn_head=int(hf["v_head_dim"]), kv_rank=int(hf["kv_lora_rank"]),
        q_rank=None if q_rank is None else int(q_rank), attention_bias=bool(hf.get("attention_bias", False)),
        n_experts=int(first_of(hf, "num_experts", "num_local_experts", default=256)),
        top_k=int(first_of(hf, "num_experts_per_token", "num_experts_per_tok", default=8)),
        d_expert=int(hf.get("moe_intermediate_size", 1024)),
        n_shared=int(first_of(hf, "num_shared_experts", "n_shared_experts", default=1)),
        n_group=int(first_of(hf, "num_expert_group", "n_group", default=1)), topk_group=int(hf.get("topk_group") or 1),
        renormalise=bool(first_of(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling=float(hf.get("routed_scaling_factor", 2.446)), act_fn=hf.get("hidden_act", "silu"),
        eps=float(hf.get("rms_norm_eps", 1e-5)),
        tied=False,  # HF's KimiLinearForCausalLM never ties lm_head (_tied_weights_keys = {}), whatever the config says
        n_ctx=int(first_of(hf, "model_max_length", "max_position_embeddings", default=1048576)),
    )


def _latent_attention_keys(cfg: KimiLinearConfig, ours: str, theirs: str) -> dict[str, Key]:
    names = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj"}
    if cfg.q_rank is None:
        names["q_proj"] = "q_proj"
    else:
        names |= {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj"}
    keys = {f"{ours}{m}.weight": Key.of(f"{theirs}{t}.weight") for m, t in names.items()}
    if cfg.attention_bias:
        keys |= {f"{ours}{m}.bias": Key.of(f"{theirs}{t}.bias") for m, t in names.items()
                 if m in ("kv_a_proj", "o_proj", "q_a_proj")}
    return keys


_KDA: dict[str, str | Key] = {f"{p}_proj.weight": f"{p}_proj.weight" for p in ("q", "k", "v", "b", "g_a", "g_b")}
_KDA |= {f"{p}.weight": f"forget_gate.{p}.weight" for p in ("f_a_proj", "f_b_proj")}
_KDA |= {"A_log": Key.of("forget_gate.A_log", transform=lambda w: w.reshape(-1)),
         "dt_bias": "forget_gate.dt_bias", "norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}


def key_map(cfg: KimiLinearConfig) -> dict[str, Key]:
    return kda_key_map(cfg, _latent_attention_keys, _KDA)


ARCHITECTURE = Architecture(
    name="kimi_linear",
    hf_classes=("KimiLinearForCausalLM",),
    model_types=("kimi_linear",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
    adapt=chained(
        expert_view(renames=[(r"\.block_sparse_moe\.", ".mlp."),
                             (r"\.self_attn\.(f_a_proj|f_b_proj|A_log|dt_bias)", r".self_attn.forget_gate.\1")],
                    stacks={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
        concat_view(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), "conv1d.weight")),
)
