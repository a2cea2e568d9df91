"""Griffin's recurrent block (RecurrentGemma's "recurrent" temporal block): two linear branches, a causal
depthwise conv and the RG-LRU, every quantity hooked, its states editable.

Glossary (shape word in annotations; HF RecurrentGemma names in brackets; paper symbols)
    lru_width   d   the recurrence's channels [lru_width]; each has ONE scalar state (hook_h's d_state = 1)
    n_blocks        the gates' diagonal blocks [num_attention_heads], block_width = lru_width / n_blocks each
    x               the RG-LRU input: conv(linear_x(u)) (no activation), zero at padding
    i_t, r_t        input and recurrence gates, sigmoid(x W + b) per block [input_gate, recurrent_gate]
    a_t             exp(-8 r_t softplus(Lambda)) [recurrent_param = Lambda]; 0 at a reset (position id 0:
                    the first real token, and padding), as HF multiplies it by (1 - reset)
    multiplier      sqrt(1 - a_t^2) (1 at a reset), the normalisation of the gated input
    h               h_t = a_t h_{t-1} + multiplier_t i_t x_t        hook_h, [lru_width d_state=1]
    y               h, read directly (no C); gated = y * gelu_tanh(linear_y(u)); out = out_proj(gated)
    kernel          K[d, j, i] = prod_{t=i+1..j} a_t * multiplier_i i_i, so y_j = sum_i K[d, j, i] x_i (ops/rg_lru.py)

Hooks under blocks.{l}.mixer., in forward order:
    hook_in [b l lru_width] (linear_x, the conv input), hook_gate [b l lru_width] (linear_y, before GeLU),
    hook_conv [b l lru_width], hook_x [b l lru_width], hook_input_gate, hook_recurrent_gate, hook_a,
    hook_multiplier [b l lru_width], hook_h [b l lru_width d_state], hook_kernel [b lru_width q_pos k_pos]
    (lazy), hook_y [b l lru_width], hook_gated [b l lru_width] (out_proj's input), hook_head_out
    [b l lru_width d_model] (lazy).

Edits propagate: x, the gates, a and the multiplier are what the recurrence reads (an edited a also gives
the multiplier sqrt(1 - a^2); the kernel reads log(a), so an edited a must stay >= 0 there). A state
returned by a hook of hook_h is SET and the recurrence continues from it (hooked/state_edit.py, set_scan
with the decays a); y is the states as set and continued. An edited kernel adds (K' - K) x to y.

Mixer protocol (protocol.py): the units are the channels (width 1, tag "M"), cut at hook_gated; an edge
(j <- i) is the kernel term K[j, i] x_i, removed from hook_y by running the recurrence on the sources'
inputs alone (the recurrence is linear in x and h0): no kernel entry is built. cut_conv also removes the
sources' conv taps into the targets. While decoding the state is h (one scalar per channel) and the
conv window; the cut's share of h rides along (cut_record.py). decay_norms: exp(-8 softplus(Lambda)),
the decay at r = 1. Padding enters as zeros (u, the conv input and output are masked) and every padded
position is a reset, so a left-padded row equals the prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.decode_state import StateRefused, stepping_state
from hooked.models.head_writes import written_by_units
from hooked.models.protocol import CutHooks, Heads, Masks, Mixing, RecurrentCut, TokenMixer, along
from hooked.ops.conv import causal_conv1d
from hooked.ops.fused import causal_conv1d_fused
from hooked.ops.rg_lru import bounded_sqrt, rg_lru_kernel, rg_lru_kernel_cols, rg_lru_kernel_rows, rg_lru_scan
from hooked.ops.set_scan import set_scan
from hooked.state_edit import through_state_hook

LOG_DECAY_SCALE = 8.0  # c in a_t = exp(-c r_t softplus(Lambda)) (Griffin; HF's -8.0)


def _keep(seen: dict, key: str) -> Callable[[Tensor, Any], None]:
    def fn(x: Tensor, hook: Any) -> None:
        seen[key] = x
    return fn


def _slice(index: Callable, on_slice: Callable[[Tensor], None], axis: str) -> Callable[[Tensor, Any], None]:
    def fn(matrix: Tensor, hook: Any) -> None:
        idx = index(matrix.shape[-1], matrix.device)
        on_slice(matrix[:, :, idx] if axis == "rows" else matrix[..., idx])
    return fn


class RGLRUBlock(RecurrentCut, TokenMixer, nn.Module):
    """linear_y -> GeLU gate; linear_x -> conv -> RG-LRU; out_proj(y * gate). Units: the lru_width channels."""

    unit_tag = "M"

    def __init__(self, d_model: int, lru_width: int, n_blocks: int, d_conv: int = 4,
                 act_fn: str = "gelu_pytorch_tanh") -> None:
        super().__init__()
        if lru_width % n_blocks:
            raise ValueError(f"lru_width ({lru_width}) must be a multiple of the gates' blocks ({n_blocks})")
        if act_fn not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"the recurrent block's gate activation must be a GeLU, got {act_fn!r}")
        self.act_fn, self.width = act_fn, d_conv
        bw = lru_width // n_blocks
        self.linear_x = nn.Linear(d_model, lru_width)
        self.linear_y = nn.Linear(d_model, lru_width)
        self.out_proj = nn.Linear(lru_width, d_model)  # HF linear_out
        self.conv_weight = nn.Parameter(torch.empty(lru_width, d_conv).uniform_(-d_conv**-0.5, d_conv**-0.5))
        self.conv_bias = nn.Parameter(torch.zeros(lru_width))
        self.recurrent_param = nn.Parameter(torch.empty(lru_width))  # Lambda
        self.input_gate_weight = nn.Parameter(torch.randn(n_blocks, bw, bw) * bw**-0.5)  # [block in out]
        self.input_gate_bias = nn.Parameter(torch.zeros(n_blocks, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(n_blocks, bw, bw) * bw**-0.5)
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(n_blocks, bw))
        with torch.no_grad():  # Griffin's init: a^c in [0.9, 0.999] at r = 1
            a = torch.empty(lru_width).uniform_(0.9**2 + 1e-8, 0.999**2 + 1e-8)
            self.recurrent_param.copy_(a.log().mul(0.5).neg().exp().sub(1.0).log())
        self.n_heads, self.d_head = lru_width, 1  # a channel is a unit
        self.dims = {"lru_width": lru_width, "d_state": 1, "n_blocks": n_blocks, "block_width": bw}

        self.hook_in = HookPoint("batch pos lru_width")  # linear_x, the conv's input
        self.hook_gate = HookPoint("batch pos lru_width")  # linear_y, before GeLU
        self.hook_conv = HookPoint("batch pos lru_width")
        self.hook_x = HookPoint("batch pos lru_width")  # the RG-LRU input (the kernel's value)
        self.hook_input_gate = HookPoint("batch pos lru_width", element="wide")  # i_t
        self.hook_recurrent_gate = HookPoint("batch pos lru_width", element="wide")  # r_t
        self.hook_a = HookPoint("batch pos lru_width", element="wide")  # the decay, 0 at a reset
        self.hook_multiplier = HookPoint("batch pos lru_width", element="wide")  # sqrt(1 - a^2)
        self.hook_h = HookPoint("batch pos lru_width d_state", element="wide")  # the states
        self.hook_kernel = HookPoint("batch lru_width q_pos k_pos", lazy=True, element="wide")  # lazy
        self.hook_y = HookPoint("batch pos lru_width", element="wide")
        self.hook_gated = HookPoint("batch pos lru_width")  # y * GeLU(gate), out_proj's input
        self.hook_head_out = HookPoint("batch pos lru_width d_model", lazy=True)  # lazy

    # ------------------------------------------------------------------------------------ protocol
    def input_linears(self) -> list[nn.Module]:
        return [self.linear_x, self.linear_y]

    def output_bias(self) -> Tensor | None:
        return self.out_proj.bias

    def heads(self) -> Heads:
        return Heads(self.n_heads, 1, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """y_j = sum_i K[d, j, i] x_i: the kernel mixes hook_x into hook_y."""
        return Mixing(self.hook_kernel, self.hook_x, self.hook_y)

    def A(self) -> Float[Tensor, "lru_width"]:
        """A = -8 softplus(Lambda), at least float32: the decay is a_t = exp(A r_t)."""
        return -LOG_DECAY_SCALE * F.softplus(self.recurrent_param.to(torch.promote_types(self.recurrent_param.dtype,
                                                                                           torch.float32)))

    def decay_norms(self) -> Float[Tensor, "lru_width"]:
        """The decay per channel at r = 1, exp(-8 softplus(Lambda)) (d_state = 1)."""
        return torch.exp(self.A().double())

    def head_writes(self, gated: Float[Tensor, "*batch pos lru_width"]) -> Float[Tensor, "*batch pos lru_width d_model"]:
        """Each channel's write to the residual (out_proj without its bias)."""
        return gated[..., None] * self.out_proj.weight.T

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        spec = ("ssm", None if channels is None else tuple(channels.tolist()), cut_conv)

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            x, gate_i, a, mult = (seen.pop(k) for k in ("x", "i", "a", "m"))
            wx = lambda only: mult * gate_i * x.to(a.dtype) * along(only, a)  # noqa: E731  the sources' inputs
            step = stepping_state()
            if step is not None:  # linear in (x, h0): the sources' part runs on from the h_cut carried

                def scan_sources(only: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor]:
                    states = rg_lru_scan(a, wx(only), h0)
                    return states, states[:, -1]
                return self._cut_step(step, hook.name, masks, spec, channels, y, scan_sources)
            t, s = masks(y.shape[0], y.shape[1], y.device)
            self._check_overlap(hook.name, t, s, channels)
            if not (t.any() and s.any()) or (channels is not None and not channels.any()):
                return None  # nothing to cut: the tensor itself goes on
            cut = rg_lru_scan(a, wx(s)) * along(t, a)  # sum over cut sources i <= j of K[j, i] x_i
            if channels is not None:
                cut = cut * channels.to(cut.device, cut.dtype)
            return y - cut.to(y.dtype)

        hooks: CutHooks = [(self.hook_x, _keep(seen, "x")), (self.hook_input_gate, _keep(seen, "i")),
                           (self.hook_a, _keep(seen, "a")), (self.hook_multiplier, _keep(seen, "m")),
                           (self.hook_y, on_y)]
        return self._conv_hooks(masks, channels) + hooks if cut_conv else hooks

    def kernel_slices(self, index: Callable[[int, torch.device], Tensor], on_slice: Callable[[Tensor], None],
                      axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice with rows or columns of this forward's kernel (from hook_a and the
        multiplier times the input gate), without the pos x pos matrix; from hook_kernel itself when
        something already listens there (its edits seen)."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, _slice(index, on_slice, axis))]
        seen: dict[str, Tensor] = {}
        fn = rg_lru_kernel_rows if axis == "rows" else rg_lru_kernel_cols

        def on_multiplier(mult: Tensor, hook: Any) -> None:
            if stepping_state() is not None:
                raise StateRefused(f"{hook.name.rsplit('.', 1)[0]}: kernel slices describe the whole sequence from a "
                                   "zero state and cannot be taken while decoding with a state; run the whole "
                                   "sequence (generate with use_past_kv_cache=False)")
            a, gate_i = seen.pop("a"), seen.pop("i")
            on_slice(fn(torch.log(a), mult * gate_i, index(a.shape[1], a.device)))

        return [(self.hook_input_gate, _keep(seen, "i")), (self.hook_a, _keep(seen, "a")),
                (self.hook_multiplier, on_multiplier)]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, u: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        keep = None if ctx.attention_mask is None else ctx.attention_mask[..., None].to(u.dtype)
        if keep is not None:
            u = u * keep
        gate = self.hook_gate(self.linear_y(u))
        conv_in = self.linear_x(u) if keep is None else self.linear_x(u) * keep
        conv_in = self.hook_in(conv_in)
        dtype = torch.promote_types(u.dtype, torch.float32)  # the recurrence's (HF accumulates in float32)
        backend, ran = backends.scan_backend(self, u.device, dtype, op="causal_conv1d"), []
        if ctx.state is None:
            conv = self._conv(conv_in, backend, ran).contiguous()
        else:  # decoding: the conv also reads the previous d_conv - 1 inputs
            window = ctx.state.conv_window(self, conv_in, self.width)
            conv = self._conv(window, backend, ran)[:, window.shape[1] - conv_in.shape[1]:].contiguous()
        self.last_kernels = tuple(ran)
        conv = self.hook_conv(conv)
        x = self.hook_x(conv if keep is None else conv * keep)
        y = self._rg_lru(x, ctx, backend != "loop")
        y = self.hook_y(y)
        gated = y.to(u.dtype) * F.gelu(gate, approximate="tanh" if self.act_fn == "gelu_pytorch_tanh" else "none")
        gated = self.hook_gated(gated)
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def _rg_lru(self, x: Float[Tensor, "batch pos lru_width"], ctx: Context,
                chunked: bool) -> Float[Tensor, "batch pos lru_width"]:
        """h from the state the previous positions left (zero without one), through hook_h and hook_kernel."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        blocks = rearrange(x.to(dtype), "b l (k c) -> b l k c", k=self.input_gate_weight.shape[0])

        def gate(weight: Tensor, bias: Tensor) -> Tensor:  # sigmoid(x W + b), block by block
            z = einsum(blocks, weight.to(dtype), "b l k c, k c o -> b l k o") + bias.to(dtype)
            return rearrange(torch.sigmoid(z), "b l k o -> b l (k o)")

        gate_i = self.hook_input_gate(gate(self.input_gate_weight, self.input_gate_bias))
        gate_r = self.hook_recurrent_gate(gate(self.recurrent_gate_weight, self.recurrent_gate_bias))
        reset = (ctx.position_ids == 0)[..., None]  # the first real token (and padding) starts from nothing
        log_a = -LOG_DECAY_SCALE * gate_r * F.softplus(self.recurrent_param.to(dtype))
        decay_fn = lambda: torch.exp(log_a).masked_fill(reset, 0.0)  # noqa: E731  (rebuilds after an in-place edit)
        a, a_was = through_hook(self.hook_a, decay_fn(), decay_fn)
        a_square = a * a if a_was is not None else torch.exp(2 * log_a).masked_fill(reset, 0.0)  # HF's a^2
        mult = self.hook_multiplier(bounded_sqrt(1 - a_square))  # its gradient clipped, as HF's
        wx = x.to(dtype) * gate_i * mult  # HF's order: (x * i) * multiplier
        h0 = None if ctx.state is None else ctx.state.ssm_state(self)
        states = rg_lru_scan(a, wx, h0, chunked=chunked)[..., None]  # [b l d 1]
        decay = a[..., None]
        edit = through_state_hook(self.hook_h, states, lambda: rg_lru_scan(a, wx, h0, chunked=chunked)[..., None],
                                  lambda e, fixed: set_scan(decay, e, fixed))
        y = edit.h[..., 0]
        if ctx.state is not None:
            ctx.state.refuse_lazy(self, [self.hook_kernel])
            ctx.state.set_ssm_state(self, edit.h[:, -1, :, 0])
        if self.hook_kernel.is_active:
            build = lambda: rg_lru_kernel(torch.log(a), mult * gate_i)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, build(), build)
            if kernel_was is not None:  # y_j += sum_i (K' - K)[j, i] x_i
                y = y + einsum(kernel - kernel_was, x.to(dtype), "b d j i, b i d -> b j d")
        return y

    def _conv(self, x: Float[Tensor, "batch pos lru_width"], backend: str,
              ran: list[str]) -> Float[Tensor, "batch pos lru_width"]:
        if backend == "fused":
            return causal_conv1d_fused(x, self.conv_weight, self.conv_bias, kernels=backends.fused_kernels(x.device),
                                       ran=ran)
        return causal_conv1d(x, self.conv_weight, self.conv_bias)

    def extra_repr(self) -> str:
        k, c = self.input_gate_weight.shape[:2]
        return f"lru_width={k * c}, n_blocks={k}, d_conv={self.width}"

