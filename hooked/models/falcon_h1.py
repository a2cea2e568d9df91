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

Hooks: decoder.py's ParallelBlock (hook_attn_out and hook_mixer_out are the two branches, multipliers
applied, before the sum), attention.py (blocks.{l}.attn.*), mamba2.py (blocks.{l}.mixer.*), mlp.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hooked.models.attention import Attention
from hooked.models.decoder import HybridLM, ParallelBlock
from hooked.models.gated_norm import GatedRMSNorm, NormThenGate, SiluGate
from hooked.models.mamba2 import Mamba2Mixer
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
    d_head: int | None = None  # P
    d_inner: int | None = None  # None: 2 * d_model
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
    n_attn_kv_heads: int | None = None
    d_attn_head: int | None = None
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
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        put("dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        put("ssm_multipliers", tuple(float(m) for m in self.ssm_multipliers))
        if len(self.ssm_multipliers) != 5:
            raise ValueError(f"ssm_multipliers holds 5 scales (z, x, B, C, dt), got {len(self.ssm_multipliers)}")
        if self.d_inner is None:
            put("d_inner", 2 * self.d_model)
        if self.d_head is None:
            put("d_head", self.d_inner // self.n_heads)
        if self.n_attn_kv_heads is None:
            put("n_attn_kv_heads", self.n_attn_heads)
        if self.d_attn_head is None:
            put("d_attn_head", self.d_model // self.n_attn_heads)

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(self.d_attn_head, self.rope_theta, self.rope_scaling)

    @property
    def mup_vector(self) -> Tensor:
        """The scale of each in_proj output: z and x by d_inner, B and C by n_groups * d_state, dt by n_heads."""
        gs = self.n_groups * self.d_state
        sizes = (self.d_inner, self.d_inner, gs, gs, self.n_heads)
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, self.ssm_multipliers)])


def falcon_mixer(cfg: FalconH1Config) -> Mamba2Mixer:
    group = cfg.d_inner // cfg.n_groups
    if not cfg.ssm_norm:
        norm: nn.Module = SiluGate()
    elif cfg.norm_before_gate:
        norm = NormThenGate(cfg.d_inner, group, cfg.eps)
    else:
        norm = GatedRMSNorm(cfg.d_inner, group, cfg.eps)
    scale = cfg.mup_vector if any(m != 1.0 for m in cfg.ssm_multipliers) else None
    return Mamba2Mixer(cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.d_head, cfg.d_state, cfg.n_groups, cfg.d_conv,
                       cfg.chunk_size, cfg.conv_bias, cfg.proj_bias, cfg.eps, cfg.dt_limit, out_bias=cfg.out_bias,
                       norm=norm, in_multiplier=cfg.ssm_in_multiplier, in_scale=scale)


class HookedFalconH1(HybridLM):
    """Falcon-H1: every layer a ParallelBlock of `blocks.{l}.attn` and `blocks.{l}.mixer`, then `blocks.{l}.mlp`."""

    def __init__(self, cfg: FalconH1Config) -> None:
        rotary = cfg.rotary
        blocks = []
        for _ in range(cfg.n_layers):
            attn = Attention(cfg.d_model, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head,
                             qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, rotary=rotary,
                             scale=cfg.key_multiplier * cfg.d_attn_head**-0.5)
            mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias,
                           gate_multiplier=cfg.mlp_gate_multiplier, out_multiplier=cfg.mlp_down_multiplier)
            blocks.append(ParallelBlock(RMSNorm(cfg.d_model, cfg.eps), attn, falcon_mixer(cfg),
                                        RMSNorm(cfg.d_model, cfg.eps), mlp, cfg.attention_in_multiplier,
                                        cfg.attention_out_multiplier, cfg.ssm_out_multiplier))
        super().__init__(cfg, blocks, cfg.embedding_multiplier, cfg.lm_head_multiplier)
        nn.init.normal_(self.embed.weight, std=0.02)
