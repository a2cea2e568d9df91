"""OLMo-hybrid (AI2): Gated DeltaNet layers (pre-norm) and OLMo 3 attention layers (post-norm), SwiGLU MLPs.

Glossary (TransformerLens / hybrid names; HF OlmoHybridConfig names in brackets)
    n_layers = len(layer_types)   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types  "delta" [linear_attention] or "attention" [full_attention], one per layer
    delta layers: n_heads [linear_num_value_heads], n_k_heads [linear_num_key_heads], d_k
        [linear_key_head_dim], d_v [linear_value_head_dim], d_conv [linear_conv_kernel_dim],
        neg_eigval [linear_allow_neg_eigval]: beta = 2 sigmoid(b), so (I - beta k k^T) may flip k
    attention layers: n_attn_heads [num_attention_heads], n_attn_kv_heads [num_key_value_heads],
        d_attn_head = d_model / n_attn_heads; q_norm and k_norm over all heads at once (heads_norm.py);
        rope_theta None: no positional encoding at all (NoPE, the released checkpoints)
    d_mlp [intermediate_size], eps [rms_norm_eps]; the delta mixer's gated norm has eps 1e-5 (HF fixes it)

    delta layer:      resid = resid + mixer(ln1(resid));      resid = resid + mlp(ln2(resid))
    attention layer:  resid = resid + ln1_post(attn(resid));  resid = resid + ln2_post(mlp(resid))
The attention layers' steps read the residual itself (ln1 and ln2 are identities there).

Hooks: delta_mixer.py (blocks.{l}.mixer), attention.py (blocks.{l}.attn), mlp.py, block.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.delta_mixer import DeltaMixer, DeltaSpec
from hooked.models.heads_norm import HeadsRMSNorm
from hooked.models.hybrid import check_kinds
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.norms import NoNorm, RMSNorm
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("delta", "attention")
GATED_NORM_EPS = 1e-5  # HF's OlmoHybridGatedDeltaNet fixes its output norm's eps (FLA's default)


@dataclass(frozen=True)
class OlmoHybridConfig:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int  # value heads of the delta layers
    n_k_heads: int
    d_k: int
    d_v: int
    d_mlp: int
    d_conv: int = 4
    neg_eigval: bool = True
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: c.d_model // c.n_attn_heads)
    rope_theta: float | None = None  # None: NoPE
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    act_fn: str = "silu"
    eps: float = 1e-6
    tied: bool = False
    n_ctx: int = 65536
    chunk_size: int = 64

    def __post_init__(self) -> None:
        kinds = check_kinds("layer_types", self.layer_types, len(self.layer_types), LAYER_TYPES)
        object.__setattr__(self, "layer_types", kinds)
        self.mixer  # validates the delta layers' sizes

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mixer(self) -> DeltaSpec:
        return DeltaSpec(self.d_model, self.n_heads, self.n_k_heads, self.d_k, self.d_v, self.d_conv,
                         eps=GATED_NORM_EPS, beta_scale=2.0 if self.neg_eigval else 1.0, chunk_size=self.chunk_size,
                         conv_act=self.act_fn)

    @property
    def rotary(self) -> Rotary | None:
        return None if self.rope_theta is None else Rotary.of(self.d_attn_head, self.rope_theta, self.rope_scaling)


class OlmoDeltaMixer(DeltaMixer):
    """OLMo-hybrid's projections: q_proj, k_proj, v_proj (the conv input), g_proj (the gate), b_proj, a_proj."""

    def __init__(self, spec: DeltaSpec) -> None:
        super().__init__(spec)
        d = spec.d_model
        self.q_proj, self.k_proj = nn.Linear(d, spec.key_dim, bias=False), nn.Linear(d, spec.key_dim, bias=False)
        self.v_proj, self.g_proj = nn.Linear(d, spec.value_dim, bias=False), nn.Linear(d, spec.value_dim, bias=False)
        self.b_proj, self.a_proj = nn.Linear(d, spec.n_heads, bias=False), nn.Linear(d, spec.n_heads, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv, self.g_proj(x), self.b_proj(x), self.a_proj(x)

    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.b_proj, self.a_proj]


def build(cfg: OlmoHybridConfig) -> LanguageModel:
    """OLMo-hybrid; delta layers `blocks.{l}.mixer` (pre-norm), attention layers `blocks.{l}.attn` (post-norm)."""
    rotary, spec, d = cfg.rotary, cfg.mixer, cfg.d_model
    blocks = []
    for kind in cfg.layer_types:
        mlp = GatedMLP(d, cfg.d_mlp, cfg.act_fn)
        if kind == "delta":
            blocks.append(ResidualBlock([Sublayer("mixer", RMSNorm(d, cfg.eps), OlmoDeltaMixer(spec)),
                                         Sublayer("mlp", RMSNorm(d, cfg.eps), mlp)]))
            continue
        heads, kv_heads, d_head = cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head
        attn = Attention(d, heads, kv_heads, d_head, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         rotary=rotary, q_norm=HeadsRMSNorm(heads, d_head, cfg.eps),
                         k_norm=HeadsRMSNorm(kv_heads, d_head, cfg.eps))
        blocks.append(ResidualBlock([Sublayer("attn", NoNorm(), attn, post_norm=RMSNorm(d, cfg.eps)),
                                     Sublayer("mlp", NoNorm(), mlp, post_norm=RMSNorm(d, cfg.eps))]))
    return LanguageModel(cfg, blocks, RMSNorm(d, cfg.eps))
