"""Mamba-1 (Gu & Dao 2023) and FalconMamba, with every quantity of the selective scan hookable.

Glossary (axis word in code = paper symbol)
    batch     b
    pos       l, t       sequence position (q_pos / k_pos: target j / source i of the kernel)
    d_model   D          residual width
    d_inner   E*D        mixer channels (expand * d_model); for ablation a channel is a "head"
    d_state   N          state size per channel
    dt_rank   R          rank of the Δ projection
    d_conv               width of the depthwise causal conv
    u                    SSM input (hook_ssm_in), SiLU(conv(in_proj_x(x)))
    dt        Δ          softplus(dt_proj(x_proj(u)[:R])), per channel
    A                    -exp(A_log), [d_inner d_state], input independent
    A_bar, B_bar         exp(Δ·A) and Δ·B: B_bar is the Euler step HF and mamba-ssm use, not ZOH
    h                    the state, [d_inner d_state] per position: h_t = A_bar_t * h_{t-1} + B_bar_t * u_t
    y                    C_t · h_t (sum over d_state), before the D skip

Mixer hooks, under blocks.{l}.mixer., in forward order (DESIGN.md sections 3 and 4):
    hook_in [b l d_inner] -> hook_gate [b l d_inner] -> hook_conv [b l d_inner] (before SiLU)
    -> hook_ssm_in [b l d_inner] -> hook_dt [b l d_inner] -> hook_B, hook_C [b l d_state]
    -> hook_A_bar, hook_B_bar, hook_h [b l d_inner d_state] -> hook_kernel [b d_inner q_pos k_pos]
    -> hook_y, hook_ssm_out, hook_gated [b l d_inner] -> hook_head_out [b l d_inner d_model]
A_bar, B_bar, h, kernel and head_out are lazy: built only when their HookPoint is active. Without
them the scan is `selective_scan`, which never holds a [b l d_inner d_state] tensor.

Backends, per forward (hooked/backends.py): "loop" (selective_scan, linear_scan: one step per
position, the CPU's default), "chunked" (their two-level versions, ops/scan_chunked.py: O(L / Q + Q)
ops, the lazy hooks too) or "fused" (mamba-ssm's selective_scan_fn and causal_conv1d_fn, or
stand-ins with their semantics; no lazy hook can be active then). Every backend is fed the hooked
tensors: hook_in, hook_conv, hook_ssm_in, hook_dt, hook_B, hook_C fire before it and their edits
propagate; hook_y and after fire on its output.

Edits propagate. dt, B, C feed everything after them. Edited A_bar / B_bar are what the scan
uses (`linear_scan` on the discrete tensors). A state returned by a hook of h is SET for each channel
where it differs from what the hook received, and the recurrence continues from it (hooked/state_edit.py,
ops/set_scan.py); y = C . h on those states. An edit of the kernel adds (K' - K)·u to y. An edit of head_out makes the mixer output
head_out.sum(d_inner) (+ out_proj bias). Unedited lazy hooks leave the fast path's numbers
untouched (bit-identical logits); an in-place edit is seen through the tensor's version counter
(under torch.inference_mode, by comparing with a copy).

Zamba's grouped Mamba-1 (grouped_mamba.py) is this mixer with per-group x_proj / dt_proj (`selection`) and the
per-group ops in its class attributes (scan_loop, kernel_dense, ...: hooked/ops/grouped_selective.py).
FalconMamba = Mamba-1 plus weightless RMS norms on the Δ input (dt_rank wide), B and C, turned on
by `MambaConfig.mixer_rms_eps`; Jamba's Mamba layers give those norms weights (`mixer_norm_weights`).
Padding (Context.attention_mask) zeroes the mixer input, the conv input and the conv output at
padded positions, as HF's slow path does: a left-padded row keeps a zero state until its first
real token, so it equals the prompt run alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import einsum
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.decode_state import DecodeState
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.head_writes import written_by_units
from hooked.models.language_model import LanguageModel
from hooked.models.norms import RMSNorm
from hooked.models.protocol import Heads, StateSpaceMixer, TokenMixer
from hooked.ops.conv import causal_conv1d
from hooked.ops.fused import causal_conv1d_fused, selective_scan_fused
from hooked.ops.scan_chunked import linear_scan_chunked, selective_scan_chunked
from hooked.ops.selective_kernel import mamba1_kernel_chunked, mamba1_kernel_cols, mamba1_kernel_rows
from hooked.ops.selective_scan import linear_scan, mamba1_kernel_discrete, mamba1_kernel_pairs, selective_scan
from hooked.ops.set_scan import set_scan
from hooked.state_edit import through_state_hook
from hooked.weights import MixerWeights

HEAD_OUT_BUDGET_BYTES = 2 * 1024**3  # hook_head_out is refused above this size (it is b*l*d_inner*d_model)


@dataclass(frozen=True)
class MambaSpec:
    """One Mamba-1 mixer's sizes and options (MambaConfig.mixer; Jamba's Mamba layers)."""

    d_model: int
    d_inner: int  # E*D
    d_state: int = 16  # N
    d_conv: int = 4
    dt_rank: int = derived(lambda s: math.ceil(s.d_model / 16))  # R, HF's "auto"
    conv_bias: bool = True
    proj_bias: bool = False  # bias of in_proj and out_proj (HF use_bias)
    mixer_rms_eps: float | None = None  # FalconMamba: weightless RMS norms on Δ input, B, C
    mixer_norm_weights: bool = False  # Jamba: those norms have weights (dt_norm_weight, B_norm_weight, C_norm_weight)

    def __post_init__(self) -> None:
        if self.mixer_norm_weights and self.mixer_rms_eps is None:
            raise ValueError("mixer_norm_weights needs mixer_rms_eps (the norms they weight)")


@dataclass(frozen=True)
class MambaConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    d_inner: int = derived(lambda c: 2 * c.d_model)  # E*D
    d_state: int = 16  # N
    d_conv: int = 4
    dt_rank: int = derived(lambda c: math.ceil(c.d_model / 16))  # R, HF's "auto"
    n_ctx: int = 2048  # informational: the scan has no position limit
    eps: float = 1e-5  # block and final RMSNorm
    conv_bias: bool = True
    proj_bias: bool = False  # bias of in_proj and out_proj (HF use_bias)
    tied: bool = True  # unembed shares the embedding matrix
    mixer_rms_eps: float | None = None  # FalconMamba: weightless RMS norms on Δ input, B, C
    mixer_norm_weights: bool = False  # Jamba: those norms have weights (dt_norm_weight, B_norm_weight, C_norm_weight)

    def __post_init__(self) -> None:
        self.mixer  # validates the mixer's fields

    @property
    def mixer(self) -> MambaSpec:
        return MambaSpec(self.d_model, self.d_inner, self.d_state, self.d_conv, self.dt_rank, self.conv_bias,
                         self.proj_bias, self.mixer_rms_eps, self.mixer_norm_weights)

    @property
    def n_heads(self) -> int:
        """For ablation a Mamba-1 "head" is one inner channel."""
        return self.d_inner

    @property
    def d_head(self) -> int:
        return 1

    @property
    def n_groups(self) -> int:
        """All channels read the same B and C."""
        return 1


class MambaMixer(StateSpaceMixer, TokenMixer, MixerWeights, nn.Module):
    """in_proj -> causal conv -> selective scan -> gate -> out_proj, all hooked. Its units are the
    d_inner channels (a Mamba-1 "head" is one channel)."""

    unit_tag = "M"
    # the scan's pure ops (hooked/ops); GroupedMambaMixer (grouped_mamba.py) swaps in their per-group versions
    kernel_pairs = staticmethod(mamba1_kernel_pairs)
    kernel_rows = staticmethod(mamba1_kernel_rows)
    kernel_cols = staticmethod(mamba1_kernel_cols)
    kernel_dense = staticmethod(mamba1_kernel_chunked)
    kernel_discrete = staticmethod(mamba1_kernel_discrete)
    scan_loop = staticmethod(selective_scan)
    scan_chunked = staticmethod(selective_scan_chunked)
    scan_fused = staticmethod(selective_scan_fused)

    def __init__(self, spec: MambaSpec) -> None:
        super().__init__()
        self.spec = cfg = spec
        d, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * d, bias=cfg.proj_bias)  # [in ; gate]
        self.conv_weight = nn.Parameter(torch.empty(d, cfg.d_conv))  # HF conv1d.weight [d 1 w] squeezed
        self.conv_bias = nn.Parameter(torch.zeros(d)) if cfg.conv_bias else None
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)  # [Δ input ; B ; C]
        self.dt_proj = nn.Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.empty(d, n))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, cfg.d_model, bias=cfg.proj_bias)
        if cfg.mixer_norm_weights:
            self.dt_norm_weight = nn.Parameter(torch.ones(r))
            self.B_norm_weight = nn.Parameter(torch.ones(n))
            self.C_norm_weight = nn.Parameter(torch.ones(n))
        self.reset_parameters()
        self.d_inner, self.d_state = d, n
        self.dims = {"d_inner": d, "d_state": n}

        self.hook_in = HookPoint("batch pos d_inner")
        self.hook_gate = HookPoint("batch pos d_inner")
        self.hook_conv = HookPoint("batch pos d_inner")
        self.hook_ssm_in = HookPoint("batch pos d_inner")
        self.hook_dt = HookPoint("batch pos d_inner")
        self.hook_B = HookPoint("batch pos d_state")
        self.hook_C = HookPoint("batch pos d_state")
        self.hook_A_bar = HookPoint("batch pos d_inner d_state", lazy=True, element="wide")  # lazy
        self.hook_B_bar = HookPoint("batch pos d_inner d_state", lazy=True, element="wide")  # lazy
        self.hook_h = HookPoint("batch pos d_inner d_state", lazy=True, element="wide")  # lazy
        self.hook_kernel = HookPoint("batch d_inner q_pos k_pos", lazy=True, element="wide")  # lazy
        self.hook_y = HookPoint("batch pos d_inner")
        self.hook_ssm_out = HookPoint("batch pos d_inner")
        self.hook_gated = HookPoint("batch pos d_inner")
        self.hook_head_out = HookPoint("batch pos d_inner d_model", lazy=True)  # lazy

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mamba's initialisation: S4D-real A, D = 1, Δ = softplus(bias) log-uniform in [1e-3, 1e-1]."""
        if self.A_log.is_meta:
            return
        d, n = self.A_log.shape
        self.A_log.copy_(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).expand(d, n))
        nn.init.kaiming_uniform_(self.conv_weight, a=math.sqrt(5))
        dt = torch.exp(torch.rand(d) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_proj.bias.copy_((dt + torch.log(-torch.expm1(-dt))).view_as(self.dt_proj.bias))  # inverse softplus

    def input_linears(self) -> list[nn.Module]:
        return [self.in_proj]

    def output_bias(self) -> Tensor | None:
        return self.out_proj.bias

    def heads(self) -> Heads:
        """The d_inner channels, cut at hook_gated (before out_proj)."""
        return Heads(self.d_inner, 1, self.hook_gated, "ssm", self.hook_head_out)

    def A(self) -> Float[Tensor, "d_inner d_state"]:
        """The continuous-time A = -exp(A_log), at least float32 (as HF computes it)."""
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        keep = None if ctx.attention_mask is None else ctx.attention_mask[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        in_, gate = self.in_proj(x).chunk(2, dim=-1)
        if keep is not None:
            in_ = in_ * keep  # a padded position feeds the conv zeros, as causal padding does
        in_ = self.hook_in(in_)
        gate = self.hook_gate(gate)
        backend = self.choose_backend(x.device, ctx)
        if ctx.state is None and backend == "fused":
            conv = causal_conv1d_fused(in_, self.conv_weight, self.conv_bias, kernels=backends.fused_kernels(x.device))
            conv = conv.contiguous()
        elif ctx.state is None:
            conv = causal_conv1d(in_, self.conv_weight, self.conv_bias).contiguous()  # a hook's clone has this layout
        else:  # decoding: the conv also reads the previous d_conv - 1 inputs
            window = ctx.state.conv_window(self, in_, self.spec.d_conv)
            conv = causal_conv1d(window, self.conv_weight, self.conv_bias)[:, window.shape[1] - in_.shape[1]:].contiguous()
        conv = self.hook_conv(conv)
        ssm_in = F.silu(conv) if keep is None else F.silu(conv) * keep
        ssm_in = self.hook_ssm_in(ssm_in)
        dt, B, C = self.selection(ssm_in)
        dt = self.hook_dt(dt)
        B = self.hook_B(B)
        C = self.hook_C(C)
        if ctx.state is None:
            y = self.scan(ssm_in, dt, B, C, backend)
        else:
            y = self.scan_from_state(ssm_in, dt, B, C, ctx.state, backend)
        y = self.hook_y(y)
        ssm_out = y + self.D.to(y.dtype) * ssm_in
        ssm_out = self.hook_ssm_out(ssm_out)
        gated = ssm_out * F.silu(gate)
        gated = self.hook_gated(gated)
        return self.write_out(gated)

    def selection(self, ssm_in: Float[Tensor, "batch pos d_inner"]) -> tuple[Tensor, Tensor, Tensor]:
        """(dt, B, C) from u: dt = softplus(dt_proj(x_proj(u)[:R])), B and C the rest of x_proj(u)."""
        # dt_proj.in_features is dt_rank, a derived field: its descriptor, instrumented under pytest, trips dynamo
        dt_in, B, C = self.x_proj(ssm_in).split([self.dt_proj.in_features, self.spec.d_state, self.spec.d_state], dim=-1)
        if self.spec.mixer_rms_eps is not None:  # FalconMamba; Jamba with weights
            dt_in, B, C = (_weightless_rms_norm(t, self.spec.mixer_rms_eps) for t in (dt_in, B, C))
            if self.spec.mixer_norm_weights:
                dt_in, B, C = dt_in * self.dt_norm_weight, B * self.B_norm_weight, C * self.C_norm_weight
        return F.softplus(self.dt_proj(dt_in)), B, C

    @staticmethod
    def B_bar(dt: Float[Tensor, "batch pos d_inner"], B: Float[Tensor, "batch pos d_state"]) -> Tensor:
        """B_bar = dt * B [batch pos d_inner d_state], the Euler step (not ZOH)."""
        return dt[..., None] * B[:, :, None, :]

    @staticmethod
    def read(h: Float[Tensor, "batch pos d_inner d_state"], C: Float[Tensor, "batch pos d_state"]) -> Tensor:
        """y = C . h [batch pos d_inner]."""
        return einsum(h, C, "b l d n, b l n -> b l d")

    def choose_backend(self, device: torch.device, ctx: Context) -> str:
        """This forward's scan backend (hooked/backends.py): "loop", "chunked" or "fused"."""
        initial = ctx.state is not None and ctx.state.ssm_state(self) is not None
        dtype = torch.promote_types(self.A_log.dtype, torch.float32)
        return backends.scan_backend(self, device, dtype, has_initial_state=initial)

    def scan(self, u: Float[Tensor, "batch pos d_inner"], dt: Float[Tensor, "batch pos d_inner"],
             B: Float[Tensor, "batch pos *group d_state"], C: Float[Tensor, "batch pos *group d_state"],
             backend: str = "loop") -> Float[Tensor, "batch pos d_inner"]:
        """y = C·h with the lazy hooks A_bar, B_bar, h, kernel; at least float32 inside (as HF). B, C: [b l d_state]
        ([b l n_groups d_state] for GroupedMambaMixer, whose class attributes give the per-group ops).

        backend: "loop" (sequential scans), "chunked" (two-level scans, states too) or "fused"
        (mamba-ssm's selective scan, or its stand-in; never with a lazy hook active)."""
        dtype = u.dtype
        A = self.A()
        u, dt, B, C = (t.to(A.dtype) for t in (u, dt, B, C))
        if backend == "fused":
            return self.scan_fused(u, dt, A, B, C, kernels=backends.fused_kernels(u.device))[0].to(dtype)
        linear = linear_scan_chunked if backend == "chunked" else linear_scan
        y = None
        A_bar = B_bar = None
        discrete_edited = False
        if self.hook_A_bar.is_active or self.hook_B_bar.is_active or self.hook_h.is_active:
            A_bar = torch.exp(dt[..., None] * A)  # [b l d n]
            A_bar, A_bar_was = through_hook(self.hook_A_bar, A_bar)
            B_bar = self.B_bar(dt, B)  # [b l d n], the Euler step Δ·B
            B_bar, B_bar_was = through_hook(self.hook_B_bar, B_bar)
            discrete_edited = A_bar_was is not None or B_bar_was is not None
        if self.hook_h.is_active or discrete_edited:
            h = linear(A_bar, B_bar * u[..., None])
            if discrete_edited:
                y = self.read(h, C)
            if self.hook_h.is_active:
                edit = through_state_hook(self.hook_h, h, lambda: linear(A_bar, B_bar * u[..., None]),
                                          lambda e, fixed: set_scan(A_bar, e, fixed))
                if edit.clean is not None:  # y = C . h on the edited states from the first one changed
                    if y is None:  # (before it the unedited y, to the bit)
                        y, _ = (self.scan_chunked if backend == "chunked" else self.scan_loop)(u, dt, A, B, C)
                    y = edit.read_into(y, lambda h, at: self.read(h, C[:, at]))
        if y is None:
            y, _ = (self.scan_chunked if backend == "chunked" else self.scan_loop)(u, dt, A, B, C)
        if self.hook_kernel.is_active:
            if discrete_edited:
                build = lambda: self.kernel_discrete(A_bar, B_bar, C)  # noqa: E731
            else:
                build = lambda: self.kernel_dense(dt, A, B, C)  # noqa: E731
            kernel, kernel_orig = through_hook(self.hook_kernel, build(), build)
            if kernel_orig is not None:
                y = y + einsum(kernel - kernel_orig, u, "b d j i, b i d -> b j d")
        return y.to(dtype)

    def head_writes(self, gated: Float[Tensor, "*batch pos d_inner"]) -> Float[Tensor, "*batch pos d_inner d_model"]:
        """Each channel's write to the residual, out_proj without its bias (what hook_head_out holds)."""
        return gated[..., None] * self.out_proj.weight.T

    def scan_from_state(self, u: Float[Tensor, "batch pos d_inner"], dt: Float[Tensor, "batch pos d_inner"],
                        B: Float[Tensor, "batch pos *group d_state"], C: Float[Tensor, "batch pos *group d_state"],
                        state: DecodeState, backend: str = "loop") -> Float[Tensor, "batch pos d_inner"]:
        """The scan continued from the state the previous positions left (incremental decoding).
        backend: as `scan` ("fused" only from a zero state: the kernel takes no initial state)."""
        state.refuse_lazy(self, [self.hook_A_bar, self.hook_B_bar, self.hook_h, self.hook_kernel])
        y, h = self.state_scan(u, dt, B, C, state.ssm_state(self), backend)
        state.set_ssm_state(self, h)
        return y.to(u.dtype)

    def state_scan(self, u: Float[Tensor, "batch pos d_inner"], dt: Float[Tensor, "batch pos d_inner"],
                   B: Float[Tensor, "batch pos *group d_state"], C: Float[Tensor, "batch pos *group d_state"],
                   h0: Float[Tensor, "batch d_inner d_state"] | None,
                   backend: str = "loop") -> tuple[Tensor, Tensor]:
        """(y, h_last) of the recurrence from h0 (None: zero), at least float32 (the state's dtype).
        backend: "loop" (the sequential scan), "chunked" or "fused" (mamba-ssm's kernel or its stand-in)."""
        A = self.A()
        u32, dt32, B32, C32 = (t.to(A.dtype) for t in (u, dt, B, C))
        if backend == "fused":
            return self.scan_fused(u32, dt32, A, B32, C32, h0, kernels=backends.fused_kernels(u.device))
        scan = self.scan_chunked if backend == "chunked" else self.scan_loop
        return scan(u32, dt32, A, B32, C32, h0=h0)

    def write_out(self, gated: Float[Tensor, "batch pos d_inner"]) -> Float[Tensor, "batch pos d_model"]:
        """out_proj(gated); with hook_head_out active, the sum of the per-channel writes."""
        if not self.hook_head_out.is_active:
            return self.out_proj(gated)
        batch, pos, d_inner = gated.shape
        size = batch * pos * d_inner * self.spec.d_model * gated.element_size()
        if size > HEAD_OUT_BUDGET_BYTES:
            raise ValueError(
                f"{self.hook_head_out.name}: one write per channel would be a [{batch}, {pos}, {d_inner}, "
                f"{self.spec.d_model}] tensor ({size / 2**30:.1f} GiB > HEAD_OUT_BUDGET_BYTES = "
                f"{HEAD_OUT_BUDGET_BYTES / 2**30:.1f} GiB); hook fewer tokens, or leave hook_head_out out of "
                "names_filter and use hook_gated with out_proj.weight instead"
            )
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)


def _weightless_rms_norm(t: Float[Tensor, "batch pos d"], eps: float) -> Float[Tensor, "batch pos d"]:
    """FalconMamba's norm on Δ input, B, C: t / rms(t), float32 inside, no weight."""
    t32 = t.to(torch.promote_types(t.dtype, torch.float32))
    return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)


def build(cfg: MambaConfig) -> LanguageModel:
    """Mamba-1 / FalconMamba with a hook on every quantity: embed -> n_layers x (RMSNorm, MambaMixer)
    residual blocks -> RMSNorm -> unembed; load weights with `loaders`."""
    blocks = [ResidualBlock([Sublayer("mixer", RMSNorm(cfg.d_model, cfg.eps), MambaMixer(cfg.mixer))])
              for _ in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embed_init_std=None)
