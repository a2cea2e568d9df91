"""Stand-ins for the mamba-ssm / causal-conv1d CUDA kernels, with their reference semantics, in our code.

Glossary (the kernels' layout: channels before positions)
    b, d, l, n    batch, channels (d_inner), positions, d_state
    g             groups of channels sharing one B and C (B, C given as [b g n l])
    h, p          Mamba-2 heads and head width (mamba_chunk_scan_combined's [b l h p] layout)

Each function takes the arguments of the kernel it stands for (same names, layouts and defaults)
and returns what the kernel returns, computed with our own ops (selective_scan.py, ssd.py,
conv.py) in float32, the precision the kernels compute in:
    selective_scan_reference      mamba_ssm.ops.selective_scan_interface.selective_scan_fn
    causal_conv1d_reference       causal_conv1d.causal_conv1d_fn
    chunk_scan_combined_reference mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined
They let the wiring of the fused path (layouts, casts, which arguments are passed) run and be
tested on a CPU; ops/fused.py passes them where the real kernels would go.
The semantics, read from the kernels' documentation and reference functions:
  - selective scan: delta (+ delta_bias) (softplus'ed when delta_softplus), A_bar = exp(delta A),
    state x_t = A_bar_t x_{t-1} + delta_t B_t u_t from zero, y_t = C_t . x_t, out = y (+ D u)
    (* silu(z)); out in u's dtype; the last state [b d n] in float32 when return_last_state.
  - causal conv: x cast to the weight's dtype, depthwise conv with width - 1 zeros before
    position 0 (or initial_states [b d width-1] in their place), bias, optional SiLU, cast back.
  - chunk scan combined: the Mamba-2 SSD recurrence per head from initial_states (zero when
    None), dt (+ dt_bias) (softplus'ed) clamped to dt_limit, out = y (+ D x) (* silu(z)) in x's
    dtype, final states [b h p n] in float32 when return_final_states.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from hooked.ops.selective_scan import linear_scan
from hooked.ops.ssd import ssd_chunked


def _per_channel(BC: Tensor, d: int) -> Tensor:
    """B or C as [b l d n] (a broadcast view where possible) from [d n], [b n l] or [b g n l]."""
    if BC.dim() == 2:
        return BC[None, None]
    if BC.dim() == 3:
        return rearrange(BC, "b n l -> b l 1 n")
    return repeat(BC, "b g n l -> b l (g r) n", r=d // BC.shape[1])


def selective_scan_reference(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                             z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                             return_last_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """selective_scan_fn's semantics. u, delta, z: [b d l]; A: [d n]; B, C: [d n], [b n l] or [b g n l]."""
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    d = A.shape[0]
    u_l, delta_l = rearrange(u, "b d l -> b l d"), rearrange(delta, "b d l -> b l d")
    A_bar = torch.exp(delta_l[..., None] * A.float())  # [b l d n]
    X = (delta_l * u_l)[..., None] * _per_channel(B.float(), d)  # delta_t B_t u_t
    states = linear_scan(A_bar, X)  # from zero
    y = (states * _per_channel(C.float(), d)).sum(-1)  # [b l d]
    out = rearrange(y, "b l d -> b d l")
    if D is not None:
        out = out + u * D.float()[:, None]
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(dtype_in)
    return (out, states[:, -1]) if return_last_state else out


def causal_conv1d_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, seq_idx: Tensor | None = None,
                            initial_states: Tensor | None = None, return_final_states: bool = False,
                            final_states_out: Tensor | None = None,
                            activation: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """causal_conv1d_fn's semantics. x: [b d l]; weight: [d width]; initial_states: [b d width-1]."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    if seq_idx is not None:
        raise NotImplementedError("seq_idx (packed sequences) has no stand-in")
    dtype_in, seq_len = x.dtype, x.shape[-1]
    width = weight.shape[1]
    x = x.to(weight.dtype)
    before = x.new_zeros(*x.shape[:2], width - 1) if initial_states is None else initial_states.to(weight.dtype)
    padded = torch.cat([before, x], dim=-1)  # [b d width-1+l]
    out = F.conv1d(padded, weight[:, None, :], bias, groups=weight.shape[0])[..., :seq_len]
    if activation is not None:
        out = F.silu(out)
    out = out.to(dtype_in)
    if not return_final_states:
        return out
    final = padded[..., padded.shape[-1] - (width - 1):].to(dtype_in)  # the last width-1 inputs
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return out, final


def chunk_scan_combined_reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                                  D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                                  initial_states: Tensor | None = None, seq_idx: Tensor | None = None,
                                  dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
                                  return_final_states: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """mamba_chunk_scan_combined's semantics. x, z: [b l h p]; dt: [b l h]; A: [h]; B, C: [b l g n];
    D: [h] or [h p]; initial_states: [b h p n]."""
    if seq_idx is not None:
        raise NotImplementedError("seq_idx (packed sequences) has no stand-in")
    dtype_in = x.dtype
    x, dt = x.float(), dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    h0 = None if initial_states is None else initial_states.float()
    y, h_last = ssd_chunked(x, dt, A.float(), B.float(), C.float(), chunk_size, h0=h0)
    if D is not None:
        y = y + x * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    out = y.to(dtype_in)
    return (out, h_last) if return_final_states else out
