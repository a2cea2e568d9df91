"""A gated short convolution (LFM2's "conv" operator, Hyena-style): input and output gates around a causal
depthwise conv, the only place positions mix.

Glossary
    channels   d_model: B, C, x and the conv all have one channel per residual feature
    width      the conv's taps [conv_L_cache]; tap width - 1 multiplies the current position

    B, C, x = chunk(in_proj(x_in), 3)      hook_B, hook_C, hook_x   [batch pos channels]
    Bx      = B * x                        hook_in                  the conv's input
    conv    = causal_conv(Bx)              hook_conv                (+ bias; no activation)
    K       = C * taps                     hook_kernel (lazy)       [batch channels q_pos k_pos], ops/conv_kernel.py:
                                                                    C * conv = K @ Bx + C * bias
    y       = C * conv                     hook_gated               out_proj's input
    out     = out_proj(y)                  hook_head_out (lazy)     [batch pos channels d_model]: each channel's write
Both gates are linear (no sigmoid). An edited kernel adds (K' - K) @ Bx to y; an edited head_out is
summed. Padding enters as zeros (x_in and Bx are masked): with a conv bias HF lets the padded positions'
in_proj bias products into the first real tokens' conv window; here a left-padded row equals the
prompt alone. While decoding, the state keeps the last width - 1 conv inputs.
Backends (hooked/backends.py): "fused" runs the conv through causal-conv1d's kernel, else fla's Triton
conv (ops/fused.py); "loop" / "chunked" through ours; hook_kernel is an exact hook (it takes "loop").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.head_writes import written_by_units
from hooked.models.protocol import CutHooks, Heads, Masks, Mixing, RecurrentCut, TokenMixer, slicer
from hooked.ops.conv import causal_conv1d
from hooked.ops.conv_kernel import conv_kernel, conv_kernel_cols, conv_kernel_rows
from hooked.ops.fused import causal_conv1d_fused


class GatedShortConv(RecurrentCut, TokenMixer, nn.Module):
    """Mixer protocol (protocol.py): the units are the channels (width 1), cut at hook_gated; an edge
    (target j <- source i, j - i < width) is a conv tap, removed from hook_conv whatever `cut_conv` says
    (the conv is the only path between positions); the conv bias is never cut. No state, so no decay_norms."""

    unit_tag = "M"

    def __init__(self, d_model: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.width = width
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(d_model, width).uniform_(-width**-0.5, width**-0.5))
        self.conv_bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.n_heads, self.d_head = d_model, 1  # a channel is a unit
        self.dims = {"channels": d_model}
        self.hook_B = HookPoint("batch pos channels")
        self.hook_C = HookPoint("batch pos channels")
        self.hook_x = HookPoint("batch pos channels")
        self.hook_in = HookPoint("batch pos channels")  # B * x, the conv's input
        self.hook_conv = HookPoint("batch pos channels")
        self.hook_kernel = HookPoint("batch channels q_pos k_pos", lazy=True)  # C * conv taps, lazy
        self.hook_gated = HookPoint("batch pos channels")  # C * conv
        self.hook_head_out = HookPoint("batch pos channels d_model", lazy=True)

    def input_linears(self) -> list[nn.Module]:
        return [self.in_proj]

    def output_bias(self) -> Tensor | None:
        return self.out_proj.bias

    def heads(self) -> Heads:
        return Heads(self.n_heads, 1, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """gated_j = sum_i K[c, j, i] (B x)_i: the kernel mixes hook_in into hook_gated (its bias is no term)."""
        return Mixing(self.hook_kernel, self.hook_in, self.hook_gated)

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        return self._conv_hooks(masks, channels, spec=("conv", None if channels is None else tuple(channels.tolist())))

    def kernel_slices(self, positions: Callable[[int, torch.device], Tensor], on_slice: Callable[[Tensor], None],
                      axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice(K[:, :, rows, :]) or on_slice(K[:, :, :, cols]) of this forward (C read at
        hook_C; `positions(pos, device)` gives the rows or columns), without the pos x pos kernel; from
        hook_kernel itself when something already listens there (its edits seen)."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, slicer(positions, on_slice, axis))]
        fn = conv_kernel_rows if axis == "rows" else conv_kernel_cols

        def on_C(C: Tensor, hook: Any) -> None:
            on_slice(fn(C, self.conv_weight, positions(C.shape[1], C.device)))

        return [(self.hook_C, on_C)]

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        mask = None if ctx.attention_mask is None else ctx.attention_mask[..., None].to(x.dtype)
        if mask is not None:
            x = x * mask
        B, C, xs = self.in_proj(x).chunk(3, dim=-1)
        B, C, xs = self.hook_B(B), self.hook_C(C), self.hook_x(xs)
        Bx = B * xs if mask is None else B * xs * mask
        Bx = self.hook_in(Bx)
        backend, ran = backends.scan_backend(self, x.device, x.dtype, op="causal_conv1d"), []
        if ctx.state is None:
            conv = self._conv(Bx, backend, ran).contiguous()
        else:  # decoding: the conv also reads the previous width - 1 inputs
            window = ctx.state.conv_window(self, Bx, self.width)
            conv = self._conv(window, backend, ran)[:, window.shape[1] - Bx.shape[1]:].contiguous()
        self.last_kernels = tuple(ran)
        conv = self.hook_conv(conv)
        gated = C * conv
        if self.hook_kernel.is_active:
            if ctx.state is not None:
                ctx.state.refuse_lazy(self, [self.hook_kernel])
            kernel_fn = lambda: conv_kernel(C, self.conv_weight)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, kernel_fn(), kernel_fn)
            if kernel_was is not None:  # y_j += sum_i (K' - K)[j, i] (B x)_i
                gated = gated + einsum(kernel - kernel_was, Bx, "b c j i, b i c -> b j c")
        gated = self.hook_gated(gated)
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def _conv(self, x: Float[Tensor, "batch pos channels"], backend: str,
              ran: list[str]) -> Float[Tensor, "batch pos channels"]:
        """The conv (with its bias); on the fused backend causal-conv1d's or fla's kernel (ops/fused.py)."""
        if backend == "fused":
            return causal_conv1d_fused(x, self.conv_weight, self.conv_bias, kernels=backends.fused_kernels(x.device),
                                       ran=ran)
        return causal_conv1d(x, self.conv_weight, self.conv_bias)

    def head_writes(self, gated: Float[Tensor, "*batch pos channels"]) -> Float[Tensor, "*batch pos channels d_model"]:
        """Each channel's write to the residual (out_proj without its bias)."""
        return einsum(gated, self.out_proj.weight, "... l c, m c -> ... l c m")

    def extra_repr(self) -> str:
        return f"channels={self.in_proj.in_features}, width={self.width}, bias={self.conv_bias is not None}"
