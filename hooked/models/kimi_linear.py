"""Kimi Linear (Moonshot): KDA layers (the delta rule with a decay per key channel), MLA layers, DeepSeek-V3 MoE.

Glossary (TransformerLens / hybrid names; HF KimiLinearConfig names in brackets)
    n_layers = len(layer_types)   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types  "delta" [linear_attention, KDA] or "attention" [full_attention, MLA], one per layer
    mlp_types    "dense" or "moe" [mlp_layer_types: dense / sparse]
    KDA layers: n_heads [linear_num_heads] (q/k heads too: no grouping), d_k = d_v [linear_head_dim],
        d_conv [linear_conv_kernel_dim]; the decay gate f_b_proj(f_a_proj(x)) and the output gate
        g_b_proj(g_a_proj(x)) are low rank (d_model -> d_k -> n_heads d_k); the output norm gates with sigmoid
    MLA layers (latent_attention.py, no positional encoding): n_attn_heads [num_attention_heads],
        d_nope [qk_nope_head_dim], d_rope [qk_rope_head_dim], d_attn_head [v_head_dim], kv_rank
        [kv_lora_rank], q_rank [q_lora_rank]
    MLP: d_mlp [intermediate_size]; MoE: n_experts [num_experts], top_k [num_experts_per_token],
        d_expert [moe_intermediate_size], n_shared [num_shared_experts] (a gated MLP n_shared * d_expert wide),
        SigmoidTopK routing: n_group [num_expert_group], topk_group, renormalise [moe_renormalize],
        routed_scaling [routed_scaling_factor]
    eps [rms_norm_eps]: every RMSNorm and the KDA output norm

    layer l: resid = resid + (mixer or attn)(ln1(resid));  resid = resid + mlp(ln2(resid))

Hooks: delta_mixer.py (blocks.{l}.mixer; hook_alpha per key channel), latent_attention.py
(blocks.{l}.attn), mlp.py, moe.py, block.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hooked.models.config import derived
from hooked.models.delta_mixer import DeltaMixer, DeltaSpec
from hooked.models.hybrid import check_kinds, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.latent_attention import LatentAttention
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SigmoidTopK
from hooked.models.norms import RMSNorm

LAYER_TYPES = ("delta", "attention")
MLP_TYPES = ("dense", "moe")


@dataclass(frozen=True)
class KimiLinearConfig:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int  # KDA heads
    d_k: int  # = d_v
    d_mlp: int
    d_conv: int = 4
    n_attn_heads: int = 32
    d_nope: int = 128
    d_rope: int = 64
    d_attn_head: int = 128
    kv_rank: int = 512
    q_rank: int | None = None
    attention_bias: bool = False
    mlp_types: Sequence[str] = derived(lambda c: ("dense",) + ("moe",) * (len(c.layer_types) - 1))
    n_experts: int = 256
    top_k: int = 8
    d_expert: int = 1024
    n_shared: int = 1
    n_group: int = 1
    topk_group: int = 1
    renormalise: bool = True
    routed_scaling: float = 2.446
    act_fn: str = "silu"
    eps: float = 1e-5
    tied: bool = False
    n_ctx: int = 1048576
    chunk_size: int = 64

    def __post_init__(self) -> None:
        n = len(self.layer_types)
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, n, LAYER_TYPES))
        object.__setattr__(self, "mlp_types", check_kinds("mlp_types", self.mlp_types, n, MLP_TYPES))
        if "moe" in self.mlp_types and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"MoE layers need 0 < top_k ({self.top_k}) <= n_experts ({self.n_experts})")

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mixer(self) -> DeltaSpec:
        return DeltaSpec(self.d_model, self.n_heads, self.n_heads, self.d_k, self.d_k, self.d_conv, eps=self.eps,
                         gate_fn="sigmoid", per_channel_decay=True, chunk_size=self.chunk_size,
                         conv_act=self.act_fn)


class KimiDeltaMixer(DeltaMixer):
    """KDA's projections: q_proj, k_proj, v_proj (the conv input), b_proj, the low-rank decay gate
    (f_a_proj, f_b_proj) and output gate (g_a_proj, g_b_proj)."""

    def __init__(self, spec: DeltaSpec) -> None:
        super().__init__(spec)
        d, width = spec.d_model, spec.value_dim
        self.q_proj, self.k_proj = nn.Linear(d, spec.key_dim, bias=False), nn.Linear(d, spec.key_dim, bias=False)
        self.v_proj, self.b_proj = nn.Linear(d, width, bias=False), nn.Linear(d, spec.n_heads, bias=False)
        self.f_a_proj, self.f_b_proj = nn.Linear(d, spec.d_k, bias=False), nn.Linear(spec.d_k, width, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(d, spec.d_k, bias=False), nn.Linear(spec.d_k, width, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv, self.g_b_proj(self.g_a_proj(x)), self.b_proj(x), self.f_b_proj(self.f_a_proj(x))

    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_a_proj]


def mlp(cfg: KimiLinearConfig, kind: str) -> nn.Module:
    if kind == "dense":
        return GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
    select = SigmoidTopK(cfg.n_experts, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.renormalise, cfg.routed_scaling)
    return MoE(cfg.d_model, cfg.d_expert, cfg.n_experts, select, cfg.act_fn,
               shared=GatedMLP(cfg.d_model, cfg.d_expert * cfg.n_shared, cfg.act_fn))


def kda_model(cfg: KimiLinearConfig, mixer: Callable[[], nn.Module], attention: Callable[[], nn.Module]) -> LanguageModel:
    """KDA layers `blocks.{l}.mixer` (mixer()) and MLA layers `blocks.{l}.attn` (attention()) as layer_types says,
    each followed by its dense or MoE MLP; the final RMSNorm."""
    blocks = []
    for kind, mlp_kind in zip(cfg.layer_types, cfg.mlp_types):
        first = ("attn", attention()) if kind == "attention" else ("mixer", mixer())
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", mlp(cfg, mlp_kind))))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))


def build(cfg: KimiLinearConfig) -> LanguageModel:
    """Kimi Linear; KDA layers `blocks.{l}.mixer`, MLA layers `blocks.{l}.attn`."""
    return kda_model(cfg, lambda: KimiDeltaMixer(cfg.mixer),
                     lambda: LatentAttention(cfg.d_model, cfg.n_attn_heads, cfg.d_nope, cfg.d_rope, cfg.d_attn_head,
                                             cfg.kv_rank, cfg.q_rank, bias=cfg.attention_bias))
