"""Jamba (AI21 2024): Mamba-1 layers (with dt/B/C RMS norms) and attention every k layers, MoE every other layer.

Glossary (TransformerLens / SSM names; HF JambaConfig names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]  d_mlp [intermediate_size]
    layer_types  "mamba" or "attention" per layer [attention where l % attn_layer_period == attn_layer_offset]
    mlp_types    "mlp" or "moe" per layer [moe where l % expert_layer_period == expert_layer_offset]
    Mamba-1 layers (mamba.py's glossary): d_inner [mamba_expand * hidden_size], d_state [mamba_d_state],
        d_conv [mamba_d_conv], dt_rank [mamba_dt_rank], conv_bias [mamba_conv_bias], proj_bias
        [mamba_proj_bias]; RMS norms WITH weights on the Δ input, B and C (eps = rms_norm_eps)
    attention layers: n_attn_heads, n_attn_kv_heads, d_attn_head = d_model / n_attn_heads; no
        positional encoding, no biases
    MLPs: SwiGLU of width d_mlp; MoE layers: moe.py's MoE of n_experts [num_experts] SwiGLU experts of
        width d_mlp, SoftmaxTopK (softmax over every expert, top_k [num_experts_per_tok] kept, not renormalised)

    layer l: resid = resid + (attn or mixer)(ln1(resid));  resid = resid + (mlp or moe)(ln2(resid))

For ablation a Mamba-1 "head" is one of the d_inner channels (as in mamba.py); cfg.n_heads = d_inner.
Hooks: block.py, attention.py (blocks.{l}.attn.*), mamba.py (blocks.{l}.mixer.*), mlp.py, moe.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hooked.models.config import derived
from hooked.models.hybrid import check_kinds, hybrid_attention, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mamba import MambaMixer, MambaSpec
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.norms import RMSNorm


@dataclass(frozen=True)
class JambaConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    d_mlp: int
    layer_types: Sequence[str]  # "mamba" or "attention"
    mlp_types: Sequence[str]  # "mlp" or "moe"
    d_inner: int = derived(lambda c: 2 * c.d_model)
    d_state: int = 16  # N
    d_conv: int = 4
    dt_rank: int = derived(lambda c: math.ceil(c.d_model / 16))
    conv_bias: bool = True
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: c.d_model // c.n_attn_heads)
    n_experts: int = 16
    top_k: int = 2
    act_fn: str = "silu"
    eps: float = 1e-6
    tied: bool = False
    n_ctx: int = 262144

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, self.n_layers,
                                                            ("mamba", "attention")))
        object.__setattr__(self, "mlp_types", check_kinds("mlp_types", self.mlp_types, self.n_layers, ("mlp", "moe")))
        self.mamba  # validates the mixer's fields
        if "moe" in self.mlp_types and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")

    @property
    def mamba(self) -> MambaSpec:
        """The Mamba-1 mixer's spec (its norms: weighted RMS on Δ input, B, C)."""
        return MambaSpec(self.d_model, self.d_inner, self.d_state, self.d_conv, self.dt_rank, self.conv_bias,
                         self.proj_bias, mixer_rms_eps=self.eps, mixer_norm_weights=True)

    @property
    def n_heads(self) -> int:
        """For ablation a Mamba-1 "head" is one inner channel."""
        return self.d_inner

    @property
    def d_head(self) -> int:
        return 1


def build(cfg: JambaConfig) -> LanguageModel:
    """Jamba; attention layers `blocks.{l}.attn`, Mamba-1 layers `blocks.{l}.mixer`, `blocks.{l}.mlp` an MLP or MoE."""
    blocks = []
    for kind, mlp_kind in zip(cfg.layer_types, cfg.mlp_types):
        if kind == "attention":
            first = ("attn", hybrid_attention(cfg))
        else:
            first = ("mixer", MambaMixer(cfg.mamba))
        if mlp_kind == "moe":
            mlp: nn.Module = MoE(cfg.d_model, cfg.d_mlp, cfg.n_experts, SoftmaxTopK(cfg.top_k), cfg.act_fn)
        else:
            mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", mlp)))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
