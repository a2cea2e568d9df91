"""Falcon-H1 (TII 2025): attention and Mamba-2 side by side in every layer, their outputs summed; muP scales.

Glossary (TransformerLens / SSM names; HF FalconH1Config names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]  d_mlp [intermediate_size]
    Mamba-2 branch: n_heads [mamba_n_heads], d_head [mamba_d_head], d_inner [mamba_d_ssm, or
        mamba_expand * hidden_size], d_state, n_groups, d_conv, chunk_size, dt_limit [time_step_limit],
        conv_bias [mamba_conv_bias], proj_bias [mamba_proj_bias: in_proj], out_bias [projectors_bias: out_proj],
        ssm_norm [mamba_rms_norm]: gated RMSNorm between the SSM and out_proj, else y * SiLU(z);
        norm_before_gate [mamba_norm_before_gate]: weight * norm(y) * SiLU(z) instead of norm(y * SiLU(z))
    attention branch: n_attn_heads, n_attn_kv_heads, d_attn_head [head_dim or hidden_size / heads],
        full rotary (rope_theta, rope_scaling), attention_bias
    muP multipliers, as explicit fields (HF names):
        embedding_multiplier (embedding), lm_head_multiplier (logits),
        attention_in_multiplier (attention's input), attention_out_multiplier (attention's output),
        key_multiplier (keys: folded into the attention scale, q.(m k) = m q.k; hook_k is k_proj's output),
        ssm_in_multiplier (in_proj's input), ssm_multipliers (5 scales on in_proj's output sections
        z, x, B, C, dt: the "mup vector"), ssm_out_multiplier (the mixer's output),
        mlp_gate_multiplier, mlp_down_multiplier [mlp_multipliers]: act(m_g * gate(x)) * up(x), then down * m_d

    resid_0 = embedding_multiplier * W_E[token]                                       hook_embed
    layer l: x = ln1(resid)
             resid = resid + ssm_out_multiplier * mixer(x) + attention_out_multiplier * attn(attention_in_multiplier * x)
             resid = resid + mlp(ln2(resid))
    logits = lm_head_multiplier * ln_final(resid) @ W_U^T

Hooks: block.py's Parallel step (hook_attn_out and hook_mixer_out are the two branches, multipliers
applied, before the sum), attention.py (blocks.{l}.attn.*), mamba2.py (blocks.{l}.mixer.*), mlp.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hooked.models.block import Branch, Parallel, ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.hybrid import hybrid_attention
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class FalconH1Config:
    n_layers: int
    d_model: int
    d_vocab: int
    d_mlp: int
    n_heads: int  # H, SSM heads
    d_head: int = derived(lambda c: c.d_inner // c.n_heads)  # P
    d_inner: int = derived(lambda c: 2 * c.d_model)
    d_state: int = 256
    n_groups: int = 1
    d_conv: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj
    out_bias: bool = False  # out_proj (HF projectors_bias)
    ssm_norm: bool = False  # HF mamba_rms_norm
    norm_before_gate: bool = True  # HF mamba_norm_before_gate (with ssm_norm)
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: c.d_model // c.n_attn_heads)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    mlp_bias: bool = False
    act_fn: str = "silu"
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt
    ssm_out_multiplier: float = 1.0
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0
    eps: float = 1e-5
    tied: bool = False
    n_ctx: int = 8192

    def __post_init__(self) -> None:
        object.__setattr__(self, "dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        object.__setattr__(self, "ssm_multipliers", tuple(float(m) for m in self.ssm_multipliers))
        if self.d_inner != self.n_heads * self.d_head:
            raise ValueError(f"d_inner ({self.d_inner}) must equal n_heads * d_head ({self.n_heads} * {self.d_head})")
        self.mixer  # validates the SSM fields

    @property
    def mixer(self) -> Mamba2Spec:
        gate = "silu_gate" if not self.ssm_norm else "norm_then_gate" if self.norm_before_gate else "gated_rms_norm"
        return Mamba2Spec.of(self, out_bias=self.out_bias, gate=gate, in_multiplier=self.ssm_in_multiplier,
                             ssm_multipliers=self.ssm_multipliers)

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(self.d_attn_head, self.rope_theta, self.rope_scaling)


def build(cfg: FalconH1Config) -> LanguageModel:
    """Falcon-H1: every layer a parallel step of `blocks.{l}.mixer` and `blocks.{l}.attn`, then `blocks.{l}.mlp`."""
    rotary, mixer = cfg.rotary, cfg.mixer
    blocks = []
    for _ in range(cfg.n_layers):
        attn = hybrid_attention(cfg, bias=cfg.attention_bias, rotary=rotary,
                                scale=cfg.key_multiplier * cfg.d_attn_head**-0.5)
        mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias,
                       gate_multiplier=cfg.mlp_gate_multiplier, out_multiplier=cfg.mlp_down_multiplier)
        branches = (Branch("mixer", Mamba2Mixer(mixer), out_scale=cfg.ssm_out_multiplier),
                    Branch("attn", attn, in_scale=cfg.attention_in_multiplier, out_scale=cfg.attention_out_multiplier))
        blocks.append(ResidualBlock([Parallel(RMSNorm(cfg.d_model, cfg.eps), branches),
                                     Sublayer("mlp", RMSNorm(cfg.d_model, cfg.eps), mlp)]))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embedding_multiplier=cfg.embedding_multiplier,
                         logit_multiplier=cfg.lm_head_multiplier)
