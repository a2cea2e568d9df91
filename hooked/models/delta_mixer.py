"""The gated delta rule mixer (Gated DeltaNet; KDA): every state and kernel entry hookable and editable.

Glossary (shape word in annotations, einops letter, paper symbol; hooked/ops/delta_rule.py has the rule):
    batch      b
    pos        l     t    position; kernel rows q_pos = target j, columns k_pos = source i
    d_model    m          residual width
    n_heads    h          value heads: each has its own state, beta, decay and output (the mixer's units)
    n_k_heads  g          query/key heads; value head h reads q/k head h // (n_heads // n_k_heads)
    d_k        c          key channels (the state's rows); d_v  value channels (its columns)
    conv_dim              2 n_k_heads d_k + n_heads d_v: q, k and v go through the short conv together
    h                     the state S_t [d_k d_v] per head (hook_h), never called x

Mixer, per value head (each family supplies `project`: its projection layout):
    qkv, gate, b, a = project(x)                    the conv input, the output gate, beta and decay inputs
    q, k, v = split(SiLU(conv(qkv)))                 q, k L2-normalised (hook_q, hook_k); q read times d_k^-1/2
    beta = beta_scale * sigmoid(b)                    (OLMo-hybrid: beta_scale 2, beta in [0, 2])
    alpha = exp(-exp(A_log) * softplus(a + dt_bias))  one per head, or one per key channel (KDA)
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,  y_t = S_t^T q_t
    out = out_proj(norm(y) * gate_fn(gate))           per head over d_v: normalise, then gate
The rule runs in float32 (float64 for a float64 model), as HF's torch paths do, in its chunked form.

Hooks under blocks.{l}.mixer., in forward order:
    hook_in [b l conv_dim], hook_gate [b l h d_v], hook_conv [b l conv_dim] (before SiLU),
    hook_q, hook_k [b l g d_k], hook_v [b l h d_v], hook_beta [b l h], hook_alpha [b l h] (KDA [b l h d_k]),
    hook_h [b l h d_k d_v] (lazy), hook_kernel [b h q_pos k_pos] (lazy), hook_y [b l h d_v],
    hook_gated [b l (h d_v)] (out_proj's input), hook_head_out [b l h d_model] (lazy).
Mixer protocol (protocol.py): the units are the value heads, cut at hook_gated (d_v each; hook_head_out
their writes); an edge (target j <- source i) is the kernel term A[j, i] v_i, removed from hook_y with
q, k, v, beta, alpha read from the same forward (ops.delta_rule_knockout: no pos x pos tensor), and with
cut_conv the sources' conv taps into the targets (a head's v channels; a q/k head's channels when every
value head reading it is cut). decay_norms: d_k * exp(-exp(A_log)), the decay summed over the state's
rows at softplus(a + dt_bias) = 1 (Mamba-2's ||exp(A)||_1 at dt = 1).

Edits propagate: q, k, v, beta, alpha are what the rule reads; a state returned by a hook of hook_h is
set there and the rule continues from it (hooked/state_edit.py; `delta_rule_carry`); an edited kernel
adds (A' - A) v to y; an edited head_out is summed into the output. With no lazy hook active the
forward is the chunked rule alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.decode_state import stepping_state
from hooked.models.head_writes import written_by_units
from hooked.models.mlp import activation
from hooked.models.protocol import (CutHooks, Heads, Masks, Mixing, RecurrentCut, TokenMixer, along, keeper,
                                    slicer)
from hooked.ops.conv import causal_conv1d
from hooked.ops.delta_rule import _per_head, delta_rule_carry, delta_rule_chunked, l2norm
from hooked.ops.delta_rule_kernel import (delta_rule_kernel, delta_rule_kernel_cols, delta_rule_kernel_rows,
                                          delta_rule_knockout)
from hooked.ops.fla_kernels import delta_rule_fused
from hooked.ops.fused import causal_conv1d_fused
from hooked.ops.norms import rms_norm_gated
from hooked.state_edit import through_state_hook
from hooked.weights import MixerWeights

GATE_FUNCTIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class DeltaSpec:
    """One delta-rule mixer's sizes and options.

    per_channel_decay: KDA (Kimi Linear): alpha per key channel, dt_bias [n_heads d_k]; else one per head.
    gate_fn: the output gate's activation after the norm ("silu": Qwen, OLMo; "sigmoid": Kimi).
    beta_scale: 2 lets beta reach [0, 2] (OLMo-hybrid's linear_allow_neg_eigval).
    conv_act: the short conv's activation (HF applies the config's hidden_act there, as in the MLP).
    """

    d_model: int
    n_heads: int  # value heads
    n_k_heads: int
    d_k: int
    d_v: int
    d_conv: int = 4
    eps: float = 1e-6  # the gated norm's
    gate_fn: str = "silu"
    beta_scale: float = 1.0
    per_channel_decay: bool = False
    chunk_size: int = 64
    conv_act: str = "silu"

    def __post_init__(self) -> None:
        if self.n_heads % self.n_k_heads:
            raise ValueError(f"value heads ({self.n_heads}) must be a multiple of the q/k heads ({self.n_k_heads})")
        if self.gate_fn not in GATE_FUNCTIONS:
            raise ValueError(f"gate_fn must be one of {tuple(GATE_FUNCTIONS)}, got {self.gate_fn!r}")
        activation(self.conv_act)  # an unknown name is refused here, by name

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_heads * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class HeadGatedNorm(nn.Module):
    """weight * rmsnorm(y) * gate_fn(gate) per head over d_v (ops.norms.rms_norm_gated; weight [d_v])."""

    def __init__(self, d_v: int, eps: float, gate_fn: str) -> None:
        super().__init__()
        self.eps, self.gate_fn = eps, gate_fn
        self.weight = nn.Parameter(torch.ones(d_v))

    def forward(self, y: Float[Tensor, "*lead d_v"], gate: Float[Tensor, "*lead d_v"]) -> Float[Tensor, "*lead d_v"]:
        return rms_norm_gated(y, gate, self.weight, self.eps, GATE_FUNCTIONS[self.gate_fn])

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gate={self.gate_fn}"


class DeltaMixer(RecurrentCut, TokenMixer, MixerWeights, nn.Module):
    """The gated delta rule mixer of a `DeltaSpec`; a family subclass defines its projections, `project` and
    `input_linears`."""

    unit_tag = "M"

    def __init__(self, spec: DeltaSpec) -> None:
        super().__init__()
        self.spec = spec
        h, channels = spec.n_heads, (spec.d_k if spec.per_channel_decay else 1)
        self.n_heads, self.d_head = h, spec.d_v  # d_head: a unit's width at hook_gated (MixerWeights)
        self.conv_weight = nn.Parameter(torch.empty(spec.conv_dim, spec.d_conv).uniform_(-spec.d_conv**-0.5,
                                                                                        spec.d_conv**-0.5))
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1.0, 16.0)))
        dt = torch.exp(torch.rand(h * channels) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                       + torch.log(torch.tensor(1e-3)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1 of dt in [1e-3, 0.1]
        self.norm = HeadGatedNorm(spec.d_v, spec.eps, spec.gate_fn)
        self.out_proj = nn.Linear(spec.value_dim, spec.d_model, bias=False)
        self.dims = {"n_heads": h, "n_k_heads": spec.n_k_heads, "d_k": spec.d_k, "d_v": spec.d_v,
                     "conv_dim": spec.conv_dim, "value_dim": spec.value_dim}

        self.hook_in = HookPoint("batch pos conv_dim")  # q, k, v projections before the conv
        self.hook_gate = HookPoint("batch pos n_heads d_v")  # the output gate, before its activation
        self.hook_conv = HookPoint("batch pos conv_dim")  # conv output, before SiLU
        self.hook_q = HookPoint("batch pos n_k_heads d_k", element="wide")  # L2-normalised (before d_k^-1/2)
        self.hook_k = HookPoint("batch pos n_k_heads d_k", element="wide")  # L2-normalised
        self.hook_v = HookPoint("batch pos n_heads d_v", element="wide")
        self.hook_beta = HookPoint("batch pos n_heads", element="wide")
        decay_axes = "batch pos n_heads d_k" if spec.per_channel_decay else "batch pos n_heads"
        self.hook_alpha = HookPoint(decay_axes, element="wide")  # the decay exp(g)
        self.hook_h = HookPoint("batch pos n_heads d_k d_v", lazy=True, element="wide")  # S_t, lazy
        self.hook_kernel = HookPoint("batch n_heads q_pos k_pos", lazy=True, element="wide")  # A, lazy
        self.hook_y = HookPoint("batch pos n_heads d_v", element="wide")  # S_t^T q_t
        self.hook_gated = HookPoint("batch pos value_dim")  # the gated norm's output (out_proj's input)
        self.hook_head_out = HookPoint("batch pos n_heads d_model", lazy=True)  # each head's write, lazy

    # ------------------------------------------------------------------------------- the family's part
    def project(self, x: Float[Tensor, "batch pos d_model"]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(qkv [b l conv_dim] in the order q, k, v, gate [b l value_dim], b [b l n_heads], a [b l n_heads
        (or n_heads d_k for KDA)]): the family's projections of the mixer input."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------ protocol
    def input_linears(self) -> list[nn.Module]:
        raise NotImplementedError

    def output_bias(self) -> Tensor | None:
        return self.out_proj.bias

    def heads(self) -> Heads:
        """The value heads (d_v channels each), cut at hook_gated (before out_proj)."""
        return Heads(self.spec.n_heads, self.spec.d_v, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """y_j = sum_i K[h, j, i] v_i from a zero state: the kernel (from q, k, beta, the decay) mixes hook_v."""
        return Mixing(self.hook_kernel, self.hook_v, self.hook_y)

    def A(self) -> Float[Tensor, "n_heads"]:
        """A = -exp(A_log): the decay is exp(A * softplus(a + dt_bias)), at least float32."""
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))

    def decay_norms(self) -> Float[Tensor, "n_heads"]:
        return torch.exp(self.A().double()) * self.spec.d_k

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        spec = ("ssm", None if channels is None else tuple(channels.tolist()), cut_conv)
        chunk = self.spec.chunk_size

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            q, k, v, beta, alpha = (seen.pop(n) for n in ("q", "k", "v", "beta", "alpha"))
            q = q * self.spec.d_k**-0.5
            step = stepping_state()
            if step is not None:  # the rule is linear in (v, S0): the cut sources' part runs on from h_cut
                return self._cut_step(
                    step, hook.name, masks, spec, channels, y,
                    lambda only, h0: delta_rule_chunked(q, k, v * along(only, v), beta, alpha, h0,
                                                        chunk_size=chunk))
            pairs = self._cut_pairs(hook.name, masks, y, channels)
            if pairs is None:
                return None  # nothing to cut: the tensor itself goes on
            row, j, i, heads = pairs
            return delta_rule_knockout(y, q, k, v, beta, alpha, row, j, i, heads, chunk_size=chunk)

        hooks: CutHooks = [(self.hook_q, keeper(seen, "q")), (self.hook_k, keeper(seen, "k")),
                           (self.hook_v, keeper(seen, "v")), (self.hook_beta, keeper(seen, "beta")),
                           (self.hook_alpha, keeper(seen, "alpha")), (self.hook_y, on_y)]
        if not cut_conv:
            return hooks
        return self._conv_hooks(masks, self.conv_channels(channels)) + hooks

    def kernel_slices(self, positions: Callable[[int, torch.device], Tensor], on_slice: Callable[[Tensor], None],
                      axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice(A[:, :, rows, :]) or on_slice(A[:, :, :, cols]) of this forward (q, k, beta,
        alpha as read; `positions(pos, device)` gives the rows or columns), without the pos x pos kernel; from
        hook_kernel itself when something already listens there (its edits seen)."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, slicer(positions, on_slice, axis))]
        seen: dict[str, Tensor] = {}
        fn = delta_rule_kernel_rows if axis == "rows" else delta_rule_kernel_cols

        def on_alpha(alpha: Tensor, hook: Any) -> None:
            q, k, beta = seen.pop("q"), seen.pop("k"), seen.pop("beta")
            idx = positions(alpha.shape[1], alpha.device)
            on_slice(fn(q * self.spec.d_k**-0.5, k, beta, alpha, idx, chunk_size=self.spec.chunk_size))

        return [(self.hook_q, keeper(seen, "q")), (self.hook_k, keeper(seen, "k")),
                (self.hook_beta, keeper(seen, "beta")), (self.hook_alpha, on_alpha)]

    def conv_channels(self, heads: Tensor | None) -> Tensor | None:
        """The conv channels [q | k | v] of the value heads `heads` (bool [n_heads]; None: all): each head's
        v channels, and a q/k head's channels when every value head reading it is in `heads`."""
        if heads is None:
            return None
        s = self.spec
        qk = heads.view(s.n_k_heads, -1).all(-1).repeat_interleave(s.d_k)
        return torch.cat([qk, qk, heads.repeat_interleave(s.d_v)])

    # ------------------------------------------------------------------------------------- forward
    def decay(self, a: Tensor, dtype: torch.dtype) -> Tensor:
        """alpha = exp(-exp(A_log) softplus(a + dt_bias)) in `dtype`, [b l h] or per key channel [b l h d_k]."""
        spec = self.spec
        A = torch.exp(self.A_log.to(dtype))
        if spec.per_channel_decay:
            g = rearrange(a.to(dtype) + self.dt_bias.to(dtype), "b l (h c) -> b l h c", h=spec.n_heads)
            return torch.exp(-A[:, None] * F.softplus(g))
        return torch.exp(-A * F.softplus(a.to(dtype) + self.dt_bias.to(dtype)))

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        spec = self.spec
        if ctx.attention_mask is not None:  # padding enters as zeros: k = 0 writes nothing, the state stays 0
            x = x * ctx.attention_mask[..., None].to(x.dtype)
        qkv, gate, b, a = self.project(x)
        qkv = self.hook_in(qkv)
        gate = self.hook_gate(rearrange(gate, "b l (h v) -> b l h v", v=spec.d_v))
        rule_dtype = torch.promote_types(x.dtype, torch.float32)
        backend, ran = backends.scan_backend(self, x.device, rule_dtype, op="chunk_gated_delta_rule"), []
        if ctx.state is None:
            conv = self._conv(qkv, backend, ran).contiguous()
        else:  # decoding: the conv also reads the previous d_conv - 1 inputs
            window = ctx.state.conv_window(self, qkv, spec.d_conv)
            conv = self._conv(window, backend, ran)[:, window.shape[1] - qkv.shape[1]:].contiguous()
        conv = self.hook_conv(conv)
        q, k, v = activation(spec.conv_act)(conv).split([spec.key_dim, spec.key_dim, spec.value_dim], dim=-1)
        q = self.hook_q(l2norm(rearrange(q.to(rule_dtype), "b l (g c) -> b l g c", c=spec.d_k)))
        k = self.hook_k(l2norm(rearrange(k.to(rule_dtype), "b l (g c) -> b l g c", c=spec.d_k)))
        v = self.hook_v(rearrange(v.to(rule_dtype), "b l (h v) -> b l h v", v=spec.d_v))
        beta = torch.sigmoid(b)
        beta = self.hook_beta((beta if spec.beta_scale == 1.0 else beta * spec.beta_scale).to(rule_dtype))
        alpha, alpha_was = through_hook(self.hook_alpha, self.decay(a, rule_dtype))
        if alpha_was is not None and backend == "fused":  # fla reads log(alpha): an edited decay (0 or negative
            backend = "chunked"  # entries are legal edits) takes our rule, which multiplies the alphas as given
        q_read = q * spec.d_k**-0.5
        if ctx.state is None and backend == "fused":  # fla's kernels: no state is built
            y = delta_rule_fused(q_read, k, v, beta, alpha, chunk_size=spec.chunk_size,
                                 kernels=backends.fused_kernels(x.device), ran=ran)[0]
        elif ctx.state is None:
            y = self._rule(q_read, k, v, beta, alpha)
        else:  # decoding: continue from the state the previous positions left
            ctx.state.refuse_lazy(self, [self.hook_h, self.hook_kernel])
            rule = delta_rule_fused if backend == "fused" else delta_rule_chunked
            fused = {"kernels": backends.fused_kernels(x.device), "ran": ran} if backend == "fused" else {}
            y, S = rule(q_read, k, v, beta, alpha, ctx.state.ssm_state(self), chunk_size=spec.chunk_size, **fused)
            ctx.state.set_ssm_state(self, S)
        self.last_kernels = tuple(ran)
        y = self.hook_y(y)
        gated = rearrange(self.norm(y.to(x.dtype), gate), "b l h v -> b l (h v)")
        gated = self.hook_gated(gated)
        return self._out_proj(gated)

    def _conv(self, x: Float[Tensor, "batch pos conv_dim"], backend: str,
              ran: list[str]) -> Float[Tensor, "batch pos conv_dim"]:
        """The short conv (no bias, no activation); on the fused backend through a kernel (ops/fused.py)."""
        if backend == "fused":
            return causal_conv1d_fused(x, self.conv_weight, kernels=backends.fused_kernels(x.device), ran=ran)
        return causal_conv1d(x, self.conv_weight)

    def _rule(
        self,
        q: Float[Tensor, "batch pos n_k_heads d_k"],
        k: Float[Tensor, "batch pos n_k_heads d_k"],
        v: Float[Tensor, "batch pos n_heads d_v"],
        beta: Float[Tensor, "batch pos n_heads"],
        alpha: Float[Tensor, "batch pos n_heads *channel"],
    ) -> Float[Tensor, "batch pos n_heads d_v"]:
        """y from a zero state through the lazy hooks hook_h and hook_kernel (q as read: scaled)."""
        chunk = self.spec.chunk_size
        if not self.hook_h.is_active:
            y, _ = delta_rule_chunked(q, k, v, beta, alpha, chunk_size=chunk)
        else:
            def states_fn() -> Tensor:
                return delta_rule_chunked(q, k, v, beta, alpha, chunk_size=chunk, return_states=True)[2]

            def carry(dS: Tensor, fixed: Tensor) -> Tensor:  # the rule is affine in S: carry the edit forward
                return delta_rule_carry(q, k, beta, alpha, dS, fixed, chunk_size=chunk)

            y, _, states = delta_rule_chunked(q, k, v, beta, alpha, chunk_size=chunk, return_states=True)
            edit = through_state_hook(self.hook_h, states, states_fn, carry)
            if edit.clean is not None:  # y_t = S_t^T q_t on the edited (set and continued) states
                q_heads = _per_head(q, self.spec.n_heads)
                y = edit.read_into(y, lambda h, at: einsum(h, q_heads[:, at], "b l h c v, b l h c -> b l h v"))
        if self.hook_kernel.is_active:
            kernel_fn = lambda: delta_rule_kernel(q, k, beta, alpha, chunk_size=chunk)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, kernel_fn(), kernel_fn)
            if kernel_was is not None:  # y_j += sum_i (A' - A)[j, i] v_i
                y = y + einsum(kernel - kernel_was, v, "b h j i, b i h v -> b j h v")
        return y

    def _out_proj(self, gated: Float[Tensor, "batch pos value_dim"]) -> Float[Tensor, "batch pos d_model"]:
        """out_proj(gated); with hook_head_out active, each head's write, summed when edited."""
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def head_writes(self, gated: Float[Tensor, "*batch pos value_dim"]) -> Float[Tensor, "*batch pos n_heads d_model"]:
        """Each value head's write to the residual (what hook_head_out holds; out_proj has no bias)."""
        W_out = rearrange(self.out_proj.weight, "m (h v) -> h v m", v=self.spec.d_v)
        per_head = rearrange(gated, "... l (h v) -> ... l h v", v=self.spec.d_v)
        return einsum(per_head, W_out, "... l h v, h v m -> ... l h m")

    def extra_repr(self) -> str:
        s = self.spec
        decay = "per channel" if s.per_channel_decay else "per head"
        return (f"n_heads={s.n_heads}, n_k_heads={s.n_k_heads}, d_k={s.d_k}, d_v={s.d_v}, d_conv={s.d_conv}, "
                f"decay={decay}, beta_scale={s.beta_scale:g}")
