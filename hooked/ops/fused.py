"""The mamba-ssm / causal-conv1d CUDA kernels behind our ops' signatures (the "fused" scan backend).

Glossary
    kernels        a `Kernels`: the three kernel functions, each None where not importable
    MAMBA_SSM      what this process can import (`mamba_ssm_kernels()`; `pip install hooked[cuda]`)
    REFERENCE      our stand-ins with the kernels' reference semantics (fused_reference.py): the
                   same calls, layouts and casts, on any device, so the fused wiring runs on a CPU
    taken          whether a kernel can take a call: on CUDA, a float16 / bfloat16 / float32 input,
                   and the kernel's own limits (selective_scan_fn has no initial state; causal-conv1d's
                   width is 2 to 4). Otherwise the wrapper computes the same thing with our own op

Each wrapper has the signature and the result of the op it replaces, so a mixer can call either:
    selective_scan_fused(u, dt, A, B, C, h0=None)  ~ selective_scan / selective_scan_chunked
    causal_conv1d_fused(x, weight, bias=None)      ~ causal_conv1d
    ssd_fused(x, dt, A, B, C, chunk_size, h0=None) ~ ssd_chunked
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
    real: bool = True  # False: stand-ins, which take any device and dtype


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
        _try_import("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
        _try_import("causal_conv1d", "causal_conv1d_fn"),
        _try_import("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    )


def fused_available(device: torch.device | str, op: str = "selective_scan_fn") -> bool:
    """Whether the real kernel `op` (a Kernels field name) would run on `device`."""
    return torch.device(device).type == "cuda" and getattr(mamba_ssm_kernels(), op) is not None


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
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """selective_scan's result through mamba-ssm's selective_scan_fn (or its stand-in).

    The kernel has no initial state: with h0 this is selective_scan_chunked. B and C are cast to
    u's dtype (the kernel's rule for varying B, C), A to float32.

    Args:
        as selective_scan; kernels: None (the real ones where they run), or REFERENCE.
    Returns:
        y (no D skip) in u's dtype, and h_last, the state after the last position, in u's dtype.
    """
    fn = _pick(kernels, "selective_scan_fn", u, dt, B, C)
    if fn is None or h0 is not None:
        return selective_scan_chunked(u, dt, A, B, C, h0)
    to_kernel = lambda t: t.to(u.dtype).transpose(1, 2)  # noqa: E731  [b l c] -> [b c l]
    y, h_last = fn(to_kernel(u), to_kernel(dt), A.float(), to_kernel(B), to_kernel(C), D=None, z=None,
                   delta_bias=None, delta_softplus=False, return_last_state=True)
    return y.transpose(1, 2), h_last.to(u.dtype)


def causal_conv1d_fused(
    x: Float[Tensor, "batch pos channels"],
    weight: Float[Tensor, "channels width"],
    bias: Float[Tensor, "channels"] | None = None,
    *,
    kernels: Kernels | None = None,
) -> Float[Tensor, "batch pos channels"]:
    """causal_conv1d's result through causal-conv1d's kernel (or its stand-in); no activation.

    Widths outside 2..4 (the kernel's) are causal_conv1d. x goes in channel-last ([b c l] with the
    channel stride 1: the kernel's other layout, no copy).
    """
    fn = _pick(kernels, "causal_conv1d_fn", x, weight)
    if fn is None or weight.shape[1] not in CONV_WIDTHS:
        return causal_conv1d(x, weight, bias)
    out = fn(x.transpose(1, 2), weight, bias, activation=None)
    return out.transpose(1, 2)


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
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Float[Tensor, "batch n_heads d_head d_state"]]:
    """ssd_chunked's result through mamba-ssm's mamba_chunk_scan_combined (or its stand-in).

    The kernel's layout is ours; it takes the initial state. dt, B, C are cast to x's dtype, A to
    float32.

    Args:
        as ssd_chunked; kernels: None (the real ones where they run), or REFERENCE.
    Returns:
        y (no D skip) in x's dtype, and h_last in x's dtype.
    """
    fn = _pick(kernels, "mamba_chunk_scan_combined", x, dt, B, C)
    if fn is None:
        return ssd_chunked(x, dt, A, B, C, chunk_size, h0=h0)
    y, h_last = fn(x, dt.to(x.dtype), A.float(), B.to(x.dtype), C.to(x.dtype), chunk_size, D=None, z=None,
                   dt_bias=None, initial_states=h0, dt_softplus=False, return_final_states=True)
    return y, h_last.to(x.dtype)
