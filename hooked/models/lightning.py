"""MiniMax's lightning attention mixer: linear attention with a constant decay per head, every state hookable.

Glossary (shape word, einops letter, symbol; hooked/ops/lightning.py has the recurrence)
    batch      b
    pos        l     t    position; kernel rows q_pos = target j, columns k_pos = source i
    d_model    m          residual width
    n_heads    h          heads: each has its own state and decay (the mixer's units)
    d_head     d          a head's width: queries, keys and values alike
    d_key, d_value        the state's rows (key channels) and columns (value channels), d_head each
    inner                 n_heads * d_head: the norm's, the gate's and out_proj's width
    slope      s_h        HF's slope_rate: (2^(-8/H))^(h+1) * (1 - layer / (n_layers - 1 + 1e-5) + 1e-5);
                          lambda_h = exp(-s_h)
    h                     the state S_t [d_key d_value] per head (hook_h), never called x

Mixer (HF MiniMaxLightningAttention):
    q, k, v = split per head (act(qkv_proj(x)))          (padding positions zeroed: they write nothing)
    S_t = lambda S_{t-1} + k_t v_t^T,  y_t = S_t^T q_t    (no 1/sqrt(d) scale, no rotary)
    out = out_proj(sigmoid(output_gate(x)) * rmsnorm(y))  the norm over all heads together (inner)
The recurrence runs in float32 (float64 for a float64 model) in HF's blocks of block_size positions.

Hooks under blocks.{l}.mixer., in forward order:
    hook_q, hook_k, hook_v [b l h d] (after the activation), hook_h [b l h d_key d_value] (lazy),
    hook_kernel [b h q_pos k_pos] (lazy), hook_y [b l h d], norm.* [b l inner], hook_gate [b l inner]
    (output_gate(x), before the sigmoid), hook_gated [b l inner] (out_proj's input), hook_head_out
    [b l h d_model] (lazy).
Mixer protocol (protocol.py): the units are the heads, cut at hook_gated (d_head each: zeroing a head
there zeroes its columns of out_proj; the norm before it reads every head); an edge (j <- i) is the kernel
term K[j, i] v_i, removed from hook_y with q, k, v read from the same forward (no pos x pos tensor). No
conv: cut_conv has nothing more to cut. decay_norms: d_head * lambda (Mamba-2's ||exp(A)||_1 at dt = 1).

Edits propagate: q, k, v are what the recurrence reads; a state returned by a hook of hook_h is SET where
it differs and the recurrence continues from it (hooked/state_edit.py; the decay is elementwise, so
ops/set_scan.py carries it); an edited kernel adds (K' - K) v to y; an edited head_out is summed into
the output. With no lazy hook active the forward is the block algorithm alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.decode_state import StateRefused, stepping_state
from hooked.models.head_writes import written_by_units
from hooked.models.mlp import activation
from hooked.models.norms import RMSNorm
from hooked.models.protocol import CutHooks, Heads, Masks, Mixing, RecurrentCut, TokenMixer, along, keeper, slicer
from hooked.ops.lightning import (lightning_chunked, lightning_decays, lightning_kernel, lightning_kernel_cols,
                                  lightning_kernel_rows, lightning_knockout, lightning_states)
from hooked.ops.set_scan import set_scan
from hooked.state_edit import through_state_hook
from hooked.weights import MixerWeights


def minimax_slopes(n_heads: int, layer: int, n_layers: int) -> tuple[float, ...]:
    """HF's slope_rate of layer `layer`: the ALiBi slopes (2^(-8/H))^(h+1), shrunk with depth."""
    base = 1 / (2 ** (8 / n_heads))
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return tuple(base ** (h + 1) * factor for h in range(n_heads))


@dataclass(frozen=True)
class LightningSpec:
    d_model: int
    n_heads: int
    d_head: int
    slopes: tuple[float, ...]  # s_h per head (minimax_slopes)
    block_size: int = 256  # HF's block_size: positions per block of the chunked form
    act_fn: str = "silu"  # on qkv_proj's output (HF's hidden_act)
    eps: float = 1e-6  # the output norm's (HF builds it with its default eps)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slopes", tuple(float(s) for s in self.slopes))
        if len(self.slopes) != self.n_heads:
            raise ValueError(f"{len(self.slopes)} slopes for {self.n_heads} heads")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        activation(self.act_fn)  # an unknown name is refused here, by name

    @property
    def inner(self) -> int:
        return self.n_heads * self.d_head


class LightningMixer(RecurrentCut, TokenMixer, MixerWeights, nn.Module):
    """Lightning attention of a `LightningSpec` (module docstring). Its units are the heads."""

    unit_tag = "M"

    def __init__(self, spec: LightningSpec) -> None:
        super().__init__()
        self.spec = spec
        self.n_heads, self.d_head = spec.n_heads, spec.d_head
        self.qkv_proj = nn.Linear(spec.d_model, 3 * spec.inner, bias=False)  # per head [q | k | v]
        self.output_gate = nn.Linear(spec.d_model, spec.inner, bias=False)
        self.norm = RMSNorm(spec.inner, spec.eps)
        self.out_proj = nn.Linear(spec.inner, spec.d_model, bias=False)
        self.dims = {"n_heads": spec.n_heads, "d_head": spec.d_head, "d_key": spec.d_head, "d_value": spec.d_head,
                     "inner": spec.inner}

        self.hook_q = HookPoint("batch pos n_heads d_head", element="wide")
        self.hook_k = HookPoint("batch pos n_heads d_head", element="wide")
        self.hook_v = HookPoint("batch pos n_heads d_head", element="wide")
        self.hook_h = HookPoint("batch pos n_heads d_key d_value", lazy=True, element="wide")  # S_t, lazy
        self.hook_kernel = HookPoint("batch n_heads q_pos k_pos", lazy=True, element="wide")  # K, lazy
        self.hook_y = HookPoint("batch pos n_heads d_head", element="wide")  # S_t^T q_t
        self.hook_gate = HookPoint("batch pos inner")  # output_gate(x), before the sigmoid
        self.hook_gated = HookPoint("batch pos inner")  # sigmoid(gate) * norm(y): out_proj's input
        self.hook_head_out = HookPoint("batch pos n_heads d_model", lazy=True)  # each head's write, lazy

    # ------------------------------------------------------------------------------------ protocol
    def input_linears(self) -> list[nn.Module]:
        return [self.qkv_proj, self.output_gate]

    def output_bias(self) -> Tensor | None:
        return None

    def heads(self) -> Heads:
        """The heads (d_head channels each), cut at hook_gated (before out_proj)."""
        return Heads(self.n_heads, self.d_head, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """y_j = sum_i K[h, j, i] v_i from a zero state: the kernel mixes hook_v into hook_y."""
        return Mixing(self.hook_kernel, self.hook_v, self.hook_y)

    def slope(self, dtype: torch.dtype = torch.float64, device: Any = None) -> Float[Tensor, "n_heads"]:
        """s_h as a tensor (from the spec: exact in float64 whatever the weights' dtype)."""
        return torch.tensor(self.spec.slopes, dtype=torch.float64, device=device).to(dtype)

    def A(self) -> Float[Tensor, "n_heads"]:
        """-s_h: the log-decay per position (Mamba-2's A at dt = 1)."""
        return -self.slope(device=self.qkv_proj.weight.device)

    def decay_norms(self) -> Float[Tensor, "n_heads"]:
        return torch.exp(self.A()) * self.d_head

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        spec = ("ssm", None if channels is None else tuple(channels.tolist()), cut_conv)

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            q, k, v = (seen.pop(n) for n in ("q", "k", "v"))
            slope = self.slope(q.dtype, q.device)
            step = stepping_state()
            if step is not None:  # linear in (v, S0): the cut sources' part runs on from h_cut
                return self._cut_step(step, hook.name, masks, spec, channels, y,
                                      lambda only, h0: lightning_chunked(q, k, v * along(only, v), slope,
                                                                         self.spec.block_size, h0))
            pairs = self._cut_pairs(hook.name, masks, y, channels)
            if pairs is None:
                return None  # nothing to cut: the tensor itself goes on
            row, j, i, heads = pairs
            return y - lightning_knockout(q, k, v, slope, row, j, i, heads).to(y.dtype)

        return [(self.hook_q, keeper(seen, "q")), (self.hook_k, keeper(seen, "k")),
                (self.hook_v, keeper(seen, "v")), (self.hook_y, on_y)]

    def kernel_slices(self, index: Callable[[int, torch.device], Tensor], on_slice: Callable[[Tensor], None],
                      axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice(K[:, :, rows, :]) or on_slice(K[..., cols]) of this forward (q, k as read),
        without the pos x pos kernel; from hook_kernel itself when something already listens there."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, slicer(index, on_slice, axis))]
        seen: dict[str, Tensor] = {}
        fn = lightning_kernel_rows if axis == "rows" else lightning_kernel_cols

        def on_k(k: Tensor, hook: Any) -> None:
            if stepping_state() is not None:
                raise StateRefused(f"{hook.name.rsplit('.', 1)[0]}: kernel slices describe the whole sequence from a "
                                   "zero state and cannot be taken while decoding with a state; run the whole "
                                   "sequence (generate with use_past_kv_cache=False)")
            q = seen.pop("q")
            on_slice(fn(q, k, self.slope(q.dtype, q.device), index(k.shape[1], k.device)))

        return [(self.hook_q, keeper(seen, "q")), (self.hook_k, on_k)]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        spec = self.spec
        qkv = activation(spec.act_fn)(self.qkv_proj(x))
        if ctx.attention_mask is not None:  # padding writes nothing: k = v = 0 leaves the state alone
            qkv = qkv * ctx.attention_mask[..., None].to(qkv.dtype)
        rule_dtype = torch.promote_types(x.dtype, torch.float32)
        q, k, v = rearrange(qkv.to(rule_dtype), "b l (h three d) -> three b l h d", three=3, d=spec.d_head)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        slope = self.slope(rule_dtype, x.device)
        if ctx.state is None:
            y = self._recurrence(q, k, v, slope)
        else:  # decoding: continue from the state the previous positions left
            ctx.state.refuse_lazy(self, [self.hook_h, self.hook_kernel])
            y, S = lightning_chunked(q, k, v, slope, spec.block_size, ctx.state.ssm_state(self))
            ctx.state.set_ssm_state(self, S)
        y = self.hook_y(y)
        normed = self.norm(rearrange(y.to(x.dtype), "b l h d -> b l (h d)"))
        gate = self.hook_gate(self.output_gate(x))
        gated = self.hook_gated(torch.sigmoid(gate) * normed)
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def _recurrence(self, q: Tensor, k: Tensor, v: Tensor, slope: Tensor) -> Tensor:
        """y from a zero state through the lazy hooks hook_h and hook_kernel."""
        y, _ = lightning_chunked(q, k, v, slope, self.spec.block_size)
        if self.hook_h.is_active:
            states_fn = lambda: lightning_states(k, v, slope)  # noqa: E731
            decay = lightning_decays(slope, q.shape[0], q.shape[1])
            edit = through_state_hook(self.hook_h, states_fn(), states_fn, lambda e, fixed: set_scan(decay, e, fixed))
            if edit.clean is not None:  # y_t = S_t^T q_t on the edited (set and continued) states
                y = edit.read_into(y, lambda h, at: einsum(h, q[:, at], "b l h c v, b l h c -> b l h v"))
        if self.hook_kernel.is_active:
            kernel_fn = lambda: lightning_kernel(q, k, slope)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, kernel_fn(), kernel_fn)
            if kernel_was is not None:  # y_j += sum_i (K' - K)[j, i] v_i
                y = y + einsum(kernel - kernel_was, v, "b h j i, b i h v -> b j h v")
        return y

    def head_writes(self, gated: Float[Tensor, "*batch pos inner"]) -> Float[Tensor, "*batch pos n_heads d_model"]:
        """Each head's write to the residual (what hook_head_out holds; out_proj has no bias)."""
        W_out = rearrange(self.out_proj.weight, "m (h d) -> h d m", d=self.d_head)
        per_head = rearrange(gated, "... l (h d) -> ... l h d", d=self.d_head)
        return einsum(per_head, W_out, "... l h d, h d m -> ... l h m")

    def extra_repr(self) -> str:
        s = self.spec
        lams = ", ".join(f"{math.exp(-x):.4g}" for x in s.slopes[:4]) + (", ..." if s.n_heads > 4 else "")
        return f"n_heads={s.n_heads}, d_head={s.d_head}, block_size={s.block_size}, lambda=({lams})"
