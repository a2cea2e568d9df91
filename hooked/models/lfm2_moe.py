"""LFM2-MoE (Liquid AI): LFM2's short-conv and attention layers, a sigmoid-routed MoE after the first dense layers.

Glossary (TransformerLens names; HF Lfm2MoeConfig names in brackets): lfm2.py's, plus
    n_dense [num_dense_layers]  the first layers keep a dense SwiGLU MLP of width d_mlp [intermediate_size]
    n_experts [num_experts], top_k [num_experts_per_tok], d_expert [moe_intermediate_size]
    routing (moe.py's SigmoidTopK, one group): scores = sigmoid(router(x)); experts chosen by
        scores + expert_bias [use_expert_bias; the bias is HF's expert_bias buffer]; weights = the chosen
        unbiased scores, divided by their sum [norm_topk_prob], times routed_scaling [routed_scaling_factor]

    layer l: resid = resid + (mixer or attn)(ln1(resid));  resid = resid + (mlp or MoE)(ln2(resid))

Hooks: short_conv.py (blocks.{l}.mixer), attention.py (blocks.{l}.attn), mlp.py / moe.py (blocks.{l}.mlp).
HF divides by (sum + 1e-6) when it renormalises, moe.py by (sum + 1e-20): a relative difference below
1e-6 of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.attention import Attention
from hooked.models.hybrid import pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.lfm2 import Lfm2Config
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SigmoidTopK
from hooked.models.norms import RMSNorm
from hooked.models.short_conv import GatedShortConv
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Lfm2MoeConfig(Lfm2Config):
    n_experts: int = 32
    top_k: int = 4
    d_expert: int = 1792
    n_dense: int = 2  # leading layers with a dense MLP
    renormalise: bool = True
    routed_scaling: float = 1.0
    expert_bias: bool = True  # the choice adds a per-expert bias (a checkpoint tensor); False: no bias (zeros)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.n_dense <= self.n_layers:
            raise ValueError(f"n_dense ({self.n_dense}) must be between 0 and n_layers ({self.n_layers})")


def build(cfg: Lfm2MoeConfig) -> LanguageModel:
    """LFM2-MoE; conv layers `blocks.{l}.mixer`, attention layers `blocks.{l}.attn`, MLP or MoE `blocks.{l}.mlp`."""
    rotary = Rotary.of(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    blocks = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "attention":
            first = ("attn", Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, rotary=rotary,
                                       q_norm=RMSNorm(cfg.d_head, cfg.eps), k_norm=RMSNorm(cfg.d_head, cfg.eps)))
        else:
            first = ("mixer", GatedShortConv(cfg.d_model, cfg.d_conv, cfg.conv_bias))
        if layer < cfg.n_dense:
            mlp = GatedMLP(cfg.d_model, cfg.d_mlp, "silu")
        else:
            select = SigmoidTopK(cfg.n_experts, cfg.top_k, renormalise=cfg.renormalise, scaling=cfg.routed_scaling)
            mlp = MoE(cfg.d_model, cfg.d_expert, cfg.n_experts, select, "silu")
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", mlp)))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
