"""Which algorithm each SSM mixer and attention layer runs, per forward: forcing one, reading what ran.

    with hooked.backends.use(scan="chunked", attention="sdpa"):
        logits = model(tokens)
    hooked.backends.active(model)   # {"blocks.0.mixer": "chunked", "blocks.1.attn": "sdpa", ...}

Glossary
    scan backend       "loop" (the sequential scan, Mamba-2's chunked SSD), "chunked" (the two-level
                       scan, ops/scan_chunked.py: few launches, for GPUs) or "fused" (mamba-ssm's
                       kernels, ops/fused.py; their stand-ins with the same semantics where the kernels
                       cannot run, so the wiring runs on a CPU too); the delta-rule mixers' "fused" is
                       fla's chunked / recurrent rule (ops/fla_kernels.py), a short conv's causal-conv1d's
                       or fla's conv
    attention backend  "eager" (scores and pattern built) or "sdpa" (ops/sdpa.py: neither built)
    exact path         every per-position quantity built and hookable: "loop" or "chunked" for a
                       scan (equal but for rounding), "eager" for attention. The fused scan and SDPA
                       hand back only y / z (and the last state)
    exact hook         an active hook on a quantity only the exact path builds (backend_rules.py:
                       hook_A_bar, hook_B_bar, hook_h, hook_kernel, hook_attn_scores, hook_pattern, the
                       soft-cap's hooks), or a hook function marked with `exact_hook(fn)` on any of the
                       layer's hook points (knockout marks its SSM cut: it subtracts kernel terms from
                       y, so y must come from the exact path)
    forced             what the innermost `use(...)` of this thread / asyncio task names (None: the
                       default). An exact hook wins: a forced "fused" then runs "loop" on a CPU,
                       "chunked" on CUDA; a forced "sdpa" runs "eager"
    default            scan: "loop" on a CPU (one chunk stays in cache: fastest there), on CUDA "fused"
                       where the layer's kernel package is installed (mamba-ssm; fla for the delta rule;
                       causal-conv1d or fla for a short conv), else "chunked"; an exact hook on CUDA: "chunked".
                       "fused" becomes the device's exact algorithm for float64 and for Mamba-1 with
                       an initial state (the kernels take neither). Attention: "sdpa", except a
                       soft-capped layer and a selected state's shared past ("eager")
    used               what a layer's last forward ran, kept on the module (`last_backend`; the kernels it
                       called, `last_kernels`) and listed by `active(model)` under the layer's module path

Like scoped hooks, `use` is seen only by the thread (or asyncio task) that entered it. Outside every
`use` block no context variable is read, so a hook-free forward compiles without a graph break.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hooked.backend_rules import ATTENTIONS, SCANS, choose_attention, choose_scan, needs_exact
from hooked.hook_points import HookPoint, hook_free
from hooked.ops.fused import KERNEL_DTYPES, REFERENCE, Kernels

_FORCED: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "hooked_backends", default=(None, None))
_LOCK = threading.Lock()
_open = 0  # `use` blocks open in any thread: while 0, forced() reads no context variable


@contextlib.contextmanager
def use(scan: str | None = None, attention: str | None = None) -> Iterator[None]:
    """Force a scan backend ("loop", "chunked", "fused") and / or an attention backend ("eager",
    "sdpa") for the forwards this thread / task runs inside the block; None keeps the outer choice.
    Exact hooks still win (module glossary)."""
    global _open
    if scan is not None and scan not in SCANS:
        raise ValueError(f"scan backend must be one of {SCANS}, got {scan!r}")
    if attention is not None and attention not in ATTENTIONS:
        raise ValueError(f"attention backend must be one of {ATTENTIONS}, got {attention!r}")
    outer_scan, outer_attention = forced()
    with _LOCK:
        _open += 1
    token = _FORCED.set((scan or outer_scan, attention or outer_attention))
    try:
        yield
    finally:
        _FORCED.reset(token)
        with _LOCK:
            _open -= 1


def forced() -> tuple[str | None, str | None]:
    """(scan, attention) forced for this thread / task, None where not forced."""
    return _FORCED.get() if _open else (None, None)


def exact_hook(fn: Callable) -> Callable:
    """Mark a hook function as needing its layer's exact path (returns fn, marked)."""
    fn.needs_exact = True
    return fn


def active(model: nn.Module, *, kernels: bool = False) -> dict[str, str]:
    """What each mixer and attention layer ran in its last forward, by module path (run it first).

    kernels=True: each backend followed by the kernels its layer called on the fused path, in call order
    (ops/fused.py's `ran`: "fused: fla.causal_conv1d, fla.chunk_gated_delta_rule"; our own ops are
    "hooked.<op>", the stand-ins "hooked.<name>_reference")."""
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "last_backend", None):
            called = getattr(m, "last_kernels", ()) if kernels else ()
            out[name] = m.last_backend + (": " + ", ".join(called) if called else "")
    return out


def _exact(module: nn.Module) -> bool:
    """Whether an exact hook is active on one of `module`'s hook points (module glossary)."""
    if hook_free():  # nothing listens anywhere: no walk over the module's points
        return False
    listened = [(name, p) for name, p in module.named_modules() if isinstance(p, HookPoint) and p.is_active]
    if needs_exact(name for name, _ in listened):
        return True
    return any(getattr(h.fn, "needs_exact", False) for _, p in listened for h in p.visible_hooks())


def _found(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# Whether each kernel's package is installed, looked up once at import without importing it: torch.compile
# reads a constant here, never an import (a broken build still falls back, ops/fused.py). "causal_conv1d": a
# short conv's kernel, causal-conv1d's or else fla's
_INSTALLED = {op: _found(package) for op, package in (("selective_scan_fn", "mamba_ssm"),
                                                       ("mamba_chunk_scan_combined", "mamba_ssm"),
                                                       ("causal_conv1d_fn", "causal_conv1d"),
                                                       ("chunk_gated_delta_rule", "fla"))}
_INSTALLED["causal_conv1d"] = _INSTALLED["causal_conv1d_fn"] or _INSTALLED["chunk_gated_delta_rule"]


def _fused_available(device: torch.device, op: str = "selective_scan_fn") -> bool:
    return device.type == "cuda" and _INSTALLED[op]


def scan_backend(mixer: nn.Module, device: torch.device, dtype: torch.dtype, *, op: str = "selective_scan_fn",
                 has_initial_state: bool = False) -> str:
    """The scan backend `mixer` runs now (also kept as mixer.last_backend): backend_rules.choose_scan
    with this forward's hooks, forcing, device, initial state and dtype (the scan's compute dtype);
    op: the mamba-ssm kernel the mixer's "fused" path calls (ops/fused.py's Kernels field)."""
    choice = choose_scan(exact=_exact(mixer), forced=forced()[0], on_cuda=device.type == "cuda",
                         fused_importable=_fused_available(device, op), has_initial_state=has_initial_state,
                         kernel_dtype=dtype in KERNEL_DTYPES)
    mixer.last_backend = choice
    return choice


def attention_backend(attn: nn.Module, *, softcap: bool, shared_past: bool, on_cuda: bool = True,
                      windowed: bool = False) -> str:
    """The attention backend `attn` runs now (also kept as attn.last_backend)."""
    choice = choose_attention(exact=_exact(attn), forced=forced()[1], softcap=softcap, shared_past=shared_past,
                              on_cuda=on_cuda, windowed=windowed)
    attn.last_backend = choice
    return choice


def fused_kernels(device: torch.device) -> Kernels | None:
    """The kernels for a "fused" scan on `device`: the installed ones (None; each op falls back to ours where
    its kernel is absent) on CUDA where mamba-ssm, causal-conv1d or fla is there, else the stand-ins."""
    return None if device.type == "cuda" and any(_INSTALLED.values()) else REFERENCE

