"""Llamba (Cartesia, Bick et al. 2025): Llama-3 blocks whose attention is a discrete Mamba-2 mixer.

Glossary (TransformerLens / mamba2.py names; Cartesia's config.json names in brackets)
    n_layers [n_layer]  d_model [d_model]  d_mlp [mlp_cfg.intermediate_size]  act_fn [mlp_cfg.act_fn]
    d_vocab  [vocab_size rounded up to a multiple of pad_vocab_size_multiple]
    n_heads  [ssm_cfg.n_v_heads]: SSM heads, each d_head = d_inner / n_heads channels of x
    n_groups [ssm_cfg.n_qk_heads]: B and C heads; head h reads group h // (n_heads / n_groups), the
             grouping of grouped-query attention (n_groups < n_heads) or multi-head (n_groups = n_heads)
    d_inner  [ssm_cfg.expand * d_model]  d_state [ssm_cfg.d_state]  d_conv [ssm_cfg.d_conv]
    proj_bias [ssm_cfg.bias]  eps (the block norms: Cartesia fixes 1e-5)  final_eps [norm_epsilon]
    tied [tie_embeddings]

Discrete Mamba-2 mixer, per head (what differs from Mamba-2 in brackets):
    xBC, z, dt_raw = in_proj(x)               [order: xBC first; no dt_bias]
    x, B, C = split(conv(xBC))                [identity activation after the conv]
    dt = softplus(dt_raw); A = -1             [A fixed for every head: the A_log buffer is 0]
    u = x / dt                                [the scan input; dt u = x, so h_t = e^{-dt_t} h_{t-1} + x_t B_t]
    h_t = exp(dt_t A) h_{t-1} + dt_t u_t (outer) B_t;  y_t = h_t . C_t      (Mamba-2's SSD, unchanged)
    ssm_out = y + D x                         [the D skip reads x, not u]
    out = out_proj(ssm_out * SiLU(z + z_bias)) [no norm; z_bias only without ssm_cfg.bias]
Block: resid += mixer(ln1(resid)); resid += SwiGLU(ln2(resid)); logits = ln_final(resid) @ W_U^T.

Hooks: mamba2.py's, same names, shapes and order. hook_ssm_in is u = x / dt, so hook_kernel,
hook_h and the knockout cuts are Mamba-2's exactly; hook_gate is z + z_bias (SiLU's argument),
hook_gated is ssm_out * SiLU(gate). u is computed from softplus(dt_raw) before hook_dt fires: an edit
of hook_dt changes the discretisation (A_bar, B_bar) the scan uses, not u (edit hook_ssm_in for that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dataclasses import dataclass
from einops import rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.models.base import Context
from hooked.models.config import derived
from hooked.models.hybrid import pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.ops.conv import causal_conv1d
from hooked.ops.fused import causal_conv1d_fused


@dataclass(frozen=True)
class LlambaConfig:
    n_layers: int
    d_model: int
    d_vocab: int  # padded to pad_vocab_size_multiple
    d_mlp: int
    n_heads: int  # H, value heads [n_v_heads]
    n_groups: int  # G, B/C heads [n_qk_heads]
    d_state: int = 64  # N
    d_inner: int = derived(lambda c: c.d_model)  # expand * d_model
    d_head: int = derived(lambda c: c.d_inner // c.n_heads)  # P
    d_conv: int = 4
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj (ssm_cfg.bias); without it, z_bias
    mlp_bias: bool = False
    act_fn: str = "silu"
    eps: float = 1e-5  # the block norms (Cartesia's code fixes 1e-5)
    final_eps: float = 1e-5  # the final norm [norm_epsilon]
    tied: bool = False
    n_ctx: int = 131072  # no positional limit in an SSM; kept for TransformerLens compatibility

    def __post_init__(self) -> None:
        if self.d_inner != self.n_heads * self.d_head:
            raise ValueError(f"d_inner ({self.d_inner}) must equal n_heads * d_head ({self.n_heads} * {self.d_head})")
        self.mixer  # validates the SSM fields (n_groups dividing n_heads)

    @property
    def mixer(self) -> Mamba2Spec:
        return Mamba2Spec(d_model=self.d_model, n_heads=self.n_heads, d_head=self.d_head, d_state=self.d_state,
                          n_groups=self.n_groups, d_conv=self.d_conv, chunk_size=self.chunk_size,
                          conv_bias=self.conv_bias, proj_bias=self.proj_bias, gate="silu_gate")


class DiscreteMamba2Mixer(Mamba2Mixer):
    """Mamba2Mixer with Llamba's in_proj order, identity conv activation, A = -1, u = x / dt, D x and z_bias;
    the scan, the lazy hooks, the kernels, the cuts and the decode state are Mamba-2's."""

    def __init__(self, spec: Mamba2Spec) -> None:
        if spec.gate != "silu_gate":
            raise ValueError(f"the discrete Mamba-2 mixer gates with silu_gate (no norm), got {spec.gate!r}")
        super().__init__(spec)
        del self.dt_bias  # softplus(dt_raw) itself
        del self.A_log
        self.register_buffer("A_log", torch.zeros(self.n_heads), persistent=False)  # A = -exp(0) = -1
        self.z_bias = None if spec.proj_bias else nn.Parameter(torch.zeros(self.d_inner))

    def in_proj_starts(self) -> dict[str, int]:
        """Llamba's in_proj order: x, B, C first, then z, then dt."""
        return {"xBC": 0, "z": self.conv_dim, "dt": self.conv_dim + self.d_inner}

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        mask = None if ctx.attention_mask is None else ctx.attention_mask[..., None].to(x.dtype)
        if mask is not None:  # padding enters the mixer, and the conv, as zeros: the state stays 0
            x = x * mask
        xBC, gate, dt = self.in_proj(x).split([self.conv_dim, self.d_inner, self.n_heads], dim=-1)
        if mask is not None:
            xBC = xBC * mask
        xBC = self.hook_in(xBC)
        gate = gate if self.z_bias is None else gate + self.z_bias
        gate = self.hook_gate(gate)
        ssm_dtype = torch.promote_types(x.dtype, torch.float32)
        backend = backends.scan_backend(self, x.device, ssm_dtype, op="mamba_chunk_scan_combined")
        conv = self._conv(xBC, ctx, backend)
        conv = self.hook_conv(conv)
        xBC = conv if mask is None else conv * mask  # identity activation
        gs = self.n_groups * self.d_state
        x_in, B, C = xBC.to(ssm_dtype).split([self.d_inner, gs, gs], -1)
        x_heads = rearrange(x_in, "b l (h p) -> b l h p", p=self.d_head)
        dt = F.softplus(dt.to(ssm_dtype))
        ssm_in = self.hook_ssm_in(x_heads / dt[..., None])
        dt = self.hook_dt(dt)
        B = self.hook_B(rearrange(B, "b l (g n) -> b l g n", g=self.n_groups))
        C = self.hook_C(rearrange(C, "b l (g n) -> b l g n", g=self.n_groups))
        if ctx.state is None:
            y = self._scan(ssm_in, dt, self.A().to(ssm_dtype), B, C, backend)
        else:  # decoding: continue from the state the previous positions left
            ctx.state.refuse_lazy(self, [self.hook_A_bar, self.hook_B_bar, self.hook_h, self.hook_kernel])
            y, h = self.state_scan(ssm_in, dt, B, C, ctx.state.ssm_state(self), backend)
            ctx.state.set_ssm_state(self, h)
        y = self.hook_y(y)
        ssm_out = self.hook_ssm_out(y + self.D.to(ssm_dtype)[:, None] * x_heads)
        gated = self.norm(rearrange(ssm_out, "b l h p -> b l (h p)"), gate).to(x.dtype)
        gated = self.hook_gated(gated)
        return self._out_proj(gated)

    def _conv(self, xBC: Float[Tensor, "batch pos conv_dim"], ctx: Context, backend: str) -> Tensor:
        """The causal depthwise conv (no activation); while decoding it also reads the state's window."""
        if ctx.state is None and backend == "fused":
            return causal_conv1d_fused(xBC, self.conv_weight, self.conv_bias,
                                       kernels=backends.fused_kernels(xBC.device)).contiguous()
        if ctx.state is None:
            return causal_conv1d(xBC, self.conv_weight, self.conv_bias).contiguous()
        window = ctx.state.conv_window(self, xBC, self.conv_weight.shape[1])
        return causal_conv1d(window, self.conv_weight, self.conv_bias)[:, window.shape[1] - xBC.shape[1]:].contiguous()


def build(cfg: LlambaConfig) -> LanguageModel:
    """Llamba: n_layers x (RMSNorm, DiscreteMamba2Mixer; RMSNorm, SwiGLU) -> RMSNorm -> unembed."""
    blocks = [pre_norm_block(cfg.d_model, cfg.eps, ("mixer", DiscreteMamba2Mixer(cfg.mixer)),
                             ("mlp", GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)))
              for _ in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.final_eps))
