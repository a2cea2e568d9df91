"""Mamba-2 (Dao & Gu 2024): the SSD mixer with every state and kernel entry hookable.

Glossary (shape word in annotations, einops letter, paper symbol):
    batch      b          sequences
    pos        l     T    position; kernel rows q_pos = target j, columns k_pos = source i
    d_model    m          residual width
    d_inner    (h p)      expand * d_model = n_heads * d_head
    n_heads    h     H    SSM heads; head h reads group h // (n_heads // n_groups)
    d_head     p     P    channels per head
    n_groups   g     G    groups sharing one B and one C
    d_state    n     N    state size
    conv_dim   c          d_inner + 2 * n_groups * d_state: x, B and C go through the conv together
    u                     the SSM input x of the paper (hook_ssm_in), called u so that x stays free
    h                     the SSM state [d_head d_state] per head (never called x)

Mixer, per head (A = -exp(A_log) < 0 a scalar per head, D a scalar per head):
    z, xBC, dt_raw = in_proj(x)                  gate, conv input, step sizes
    u, B, C = split(SiLU(conv(xBC)))
    dt = clamp(softplus(dt_raw + dt_bias), dt_limit)
    h_t = exp(dt_t A) h_{t-1} + dt_t u_t (outer) B_t      A_bar = exp(dt A), B_bar = dt B (Euler)
    y_t = h_t . C_t;   ssm_out = y + D u
    out = out_proj(gated_rms_norm(ssm_out, z))
The scan runs in float32 (float64 for a float64 model), as HF's torch path does.

Hooks under blocks.{l}.mixer., in forward order (DESIGN.md sections 3 and 4):
    hook_in [b l c], hook_gate [b l d_inner], hook_conv [b l c], hook_ssm_in [b l h p],
    hook_dt [b l h], hook_B / hook_C [b l g n], hook_A_bar [b l h], hook_B_bar [b l h n],
    hook_h [b l h p n], hook_kernel [b h q_pos k_pos], hook_y [b l h p], hook_ssm_out [b l h p],
    hook_gated [b l d_inner], hook_head_out [b l h d_model].
A_bar, B_bar, h, kernel and head_out are lazy: built only when their hook is active (or, for
A_bar and B_bar, when h needs them). With no hooks the forward is the chunked SSD alone.
Backends, per forward (hooked/backends.py): y is the chunked SSD for "loop" and "chunked", whose
states (hook_h, edits) come from the sequential and the two-level scan respectively; "fused" is
mamba-ssm's mamba_chunk_scan_combined (a decoding step: selective_state_update), the conv through
causal_conv1d_fn or fla's Triton conv and the gated norm through mamba-ssm's Triton rmsnorm_fn (or
stand-ins with their semantics, ops/fused.py), fed the hooked u, dt, B, C; no lazy hook is active then.
Edits propagate: dt, B, C feed everything after them; an edited A_bar or B_bar is what the scan
uses; a state returned by a hook of h is SET for each head whose state differs from what the hook received and the
recurrence continues from it (hooked/state_edit.py; ops/set_scan.py continues the segments between
set positions), y = C . h on those states; an edited kernel
adds (K' - K) u to y; an edited head_out is summed into the mixer output. A lazy quantity whose
hook changed nothing leaves the fast path's numbers bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.gated_norm import GatedRMSNorm, NormThenGate, SiluGate
from hooked.models.head_writes import written_by_units
from hooked.models.language_model import LanguageModel
from hooked.models.norms import RMSNorm
from hooked.models.protocol import Heads, StateSpaceMixer, TokenMixer
from hooked.ops.conv import causal_conv1d
from hooked.ops.fused import causal_conv1d_fused, rms_norm_gated_fused, ssd_fused
from hooked.ops.scan_chunked import linear_scan_chunked
from hooked.ops.ssd import linear_scan_heads, mamba2_kernel_pairs, ssd_chunked
from hooked.ops.set_scan import set_scan
from hooked.ops.ssd_kernel import mamba2_kernel_chunked, mamba2_kernel_cols, mamba2_kernel_discrete, mamba2_kernel_rows
from hooked.state_edit import through_state_hook
from hooked.weights import MixerWeights


GATES = ("gated_rms_norm", "norm_then_gate", "silu_gate")  # the step between the SSM and out_proj


@dataclass(frozen=True)
class Mamba2Spec:
    """One Mamba-2 mixer's sizes and options (every family with Mamba-2 layers builds one).

    gate: "gated_rms_norm" (RMSNorm(y * SiLU(z)) per group, HF's MambaRMSNormGated), "norm_then_gate"
        (weight * RMSNorm(y) * SiLU(z), Falcon-H1's mamba_norm_before_gate) or "silu_gate" (y * SiLU(z),
        no norm: Falcon-H1 without mamba_rms_norm).
    out_bias: out_proj's bias (default: as in_proj's; Falcon-H1's projectors_bias).
    in_multiplier, ssm_multipliers: muP scales (Falcon-H1): in_proj reads in_multiplier * x and its
        output sections z, x, B, C, dt are multiplied by the five ssm_multipliers.
    """

    d_model: int
    n_heads: int  # H
    d_head: int  # P
    d_state: int = 128  # N
    n_groups: int = 1  # G
    d_conv: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    eps: float = 1e-5  # the gated norm's
    dt_limit: tuple[float, float] = (0.0, math.inf)
    out_bias: bool = derived(lambda s: s.proj_bias)
    gate: str = "gated_rms_norm"
    in_multiplier: float = 1.0
    ssm_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        object.__setattr__(self, "ssm_multipliers", tuple(float(m) for m in self.ssm_multipliers))
        if self.n_heads % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide n_heads ({self.n_heads})")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if len(self.ssm_multipliers) != 5:
            raise ValueError(f"ssm_multipliers holds 5 scales (z, x, B, C, dt), got {len(self.ssm_multipliers)}")

    @classmethod
    def of(cls, cfg: Any, **changes: Any) -> "Mamba2Spec":
        """The spec of a family config that spells the SSM fields as Mamba2Config does (d_model, n_heads,
        d_head, d_state, n_groups, d_conv, chunk_size, conv_bias, proj_bias, eps, dt_limit), with `changes`."""
        fields = ("d_model", "n_heads", "d_head", "d_state", "n_groups", "d_conv", "chunk_size", "conv_bias",
                  "proj_bias", "eps", "dt_limit")
        return cls(**{f: getattr(cfg, f) for f in fields if f not in changes} | changes)

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.d_head

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def in_scale(self) -> Tensor | None:
        """The scale of each in_proj output (z, x by d_inner; B, C by n_groups * d_state; dt by n_heads)."""
        if all(m == 1.0 for m in self.ssm_multipliers):
            return None
        gs = self.n_groups * self.d_state
        sizes = (self.d_inner, self.d_inner, gs, gs, self.n_heads)
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, self.ssm_multipliers)])

    def make_gate(self) -> nn.Module:
        group = self.d_inner // self.n_groups
        if self.gate == "silu_gate":
            return SiluGate()
        if self.gate == "norm_then_gate":
            return NormThenGate(self.d_inner, group, self.eps)
        return GatedRMSNorm(self.d_inner, group, self.eps)


@dataclass(frozen=True)
class Mamba2Config:
    n_layers: int
    d_model: int
    n_heads: int  # H, SSM heads
    d_head: int  # P, channels per SSM head
    d_inner: int = derived(lambda c: c.n_heads * c.d_head)  # expand * d_model; must equal n_heads * d_head
    d_state: int = 128  # N
    n_groups: int = 1  # G, groups of heads sharing B and C
    d_conv: int = 4
    chunk_size: int = 256  # SSD chunk length; HF parity needs HF's value
    dt_limit: tuple[float, float] = (0.0, math.inf)  # HF time_step_limit: clamp of dt after softplus
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj biases
    eps: float = 1e-5  # every RMSNorm, the gated one included
    tied: bool = False  # unembed shares the embedding matrix
    d_vocab: int = 50288
    n_ctx: int = 2048  # no positional limit in an SSM; kept for TransformerLens compatibility

    def __post_init__(self) -> None:
        if self.d_inner != self.n_heads * self.d_head:
            raise ValueError(f"d_inner ({self.d_inner}) must equal n_heads * d_head ({self.n_heads * self.d_head})")
        self.mixer  # validates the mixer's fields

    @property
    def mixer(self) -> Mamba2Spec:
        return Mamba2Spec.of(self)

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


def _heads(BC: Float[Tensor, "batch pos n_groups d_state"], n_heads: int) -> Float[Tensor, "batch pos n_heads d_state"]:
    """Each head's B or C: head h reads group h // (n_heads // n_groups)."""
    return repeat(BC, "b l g n -> b l (g r) n", r=n_heads // BC.shape[2])


def _linear_scan_heads_chunked(
    A_bar: Float[Tensor, "batch pos n_heads"], X: Float[Tensor, "batch pos n_heads d_head d_state"]
) -> Float[Tensor, "batch pos n_heads d_head d_state"]:
    """linear_scan_heads by the two-level scan (ops/scan_chunked.py), heads and head channels as one axis."""
    batch, pos, n_heads, d_head, d_state = X.shape
    flat = (batch, pos, n_heads * d_head, d_state)
    A_bar = A_bar[..., None, None].expand_as(X).reshape(flat)
    return linear_scan_chunked(A_bar, X.reshape(flat)).view(X.shape)


class Mamba2Mixer(StateSpaceMixer, TokenMixer, MixerWeights, nn.Module):
    """The Mamba-2 mixer of a `Mamba2Spec` (its docstring lists the options). Its units are the SSM heads."""

    unit_tag = "M"
    kernel_pairs = staticmethod(mamba2_kernel_pairs)
    kernel_rows = staticmethod(mamba2_kernel_rows)
    kernel_cols = staticmethod(mamba2_kernel_cols)

    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        self.spec = spec
        d_inner, n_heads, d_conv = spec.d_inner, spec.n_heads, spec.d_conv
        self.d_inner, self.n_heads, self.d_head = d_inner, n_heads, spec.d_head
        self.d_state, self.n_groups, self.chunk_size = spec.d_state, spec.n_groups, spec.chunk_size
        self.dt_limit = spec.dt_limit
        self.conv_dim = spec.conv_dim
        self.in_proj = nn.Linear(spec.d_model, d_inner + self.conv_dim + n_heads, bias=spec.proj_bias)  # z, xBC, dt
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, d_conv).uniform_(-d_conv**-0.5, d_conv**-0.5))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if spec.conv_bias else None
        dt = torch.exp(torch.rand(n_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1 of dt in [1e-3, 0.1]
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = spec.make_gate()
        self.out_proj = nn.Linear(d_inner, spec.d_model, bias=spec.out_bias)
        self.in_multiplier = spec.in_multiplier
        self.register_buffer("in_scale", spec.in_scale(), persistent=False)
        self.dims = {"d_inner": d_inner, "n_heads": n_heads, "d_head": spec.d_head, "d_state": spec.d_state,
                     "n_groups": spec.n_groups, "conv_dim": self.conv_dim}

        self.hook_in = HookPoint("batch pos conv_dim")  # x, B, C before the conv
        self.hook_gate = HookPoint("batch pos d_inner")  # z, before SiLU
        self.hook_conv = HookPoint("batch pos conv_dim")  # conv output, before SiLU
        self.hook_ssm_in = HookPoint("batch pos n_heads d_head", element="wide")  # u
        self.hook_dt = HookPoint("batch pos n_heads", element="wide")  # after softplus and clamp
        self.hook_B = HookPoint("batch pos n_groups d_state", element="wide")
        self.hook_C = HookPoint("batch pos n_groups d_state", element="wide")
        self.hook_A_bar = HookPoint("batch pos n_heads", lazy=True, element="wide")  # exp(dt A), lazy
        self.hook_B_bar = HookPoint("batch pos n_heads d_state", lazy=True, element="wide")  # dt B, lazy
        self.hook_h = HookPoint("batch pos n_heads d_head d_state", lazy=True, element="wide")  # state after pos, lazy
        self.hook_kernel = HookPoint("batch n_heads q_pos k_pos", lazy=True, element="wide")  # lazy
        self.hook_y = HookPoint("batch pos n_heads d_head", element="wide")  # C . h
        self.hook_ssm_out = HookPoint("batch pos n_heads d_head", element="wide")  # y + D u
        self.hook_gated = HookPoint("batch pos d_inner")  # gated RMSNorm output
        self.hook_head_out = HookPoint("batch pos n_heads d_model", lazy=True)  # each head's write, lazy

    def in_proj_starts(self) -> dict[str, int]:
        """Where each part of in_proj's output starts: z, then x, B, C (the conv's input "xBC"), then dt."""
        return {"z": 0, "xBC": self.d_inner, "dt": self.d_inner + self.conv_dim}

    def input_linears(self) -> list[nn.Module]:
        return [self.in_proj]

    def output_bias(self) -> Tensor | None:
        return self.out_proj.bias

    def heads(self) -> Heads:
        """The SSM heads (d_head channels each), cut at hook_gated (before out_proj)."""
        return Heads(self.n_heads, self.d_head, self.hook_gated, "ssm", self.hook_head_out)

    def A(self) -> Float[Tensor, "n_heads"]:
        """A = -exp(A_log), the (negative) continuous decay rate of each head, in float32 or wider."""
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        mask = None if ctx.attention_mask is None else ctx.attention_mask[..., None].to(x.dtype)
        if mask is not None:  # padding enters the mixer, and the conv, as zeros: the state stays 0
            x = x * mask
        projected = self.in_proj(x if self.in_multiplier == 1.0 else x * self.in_multiplier)
        if self.in_scale is not None:
            projected = projected * self.in_scale.to(projected.dtype)
        gate, xBC, dt = projected.split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        if mask is not None:  # equal to HF without in_proj bias; with one, keeps padded rows exact
            xBC = xBC * mask
        xBC = self.hook_in(xBC)
        gate = self.hook_gate(gate)
        ssm_dtype = torch.promote_types(x.dtype, torch.float32)
        backend = backends.scan_backend(self, x.device, ssm_dtype, op="mamba_chunk_scan_combined")
        ran: list[str] = []  # the kernels called on the fused path (ops/fused.py)
        if ctx.state is None:
            conv = self._causal_conv(xBC, backend, ran).contiguous()  # a hook's clone has this layout
        else:  # decoding: the conv also reads the previous d_conv - 1 inputs
            window = ctx.state.conv_window(self, xBC, self.conv_weight.shape[1])
            conv = self._causal_conv(window, backend, ran)[:, window.shape[1] - xBC.shape[1]:].contiguous()
        conv = self.hook_conv(conv)
        xBC = F.silu(conv) if mask is None else F.silu(conv) * mask
        u, B, C = xBC.to(ssm_dtype).split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], -1)
        ssm_in = rearrange(u, "b l (h p) -> b l h p", p=self.d_head)
        ssm_in = self.hook_ssm_in(ssm_in)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.dt_limit).to(ssm_dtype)
        dt = self.hook_dt(dt)
        B = rearrange(B, "b l (g n) -> b l g n", g=self.n_groups)
        B = self.hook_B(B)
        C = rearrange(C, "b l (g n) -> b l g n", g=self.n_groups)
        C = self.hook_C(C)
        if ctx.state is None and backend == "fused":  # no lazy hook is active on this path
            y = ssd_fused(ssm_in, dt, self.A().to(ssm_dtype), B, C, self.chunk_size,
                          kernels=backends.fused_kernels(x.device), ran=ran)[0]
        elif ctx.state is None:
            y = self._scan(ssm_in, dt, self.A().to(ssm_dtype), B, C, backend)
        else:  # decoding: continue from the state the previous positions left
            ctx.state.refuse_lazy(self, [self.hook_A_bar, self.hook_B_bar, self.hook_h, self.hook_kernel])
            y, h = self.state_scan(ssm_in, dt, B, C, ctx.state.ssm_state(self), backend, ran=ran)
            ctx.state.set_ssm_state(self, h)
        y = self.hook_y(y)
        ssm_out = y + self.D.to(ssm_dtype)[:, None] * ssm_in
        ssm_out = self.hook_ssm_out(ssm_out)
        gated = self._gate(rearrange(ssm_out, "b l h p -> b l (h p)"), gate, backend, ran).to(x.dtype)
        self.last_kernels = tuple(ran)
        gated = self.hook_gated(gated)
        return self._out_proj(gated)

    def state_scan(self, u: Float[Tensor, "batch pos n_heads d_head"], dt: Float[Tensor, "batch pos n_heads"],
                   B: Float[Tensor, "batch pos n_groups d_state"], C: Float[Tensor, "batch pos n_groups d_state"],
                   h0: Float[Tensor, "batch n_heads d_head d_state"] | None,
                   backend: str = "loop", *, ran: list[str] | None = None) -> tuple[Tensor, Tensor]:
        """(y, h_last) of the recurrence from h0 (None: zero), chunked SSD in u's dtype (the scan's);
        backend "fused": mamba-ssm's kernels (one position: selective_state_update) or the stand-in."""
        chunk, A = min(self.chunk_size, u.shape[1]), self.A().to(u.dtype)
        if backend == "fused":
            return ssd_fused(u, dt, A, B, C, chunk, h0=h0, kernels=backends.fused_kernels(u.device), ran=ran)
        return ssd_chunked(u, dt, A, B, C, chunk, h0=h0)

    def _causal_conv(self, x: Float[Tensor, "batch pos conv_dim"], backend: str,
                     ran: list[str]) -> Float[Tensor, "batch pos conv_dim"]:
        """The causal conv (with its bias, no activation); on the fused backend through a kernel (ops/fused.py)."""
        if backend == "fused":
            return causal_conv1d_fused(x, self.conv_weight, self.conv_bias, kernels=backends.fused_kernels(x.device),
                                       ran=ran)
        return causal_conv1d(x, self.conv_weight, self.conv_bias)

    def _gate(self, y: Float[Tensor, "batch pos d_inner"], gate: Float[Tensor, "batch pos d_inner"], backend: str,
              ran: list[str]) -> Float[Tensor, "batch pos d_inner"]:
        """The step between the SSM and out_proj (self.norm); on the fused backend a gated RMSNorm runs as
        mamba-ssm's Triton kernel where it is there (ops/fused.py)."""
        norm = self.norm
        if backend == "fused" and isinstance(norm, (GatedRMSNorm, NormThenGate)):
            out = rms_norm_gated_fused(y, gate, norm.weight, norm.eps, norm.group_size, isinstance(norm, NormThenGate),
                                       kernels=backends.fused_kernels(y.device), ran=ran)
            if out is not None:
                return out
        return norm(y, gate)

    def _scan(
        self,
        u: Float[Tensor, "batch pos n_heads d_head"],
        dt: Float[Tensor, "batch pos n_heads"],
        A: Float[Tensor, "n_heads"],
        B: Float[Tensor, "batch pos n_groups d_state"],
        C: Float[Tensor, "batch pos n_groups d_state"],
        backend: str = "loop",
    ) -> Float[Tensor, "batch pos n_heads d_head"]:
        """y = C . h (no D skip) through the lazy hooks hook_A_bar, hook_B_bar, hook_h, hook_kernel.

        backend: "loop" (states by the sequential scan), "chunked" (by the two-level one) or "fused"
        (y by mamba-ssm's mamba_chunk_scan_combined or its stand-in; no lazy hook is active then)."""
        if backend == "fused":
            return ssd_fused(u, dt, A, B, C, self.chunk_size, kernels=backends.fused_kernels(u.device))[0]
        linear = _linear_scan_heads_chunked if backend == "chunked" else linear_scan_heads
        need_states = self.hook_h.is_active
        discrete_edited = False
        if need_states or self.hook_A_bar.is_active or self.hook_B_bar.is_active:
            A_bar, A_bar_was = through_hook(self.hook_A_bar, torch.exp(dt * A), lambda: torch.exp(dt * A))
            B_bar, B_bar_was = through_hook(self.hook_B_bar, dt[..., None] * _heads(B, self.n_heads),
                                             lambda: dt[..., None] * _heads(B, self.n_heads))
            discrete_edited = A_bar_was is not None or B_bar_was is not None

            def states_fn() -> Tensor:
                return linear(A_bar, einsum(u, B_bar, "b l h p, b l h n -> b l h p n"))

        C_heads = _heads(C, self.n_heads)
        if discrete_edited:  # the recurrence on the edited discrete tensors
            states = states_fn()
            y = einsum(states, C_heads, "b l h p n, b l h n -> b l h p")
        else:  # the fast path: chunked SSD, no per-position state
            states = None
            y, _ = ssd_chunked(u, dt, A, B, C, self.chunk_size)
        if need_states:
            edit = through_state_hook(self.hook_h, states if states is not None else states_fn(), states_fn,
                                      lambda e, fixed: set_scan(A_bar[..., None, None], e, fixed))
            if edit.clean is not None:  # y = C . h on the edited (set and continued) states
                y = edit.read_into(y, lambda h, at: einsum(h, C_heads[:, at], "b l h p n, b l h n -> b l h p"))
        if self.hook_kernel.is_active:
            if discrete_edited:
                kernel_fn = lambda: mamba2_kernel_discrete(A_bar, B_bar, C_heads)  # noqa: E731
            else:
                kernel_fn = lambda: mamba2_kernel_chunked(dt, A, B, C)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, kernel_fn(), kernel_fn)
            if kernel_was is not None:  # y_j += sum_i (K' - K)[j, i] u_i
                y = y + einsum(kernel - kernel_was, u, "b h j i, b i h p -> b j h p")
        return y

    def _out_proj(self, gated: Float[Tensor, "batch pos d_inner"]) -> Float[Tensor, "batch pos d_model"]:
        """out_proj(gated); with hook_head_out active, each head's write, summed when edited."""
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def head_writes(self, gated: Float[Tensor, "*batch pos d_inner"]) -> Float[Tensor, "*batch pos n_heads d_model"]:
        """Each head's write to the residual, out_proj without its bias (what hook_head_out holds)."""
        W_out = rearrange(self.out_proj.weight, "m (h p) -> h p m", p=self.d_head)
        per_head = rearrange(gated, "... l (h p) -> ... l h p", p=self.d_head)
        return einsum(per_head, W_out, "... l h p, h p m -> ... l h m")


def build(cfg: Mamba2Config) -> LanguageModel:
    """Mamba-2 with a hook on every quantity: embed -> n_layers x (RMSNorm, Mamba2Mixer) residual blocks
    -> RMSNorm -> unembed; load weights with `loaders`."""
    blocks = [ResidualBlock([Sublayer("mixer", RMSNorm(cfg.d_model, cfg.eps), Mamba2Mixer(cfg.mixer))])
              for _ in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embed_init_std=None)
