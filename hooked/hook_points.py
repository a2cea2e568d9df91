"""Hook points: named identity modules where a user reads or replaces an activation.

Glossary
    HookPoint      an identity module placed on one named quantity, `x = self.hook_x(x)`. Its name is
                   its path in the module tree ("blocks.3.attn.hook_pattern"), set by `setup()`.
    hook function  `fn(tensor, hook) -> tensor | None`; returning a tensor replaces the activation
                   (same shape and dtype, or a ValueError names the hook).
    active         a HookPoint with at least one hook (or while the forward order is being
                   recorded). Models build costly quantities (states, kernels, per-head writes) only
                   for active HookPoints: `if self.hook_h.is_active: ...`.
    HookedRootModule  the model's root: `hook_dict`, `run_with_hooks`, `run_with_cache`, `hooks()`.

Hooks added through `run_with_hooks`, `run_with_cache` or `hooks()` are removed on exit, also when
the forward or a hook raises. Hooks added with `add_hook` stay until `reset_hooks()`.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch import Tensor, nn

HookFn = Callable[[Tensor, "HookPoint"], Union[Tensor, None]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]


class _Recording:
    """While `active`, every HookPoint counts as active and calls `on_fire(name)` (forward order)."""

    active: bool = False
    on_fire: Callable[[str], None] | None = None


_RECORDING = _Recording()


class HookPoint(nn.Module):
    """Identity module with TransformerLens-style hooks `fn(tensor, hook)`."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None
        self._hooks: list[HookFn] = []

    @property
    def is_active(self) -> bool:
        """True when something listens here; lazy quantities are computed only then."""
        return bool(self._hooks) or _RECORDING.active

    def add_hook(self, fn: HookFn, prepend: bool = False) -> Callable[[], None]:
        """Add `fn`; returns a function that removes exactly this hook."""
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} must be callable, got {type(fn).__name__}")
        if prepend:
            self._hooks.insert(0, fn)
        else:
            self._hooks.append(fn)

        def remove() -> None:
            if fn in self._hooks:
                self._hooks.remove(fn)

        return remove

    def remove_hooks(self) -> None:
        self._hooks.clear()

    def __call__(self, x: Tensor) -> Tensor:  # skips nn.Module's call machinery: this is the hot path
        if _RECORDING.active and _RECORDING.on_fire is not None:
            _RECORDING.on_fire(self.name)
        for fn in list(self._hooks):
            out = fn(x, self)
            if out is None:
                continue
            if not isinstance(out, Tensor):
                raise TypeError(f"hook on {self.name!r} returned {type(out).__name__}, expected a Tensor or None")
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(
                    f"hook on {self.name!r} returned shape {tuple(out.shape)} dtype {out.dtype}; "
                    f"the activation has shape {tuple(x.shape)} dtype {x.dtype}"
                )
            x = out
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self(x)

    def extra_repr(self) -> str:
        return f"{self.name}, {len(self._hooks)} hook(s)" if self._hooks else str(self.name)


class HookedRootModule(nn.Module):
    """Root of a hooked model. Subclasses call `self.setup()` at the end of `__init__`."""

    def setup(self) -> None:
        """Name every HookPoint after its module path. A HookPoint reachable under two names is a bug."""
        seen: dict[int, str] = {}
        for name, module in self.named_modules(remove_duplicate=False):
            if isinstance(module, HookPoint):
                if id(module) in seen and seen[id(module)] != name:
                    raise RuntimeError(f"HookPoint shared between {seen[id(module)]!r} and {name!r}")
                seen[id(module)] = name
                module.name = name
        self._points = {n: m for n, m in self.named_modules() if isinstance(m, HookPoint)}
        self._hook_order: list[str] | None = None

    # ----------------------------------------------------------------------------------- lookup
    def _example_input(self) -> Any:
        """A tiny input used once to record the forward order of the hooks."""
        return torch.zeros(1, 2, dtype=torch.long, device=self._device())

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _module_hooks(self) -> dict[str, HookPoint]:
        if getattr(self, "_points", None) is None:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call self.setup()")
        return self._points

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Every HookPoint of the model, in forward order (recorded once on a 2-token input)."""
        points = self._module_hooks()
        if getattr(self, "_hook_order", None) is None:
            self._hook_order = self._record_order(points)
        ordered = {n: points[n] for n in self._hook_order if n in points}
        ordered.update({n: p for n, p in points.items() if n not in ordered})
        return ordered

    def _record_order(self, points: dict[str, HookPoint]) -> list[str]:
        order: list[str] = []
        saved = {n: p._hooks for n, p in points.items()}
        try:
            for p in points.values():  # user hooks must not fire during the recording run
                p._hooks = []
            _RECORDING.active, _RECORDING.on_fire = True, lambda n: order.append(n) if n not in order else None
            with torch.no_grad():
                self(self._example_input())
        finally:
            _RECORDING.active, _RECORDING.on_fire = False, None
            for n, p in points.items():
                p._hooks = saved[n]
        return order

    def _resolve(self, name: str | Callable[[str], bool]) -> list[HookPoint]:
        points = self._module_hooks()
        if callable(name):
            return [p for n, p in self.hook_dict.items() if name(n)]
        if not isinstance(name, str):
            raise TypeError(f"a hook name must be a str or a callable filter, got {type(name).__name__}")
        if name in points:
            return [points[name]]
        close = difflib.get_close_matches(name, list(points), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise KeyError(f"unknown hook name {name!r}{hint}")

    def names_matching(self, names_filter: NamesFilter) -> list[str]:
        """Hook names selected by a filter: None (all), a name, a list of names, or a predicate."""
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return [p.name for p in self._resolve(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        return [p.name for n in names_filter for p in self._resolve(n)]

    # ------------------------------------------------------------------------------ add / remove
    def add_hook(self, name: str | Callable[[str], bool], fn: HookFn, dir: str = "fwd",
                 prepend: bool = False) -> list[Callable[[], None]]:
        """Attach `fn` to the named HookPoint(s). dir="bwd" hooks the activation's gradient."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        points = self._resolve(name)
        if dir == "bwd":
            fn = _as_backward_hook(fn)
        return [p.add_hook(fn, prepend=prepend) for p in points]

    def reset_hooks(self) -> None:
        for p in self._module_hooks().values():
            p.remove_hooks()

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[HookSpec] = (), bwd_hooks: Sequence[HookSpec] = ()) -> Iterator["HookedRootModule"]:
        """Context manager: hooks are attached on entry and removed on exit, whatever happens."""
        removers: list[Callable[[], None]] = []
        try:
            # resolve everything first so that a bad name attaches nothing
            plan = [(self._resolve(n), fn, False) for n, fn in fwd_hooks]
            plan += [(self._resolve(n), _as_backward_hook(fn), True) for n, fn in bwd_hooks]
            for points, fn, _ in plan:
                for p in points:
                    removers.append(p.add_hook(fn))
            yield self
        finally:
            for remove in reversed(removers):
                remove()

    def run_with_hooks(self, *args: Any, fwd_hooks: Sequence[HookSpec] = (), bwd_hooks: Sequence[HookSpec] = (),
                       **kwargs: Any) -> Any:
        """Run the forward with temporary hooks."""
        with self.hooks(fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks):
            return self(*args, **kwargs)

    def run_with_cache(self, *args: Any, names_filter: NamesFilter = None, device: str | torch.device | None = None,
                       remove_batch_dim: bool = False, detach: bool = True, **kwargs: Any):
        """Run the forward and return (output, ActivationCache) of the selected hooks.

        Lazy quantities (states, kernels, per-head writes) are built for the selected hooks only.
        """
        from hooked.cache import ActivationCache

        store: dict[str, Tensor] = {}

        def save(x: Tensor, hook: HookPoint) -> None:
            y = x.detach() if detach else x
            store[hook.name] = y.to(device) if device is not None else y

        names = self.names_matching(names_filter)
        with self.hooks(fwd_hooks=[(n, save) for n in names]):
            out = self(*args, **kwargs)
        cache = ActivationCache({n: store[n] for n in self.hook_dict if n in store}, self)
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
        return out, cache

    def hook_names(self, pattern: str | None = None) -> list[str]:
        """Hook names in forward order, optionally filtered by a regular expression."""
        names = list(self.hook_dict)
        return [n for n in names if re.search(pattern, n)] if pattern else names


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def through_hook(hook: HookPoint, value: Tensor,
                 rebuild: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """Pass a lazily built tensor through its hook: (value after the hook, value before it | None).

    The second item is None when the hooks changed nothing (returned None, the same tensor, or an
    equal copy), so that the model keeps its fast path and stays bit-identical. An in-place edit is
    seen through the tensor's version counter and the original is rebuilt with `rebuild()`; tensors
    made under torch.inference_mode() have no counter, so a copy is kept to compare with.
    """
    if not hook._hooks:
        return hook(value), None
    version = _version(value)
    saved = value.clone() if version is None else None
    out = hook(value)
    if saved is not None:
        original = saved if not torch.equal(saved, value) else value
    elif _version(value) != version:
        original = rebuild() if rebuild is not None else None
        if original is None:
            raise RuntimeError(f"{hook.name}: edited in place, and its original cannot be rebuilt")
    else:
        original = value
    if original is value and (out is value or torch.equal(out, value)):
        return out, None
    return out, original


def _as_backward_hook(fn: HookFn) -> HookFn:
    """Wrap `fn(grad, hook)` so that it runs on the gradient of the hooked activation."""

    def fwd(x: Tensor, hook: HookPoint) -> None:
        if x.requires_grad:
            x.register_hook(lambda g: fn(g, hook))

    return fwd
