"""The mamba-ssm / causal-conv1d / fla kernels behind our ops' signatures (the "fused" scan backend).

Glossary
    kernels        a `Kernels`: the kernel functions, each None where not importable
    installed      what this process can import (`mamba_ssm_kernels()`; `pip install hooked[cuda]`): mamba-ssm's
                   CUDA selective scan and Triton SSD, state update and gated RMSNorm; causal-conv1d's CUDA
                   conv; flash-linear-attention's Triton causal conv and delta rules (ops/fla_kernels.py)
    REFERENCE      our stand-ins with the kernels' reference semantics (fused_reference.py): the
                   same calls, layouts and casts, on any device, so the fused wiring runs on a CPU
    real           a `Kernels` whose functions take CUDA tensors only (the installed ones). real=False: they
                   take any device and dtype (the stand-ins; the Triton kernels under TRITON_INTERPRET=1,
                   tests/triton_interpret/)
    taken          whether a kernel can take a call: on CUDA, a float16 / bfloat16 / float32 input,
                   and the kernel's own limits (selective_scan_fn has no initial state; causal-conv1d's
                   width is 2 to 4). Otherwise the wrapper computes the same thing with another kernel
                   (fla's conv for causal-conv1d's) or our own op
    ran            an optional list each wrapper appends the name of what computed its call to
                   ("fla.chunk_gated_delta_rule", "mamba_ssm.selective_state_update", "hooked.ssd_chunked"):
                   a mixer keeps them (`last_kernels`), `backends.active(model, kernels=True)` lists them

Each wrapper has the signature and the result of the op it replaces, so a mixer can call either:
    selective_scan_fused(u, dt, A, B, C, h0=None)  ~ selective_scan / selective_scan_chunked
    causal_conv1d_fused(x, weight, bias=None)      ~ causal_conv1d
    ssd_fused(x, dt, A, B, C, chunk_size, h0=None) ~ ssd_chunked (one position from h0 without autograd:
                                                   selective_state_update)
    rms_norm_gated_fused(x, z, weight, eps, group_size, norm_before_gate) ~ the Mamba-2 gates (None where no
                                                   kernel takes it: the mixer's own norm runs)
Every kernel is called with keywords only (positions differ between kernels and releases).
Inputs are our layout ([batch pos ...]); the wrappers transpose to the kernels' and back. dt is
given after softplus (hook_dt), so no delta_bias / softplus / D / z is passed: the hooks between
them keep firing and edits to them propagate. Results come back in the input's dtype (the kernels
compute in float32). With `kernels=None` the real kernels are used where importable and the input
is on CUDA; pass `kernels=REFERENCE` to force the stand-ins (tests, or a user who wants this path
on a CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from hooked.ops.conv import causal_conv1d
from hooked.ops.fused_reference import (
    causal_conv1d_reference,
    chunk_scan_combined_reference,
    selective_scan_reference,
)
from hooked.ops.scan_chunked import selective_scan_chunked
from hooked.ops.ssd import ssd_chunked

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONV_WIDTHS = (2, 3, 4)  # causal-conv1d's kernel


@dataclass(frozen=True)
class Kernels:
    selective_scan_fn: Callable | None = None  # mamba_ssm.ops.selective_scan_interface
    causal_conv1d_fn: Callable | None = None  # causal_conv1d
    mamba_chunk_scan_combined: Callable | None = None  # mamba_ssm.ops.triton.ssd_combined
    real: bool = True  # False: they take any device and dtype (stand-ins; Triton under its interpreter)
    selective_state_update: Callable | None = None  # mamba_ssm.ops.triton.selective_state_update
    rmsnorm_fn: Callable | None = None  # mamba_ssm.ops.triton.layernorm_gated: gated RMSNorm
    fla_causal_conv1d: Callable | None = None  # fla.modules.causal_conv1d.causal_conv1d (Triton)
    chunk_gated_delta_rule: Callable | None = None  # fla.ops.gated_delta_rule
    fused_recurrent_gated_delta_rule: Callable | None = None  # fla.ops.gated_delta_rule
    chunk_kda: Callable | None = None  # fla.ops.kda
    fused_recurrent_kda: Callable | None = None  # fla.ops.kda


REFERENCE = Kernels(selective_scan_reference, causal_conv1d_reference, chunk_scan_combined_reference, real=False)


def _try_import(module: str, name: str) -> Callable | None:
    try:  # a broken build raises OSError / RuntimeError at import, not only ImportError
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception:  # noqa: BLE001
        return None


@functools.cache
def mamba_ssm_kernels() -> Kernels:
    """The kernels this process can import (each None where not), imported once."""
    return Kernels(
        selective_scan_fn=_try_import("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
        causal_conv1d_fn=_try_import("causal_conv1d", "causal_conv1d_fn"),
        mamba_chunk_scan_combined=_try_import("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
        selective_state_update=_try_import("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
        rmsnorm_fn=_try_import("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn"),
        fla_causal_conv1d=_try_import("fla.modules.causal_conv1d", "causal_conv1d"),
        chunk_gated_delta_rule=_try_import("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
        fused_recurrent_gated_delta_rule=_try_import("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
        chunk_kda=_try_import("fla.ops.kda", "chunk_kda"),
        fused_recurrent_kda=_try_import("fla.ops.kda", "fused_recurrent_kda"),
    )


def fused_available(device: torch.device | str, op: str = "selective_scan_fn") -> bool:
    """Whether the real kernel `op` (a Kernels field name) would run on `device`."""
    return torch.device(device).type == "cuda" and getattr(mamba_ssm_kernels(), op) is not None


def kernel_name(fn: Callable) -> str:
    """'package.function' of a kernel ('fla.chunk_kda'; our stand-ins and ops: 'hooked.<name>')."""
    return f"{fn.__module__.split('.')[0]}.{getattr(fn, '__name__', type(fn).__name__)}"


def record(ran: list[str] | None, fn: Callable) -> None:
    """Append what computed a call to `ran` (the module glossary), when a list is given."""
    if ran is not None:
        ran.append(kernel_name(fn))


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors: the decoding kernels (selective_state_update, fla's
    fused_recurrent_*) have no backward, so such a call takes the prompt kernel instead."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _pick(kernels: Kernels | None, op: str, *tensors: Tensor) -> Callable | None:
    """The kernel function that takes this call, or None (then our own op computes it)."""
    kernels = mamba_ssm_kernels() if kernels is None else kernels
    fn = getattr(kernels, op)
    if fn is not None and kernels.real and not all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors):
        return None
    return fn


def selective_scan_fused(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    *,
    kernels: Kernels | None = None,
    ran: list[str] | None = None,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """selective_scan's result through mamba-ssm's selective_scan_fn (or its stand-in).

    The kernel has no initial state: with h0 this is selective_scan_chunked. B and C are cast to
    u's dtype (the kernel's rule for varying B, C), A to float32.

    Args:
        as selective_scan; kernels: None (the real ones where they run), or REFERENCE; ran: module glossary.
    Returns:
        y (no D skip) in u's dtype, and h_last, the state after the last position, in u's dtype.
    """
    fn = _pick(kernels, "selective_scan_fn", u, dt, B, C)
    if fn is None or h0 is not None:
        record(ran, selective_scan_chunked)
        return selective_scan_chunked(u, dt, A, B, C, h0)
    record(ran, fn)
    to_kernel = lambda t: t.to(u.dtype).transpose(1, 2)  # noqa: E731  [b l c] -> [b c l]
    y, h_last = fn(u=to_kernel(u), delta=to_kernel(dt), A=A.float(), B=to_kernel(B), C=to_kernel(C), D=None, z=None,
                   delta_bias=None, delta_softplus=False, return_last_state=True)
    return y.transpose(1, 2), h_last.to(u.dtype)


def causal_conv1d_fused(
    x: Float[Tensor, "batch pos channels"],
    weight: Float[Tensor, "channels width"],
    bias: Float[Tensor, "channels"] | None = None,
    *,
    kernels: Kernels | None = None,
    ran: list[str] | None = None,
) -> Float[Tensor, "batch pos channels"]:
    """causal_conv1d's result through causal-conv1d's kernel (or its stand-in), else fla's Triton conv, else
    ours; no activation.

    causal-conv1d takes widths 2..4, x channel-last ([b c l] with the channel stride 1: its other layout, no
    copy); fla's conv takes our layout [b l c] and any width.
    """
    fn = _pick(kernels, "causal_conv1d_fn", x, weight)
    if fn is not None and weight.shape[1] in CONV_WIDTHS:
        record(ran, fn)
        return fn(x=x.transpose(1, 2), weight=weight, bias=bias, activation=None).transpose(1, 2)
    fn = _pick(kernels, "fla_causal_conv1d", x, weight)
    if fn is not None:
        record(ran, fn)
        return fn(x=x, weight=weight, bias=bias, activation=None)[0]
    record(ran, causal_conv1d)
    return causal_conv1d(x, weight, bias)


def ssd_fused(
    x: Float[Tensor, "batch pos n_heads d_head"],
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    chunk_size: int,
    h0: Float[Tensor, "batch n_heads d_head d_state"] | None = None,
    *,
    kernels: Kernels | None = None,
    ran: list[str] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Float[Tensor, "batch n_heads d_head d_state"]]:
    """ssd_chunked's result through mamba-ssm's mamba_chunk_scan_combined (or its stand-in); one position
    from a state (a decoding step) through selective_state_update where it is there and no gradient is
    recorded (it has no backward).

    The kernel's layout is ours; it takes the initial state. dt, B, C are cast to x's dtype, A to
    float32.

    Args:
        as ssd_chunked; kernels: None (the real ones where they run), or REFERENCE; ran: module glossary.
    Returns:
        y (no D skip) in x's dtype, and h_last in x's dtype.
    """
    if x.shape[1] == 1 and h0 is not None and not needs_grad(x, dt, A, B, C, h0):
        fn = _pick(kernels, "selective_state_update", x, dt, B, C, h0)
        if fn is not None:
            record(ran, fn)
            return _state_update(fn, x, dt, A, B, C, h0)
    fn = _pick(kernels, "mamba_chunk_scan_combined", x, dt, B, C)
    if fn is None:
        record(ran, ssd_chunked)
        return ssd_chunked(x, dt, A, B, C, chunk_size, h0=h0)
    record(ran, fn)
    y, h_last = fn(x=x, dt=dt.to(x.dtype), A=A.float(), B=B.to(x.dtype), C=C.to(x.dtype), chunk_size=chunk_size,
                   D=None, z=None, dt_bias=None, initial_states=h0, dt_softplus=False, return_final_states=True)
    return y, h_last.to(x.dtype)


def _state_update(fn: Callable, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  h0: Tensor) -> tuple[Tensor, Tensor]:
    """One position of the SSD recurrence through selective_state_update, which writes the state in place
    (into a float32 copy of h0 here). dt and A are per head, given to the kernel as stride-0 views over
    d_head (its tied fast path); its dt_bias and D must be tensors (None crashes its launch): zeros, as dt
    is after softplus and the D skip is added outside (hook_ssm_out)."""
    n_heads, d_head, d_state = h0.shape[1:]
    state = h0.float().clone()
    zeros = h0.new_zeros(1, 1, dtype=torch.float32).expand(n_heads, d_head)
    out = fn(state=state, x=x[:, 0], dt=dt[:, 0, :, None].to(x.dtype).expand(-1, -1, d_head),
             A=A.float()[:, None, None].expand(n_heads, d_head, d_state), B=B[:, 0].to(x.dtype), C=C[:, 0].to(x.dtype),
             D=zeros, z=None, dt_bias=zeros, dt_softplus=False)
    return out[:, None].to(x.dtype), state.to(x.dtype)


def rms_norm_gated_fused(
    x: Float[Tensor, "*batch d"],
    z: Float[Tensor, "*batch d"],
    weight: Float[Tensor, "d"],
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    *,
    kernels: Kernels | None = None,
    ran: list[str] | None = None,
) -> Float[Tensor, "*batch d"] | None:
    """A Mamba-2 gate through mamba-ssm's Triton gated RMSNorm, or None where no kernel takes the call (the
    mixer's own norm then runs). norm_before_gate=False: RMSNorm(x SiLU(z)) per group (HF's
    MambaRMSNormGated); True: weight RMSNorm(x) SiLU(z) (Falcon-H1's). In x's dtype, computed in float32."""
    fn = _pick(kernels, "rmsnorm_fn", x, z, weight)
    if fn is None:
        return None
    record(ran, fn)
    return fn(x=x, weight=weight, bias=None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
