"""Granite 4 hybrid (IBM GraniteMoeHybrid): Mamba-2 and attention layers, dense or MoE MLPs, muP multipliers.

Glossary (TransformerLens / SSM names; HF GraniteMoeHybridConfig names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]
    layer_types  "mamba" or "attention" per layer [layer_types / layers_block_type]
    Mamba-2 layers: n_heads [mamba_n_heads], d_head [mamba_d_head], d_inner [mamba_expand * hidden_size],
        d_state [mamba_d_state], n_groups [mamba_n_groups], d_conv [mamba_d_conv], chunk_size
        [mamba_chunk_size], dt_limit [time_step_limit], conv_bias, proj_bias [mamba_conv_bias, mamba_proj_bias]
    attention layers: n_attn_heads, n_attn_kv_heads, d_attn_head = d_model / n_attn_heads,
        rotary [position_embedding_type == "rope"], attention_bias
    MLP: n_experts [num_local_experts] (None for HF's 0: dense), top_k [num_experts_per_tok],
        d_mlp [intermediate_size, one expert's width], d_shared [shared_intermediate_size, the always-on
        SwiGLU "shared_mlp"]
    multipliers (muP): embedding_multiplier; residual_multiplier on every sublayer's output;
        attention_multiplier = the attention scale (replaces d_head^-1/2); logit_multiplier = 1 / logits_scaling

    resid_0 = embedding_multiplier * W_E[token]                                   hook_embed
    layer l: resid = resid + residual_multiplier * (attn or mixer)(ln1(resid))
             resid = resid + residual_multiplier * (moe(x) + shared_mlp(x) or shared_mlp(x)),  x = ln2(resid)
    logits = (ln_final(resid) @ W_U^T) * logit_multiplier

Dense layers' MLP is the shared SwiGLU itself (blocks.{l}.mlp.*); MoE layers' is moe.py's MoE with
it as `shared` (blocks.{l}.mlp.shared.*). Hooks: block.py, attention.py, mamba2.py, mlp.py, moe.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hooked.models.config import derived
from hooked.models.hybrid import check_kinds, hybrid_attention, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("mamba", "attention")


@dataclass(frozen=True)
class GraniteMoeHybridConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int  # H, SSM heads
    d_head: int = derived(lambda c: c.d_inner // c.n_heads)  # P
    d_inner: int = derived(lambda c: 2 * c.d_model)  # None: 2 * d_model
    d_state: int = 256
    n_groups: int = 1
    d_conv: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: c.d_model // c.n_attn_heads)
    use_rope: bool = False  # HF position_embedding_type == "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    n_experts: int | None = None  # None: dense MLPs (the shared MLP only)
    top_k: int = 2
    d_mlp: int = 1024  # one expert's hidden width
    d_shared: int = 1024  # the shared MLP's hidden width
    act_fn: str = "silu"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0  # the attention scale
    logit_multiplier: float = 1.0  # 1 / HF logits_scaling
    eps: float = 1e-6
    tied: bool = False
    n_ctx: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, self.n_layers, LAYER_TYPES))
        object.__setattr__(self, "dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        if self.d_inner != self.n_heads * self.d_head:
            raise ValueError(f"d_inner ({self.d_inner}) must equal n_heads * d_head ({self.n_heads} * {self.d_head})")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, n_experts = {self.n_experts}]")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, n_experts = {self.n_experts}]")

    @property
    def mixer(self) -> Mamba2Spec:
        return Mamba2Spec.of(self)

    @property
    def rotary(self) -> Rotary | None:
        return Rotary.of(self.d_attn_head, self.rope_theta, self.rope_scaling) if self.use_rope else None


def granite_mlp(cfg: GraniteMoeHybridConfig) -> nn.Module:
    shared = GatedMLP(cfg.d_model, cfg.d_shared, cfg.act_fn)
    if not cfg.n_experts:
        return shared
    return MoE(cfg.d_model, cfg.d_mlp, cfg.n_experts, SoftmaxTopK(cfg.top_k, renormalise=True), cfg.act_fn,
               shared=shared)


def build(cfg: GraniteMoeHybridConfig) -> LanguageModel:
    """Granite 4 hybrid; attention layers `blocks.{l}.attn`, Mamba-2 layers `blocks.{l}.mixer`, MLPs `blocks.{l}.mlp`."""
    rotary, mixer = cfg.rotary, cfg.mixer
    blocks = []
    for kind in cfg.layer_types:
        if kind == "attention":
            first = ("attn", hybrid_attention(cfg, bias=cfg.attention_bias, rotary=rotary,
                                              scale=cfg.attention_multiplier))
        else:
            first = ("mixer", Mamba2Mixer(mixer))
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", granite_mlp(cfg)),
                                     scale=cfg.residual_multiplier))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embedding_multiplier=cfg.embedding_multiplier,
                         logit_multiplier=cfg.logit_multiplier)
