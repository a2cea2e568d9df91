"""Building a model without memory: its parameters on the meta device, its buffers real.

Glossary
    meta build       `build(cfg)` inside `on_meta()`. `torch.empty` (uninitialised memory: how torch's
                     layers and ours allocate a parameter before initialising it) makes a meta tensor
                     (shape and dtype, no memory) and weight initialisation on meta tensors is
                     skipped; tensors made from values (arange, ones, full, linspace, ...) are computed
                     for real, so buffers and constants computed in __init__ keep their values. After
                     the build every parameter is moved to meta
    uninitialised buffer  a buffer made with `torch.empty` and filled in place at build time: the meta
                     build leaves it without values, so its module has `reset_buffers()`, which fills
                     its own buffers in place; `build_on_meta` allocates them on the CPU and calls it
                     (the way `reset_parameters()` refills parameters). A module that needs it and lacks
                     it is refused by name
    materialise      allocate each meta parameter once, uninitialised, in the load's dtype and device
                     (what `to_empty` does, but keeping tied parameters tied and buffers' values); the
                     loader then reads the checkpoint into them

Why not `with torch.device("meta")` (every factory on meta) and recompute every buffer: arithmetic
on meta tensors runs torch's Python reference kernels, which import torch._dynamo and sympy on first
use (1-2 s and ~35-100 MB per process), and torch.device as a context manager also sets a
module-global default device. Here the computed values stay small and real.

Nothing process-wide changes: `on_meta` is a TorchFunctionMode, and torch keeps those per thread,
so a module another thread builds meanwhile is real and initialised. No hook is registered with
torch and no torch function is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_UNINITIALISED = frozenset({torch.empty, torch.empty_strided})
_INIT_FUNCTIONS = frozenset(f for n, f in vars(nn.init).items() if n.endswith("_") and not n.startswith("_")
                            and callable(f))
# Tensor methods that only change values (never shape, dtype or flags): skipped on meta tensors
_VALUE_ONLY = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "erfinv_", "mul_", "add_", "sub_",
                         "div_", "clamp_", "clamp_min_", "clamp_max_", "exp_", "log_", "sqrt_", "random_",
                         "exponential_", "bernoulli_", "log_normal_", "cauchy_", "geometric_", "fmod_",
                         "abs_", "neg_", "reciprocal_", "addcmul_", "addcdiv_", "lerp_", "masked_fill_"})


class _OnMeta(TorchFunctionMode):
    """`torch.empty` without a device makes a meta tensor; nn.init functions and value-only in-place
    ops on a meta tensor return it untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _UNINITIALISED and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        first = args[0] if args else kwargs.get("tensor")
        if isinstance(first, Tensor) and first.is_meta and (
                func in _INIT_FUNCTIONS or getattr(func, "__name__", None) in _VALUE_ONLY):
            return first
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Inside, in this thread only, `torch.empty` makes meta tensors and their initialisation is skipped."""
    with _OnMeta():
        yield


def build_on_meta(build: Callable[[Any], nn.Module], cfg: Any) -> nn.Module:
    """`build(cfg)` with every parameter on meta and every buffer real (uninitialised ones allocated
    on torch's default device and filled by their module's `reset_buffers()`).

    Raises:
        TypeError: a buffer or tensor attribute left on meta that no `reset_buffers()` fills, named.
    """
    with on_meta():
        model = build(cfg)
    _parameters_to_meta(model)
    modules = dict(model.named_modules())
    missing = []
    for name, module in modules.items():
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[n] = torch.empty(b.shape, dtype=b.dtype)
                if not hasattr(module, "reset_buffers"):
                    missing.append(f"{name}.{n}" if name else n)
    with torch.no_grad():
        for module in modules.values():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
    missing += [f"{name}.{n}" if name else n for name, module in modules.items() for n, v in vars(module).items()
                if isinstance(v, Tensor) and v.is_meta]
    if missing:
        raise TypeError(f"{type(model).__name__}: {', '.join(missing)} are made with torch.empty and filled at build "
                        f"time, which a meta build skips; give their modules a reset_buffers() method that fills "
                        f"their buffers in place (the loader calls it once they are allocated)")
    return model


def _parameters_to_meta(model: nn.Module) -> None:
    """Replace every parameter not on meta (one made from values) by a meta one; ties stay ties."""
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None and not p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                m._parameters[n] = new[id(p)]


def materialise(model: nn.Module, dtype: torch.dtype, device: torch.device,
                given: dict[str, Tensor] | None = None) -> None:
    """Allocate the meta parameters, uninitialised, in `dtype` on `device` (what `to_empty` does, but
    keeping tied parameters tied and buffers' values); floating buffers are cast like `.to(dtype)`.
    `given` {parameter name: tensor}: those parameters take that tensor instead (file-backed ones)."""
    new: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta, allocated); meta kept alive
    params = dict(model.named_parameters())
    for name, t in (given or {}).items():
        p = params[name]
        new[id(p)] = (p, nn.Parameter(t, p.requires_grad))
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in new:
                p_dtype = dtype if p.is_floating_point() else p.dtype
                # torch.empty, not empty_like: on meta tensors the latter imports sympy (seconds, ~100 MB)
                new[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=p_dtype, device=device), p.requires_grad))
            m._parameters[n] = new[id(p)][1]
        for n, b in m._buffers.items():
            if b is not None:
                m._buffers[n] = b.to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
