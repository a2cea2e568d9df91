"""Hook points: named identity modules where a user reads or replaces an activation.

Glossary
    HookPoint      an identity module placed on one named quantity, `x = self.hook_x(x)`. Its name is
                   its path in the module tree ("blocks.3.attn.hook_pattern"), set by `setup()`.
    hook function  `fn(tensor, hook) -> tensor | None`; returning a tensor replaces the activation
                   (same shape and dtype, or a ValueError names the hook).
    Hook           one attachment of a hook function: a handle compared by identity, never by
                   equality, so removing it never removes another attachment of an equal function.
    model hook     added with `add_hook`: stored on the HookPoint (`HookPoint._hooks`), seen by every
                   caller in every thread, kept until removed or `reset_hooks()`.
    scoped hook    added by `run_with_hooks`, `run_with_cache`, `hooks()` or `scoped_hooks()`: stored in
                   a context variable (`_SCOPED`), so only the thread (or asyncio task) that added it
                   sees it; one model serves concurrent callers, each with its own hooks and caches.
                   On exit a scope removes exactly its own handles, whatever was added or removed
                   meanwhile, so nested or interleaved scopes restore what they found.
    visible hooks  what a HookPoint runs for the current caller, in order: its caller's scoped hooks
                   added with prepend=True (last prepended first), its model hooks, then the caller's
                   other scoped hooks (in the order added).
    active         a HookPoint with at least one visible hook (or while this caller records the
                   forward order). Models build costly quantities (states, kernels, per-head writes)
                   only for active HookPoints: `if self.hook_h.is_active: ...`.
    tap            a module that runs on a HookPoint's activation after its hooks, registered as the
                   point's child (so its own HookPoints are named under it): an SAE splice
                   (`{hook}.sae.hook_sae_acts_post`, hooked/sae/splice.py) or a view
                   (`{hook}.hook_heads`). A tap has `is_active`; the point counts as active while one is.
    lazy           `HookPoint(lazy=True)` marks such a costly quantity. A bare `run_with_cache()`
                   leaves lazy hooks out; a filter that selects them (or `incl_lazy=True`) takes them,
                   after the size check of `hooked.cache_budget`.
    permanent      a model hook added with `add_hook(..., is_permanent=True)`: `reset_hooks()` keeps
                   it, `reset_hooks(including_permanent=True)` removes it (TransformerLens's API).
    axes           what each axis of the activation is, declared where the HookPoint is made:
                   `HookPoint("batch pos n_heads d_head")`. Words are DESIGN section 3's (batch, pos,
                   q_pos, k_pos, d_model, d_vocab, n_heads, n_kv_heads, d_head, d_mlp, d_inner,
                   d_state, n_groups, ...) or an integer literal ("1"). A size word is read from the
                   `dims` of the modules on the hook's path, nearest first (the root supplies
                   d_model and d_vocab): `model.hook_shape(name, batch=, pos=)` needs no forward.
                   A HookPoint made without axes is a residual-stream quantity, "batch pos d_model".
    element        the activation's element type relative to the model's: "model" (its dtype),
                   "wide" (at least float32, whatever the model's dtype) or "int64" (indices).
    HookedRootModule  the model's root: `hook_dict`, `add_hook`, `run_with_hooks`, `run_with_cache`, `hooks()`.

    hook-free      no HookPoint of the process has a model hook, a scoped hook in any thread or task, or
                   a recording in progress: `__call__` and `is_active` then return at once, reading
                   two attributes and no context variable, so `torch.compile` traces a hook-free
                   forward without a graph break; its guards on those counters see a hook added later
                   (recompiled then, the hook fires).

Scoped hooks are removed on exit, also when the forward or a hook raises (KeyboardInterrupt included).
Model hooks stay until `reset_hooks()`. Caveat of context variables: a generator that yields inside
`with model.hooks(...)` lends its hooks to whoever iterates it, until it resumes and leaves the block.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import re
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor, nn

from hooked.validate import Device, Flag, Integer, WrongType, check, checked, pos_index

HookFn = Callable[[Tensor, "HookPoint"], Union[Tensor, None]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]


class Hook:
    """One attachment of `fn`: a handle, equal only to itself (two adds of one fn are two Hooks).
    `dir` is "fwd", or "bwd" for a wrapped backward hook (TL's `remove_hooks(dir=)` selects by it)."""

    __slots__ = ("fn", "dir")

    def __init__(self, fn: HookFn, dir: str = "fwd") -> None:
        self.fn = fn
        self.dir = dir

    def __repr__(self) -> str:
        return f"Hook({getattr(self.fn, '__qualname__', self.fn)!r})"

    def detach(self) -> None:
        """Called once the hook is removed: a wrapped backward hook drops its gradient hooks then
        (`fn.remove_grad_hooks`, when the wrapper has one), so it does not fire in a later backward."""
        getattr(self.fn, "remove_grad_hooks", lambda: None)()


# --------------------------------------------------------------------------- caller-local state
# HookPoint -> (scoped hooks added with prepend, the others). The dict is never mutated once set:
# a scope copies it, so what another context holds is never changed under it.
_ScopedHooks = Mapping["HookPoint", tuple[tuple[Hook, ...], tuple[Hook, ...]]]
_SCOPED: contextvars.ContextVar[_ScopedHooks] = contextvars.ContextVar("hooked_scoped_hooks",
                                                                      default=types.MappingProxyType({}))
# While this caller records the forward order (and sizes): called with each HookPoint's name and
# activation as it fires.
_RECORDING: contextvars.ContextVar[Callable[[str, Tensor], None] | None] = contextvars.ContextVar(
    "hooked_recording", default=None)
# Process-wide counts that let a HookPoint skip the context variables when nothing can listen: the
# scoped hooks attached to each point in any context (HookPoint._n_scoped) and the recordings in
# progress. They only over-count while a scope is open, so a hook is never skipped.
_COUNT_LOCK = threading.Lock()
_recordings = 0
_attached = 0  # model hooks, scoped hooks and taps attached to any HookPoint


def hook_free() -> bool:
    """No HookPoint of the process has a hook (model or scoped, any thread) and nothing records: a forward
    may then skip what only hooks read (the forward's context variables), and compile without a break."""
    return not (_attached or _recordings)


def _count_attached(step: int) -> None:
    global _attached
    with _COUNT_LOCK:
        _attached += step


def _count_scoped(points: Sequence["HookPoint"], step: int) -> None:
    global _attached
    with _COUNT_LOCK:
        for point in points:
            point._n_scoped += step
        _attached += step * len(points)


@contextlib.contextmanager
def recording(on_fire: Callable[[str, Tensor], None]) -> Iterator[None]:
    """While inside, every HookPoint this caller runs calls `on_fire(name, activation)` and no hook."""
    global _recordings
    with _COUNT_LOCK:
        _recordings += 1
    token = _RECORDING.set(on_fire)
    try:
        yield
    finally:
        _RECORDING.reset(token)
        with _COUNT_LOCK:
            _recordings -= 1


@contextlib.contextmanager
def scoped_hooks(attachments: Sequence[tuple["HookPoint", HookFn, bool]]) -> Iterator[list[Hook]]:
    """Attach (HookPoint, fn, prepend) for the current thread / task only; on exit remove these handles.

    Every fn is checked before anything is attached. Yields the Hook handles, in order.
    """
    for point, fn, _ in attachments:
        if not callable(fn):
            raise TypeError(f"hook for {point.name!r} must be callable, got {type(fn).__name__}")
    mine = [(point, Hook(fn), bool(prepend)) for point, fn, prepend in attachments]
    state = dict(_SCOPED.get())
    for point, hook, prepend in mine:
        front, back = state.get(point, ((), ()))
        state[point] = ((hook, *front), back) if prepend else (front, (*back, hook))
    _count_scoped([point for point, _, _ in mine], +1)
    _SCOPED.set(state)
    try:
        yield [hook for _, hook, _ in mine]
    finally:
        ids = {id(hook) for _, hook, _ in mine}
        state = dict(_SCOPED.get())
        for point in {id(p): p for p, _, _ in mine}.values():
            front, back = state.get(point, ((), ()))
            front = tuple(h for h in front if id(h) not in ids)
            back = tuple(h for h in back if id(h) not in ids)
            if front or back:
                state[point] = (front, back)
            else:
                state.pop(point, None)
        _SCOPED.set(state)
        _count_scoped([point for point, _, _ in mine], -1)
        for _, hook, _ in mine:
            hook.detach()


def is_recording() -> bool:
    """True while this caller records the forward order (hook_dict): taps skip input-dependent checks then."""
    return _RECORDING.get() is not None


POSITION_AXES = ("pos", "q_pos", "k_pos")  # sized by the input's length
ELEMENTS = ("model", "wide", "int64")


class HookPoint(nn.Module):
    """Identity module with TransformerLens-style hooks `fn(tensor, hook)`, and its declared axes."""

    _n_scoped = 0  # also for HookPoints unpickled from before the count existed

    def __init__(self, axes: str = "batch pos d_model", lazy: bool = False, element: str = "model") -> None:
        super().__init__()
        if element not in ELEMENTS:
            raise ValueError(f"element must be one of {ELEMENTS}, got {element!r}")
        self.axes: tuple[str, ...] = tuple(axes.split())
        if not self.axes or self.axes[0] != "batch":
            raise ValueError(f"a hook's axes start with 'batch', got {axes!r}")
        self.element = element
        self.sizes: dict[str, int] = {}  # size of each width axis, resolved by the root's setup()
        self.name: str | None = None
        self._hooks: list[Hook] = []  # model hooks (every caller); scoped hooks live in _SCOPED
        self._permanent: list[Hook] = []  # model hooks that survive reset_hooks()
        self._n_scoped = 0  # scoped hooks attached here in any thread / task (module glossary: hook-free)
        self.lazy = lazy  # built only when hooked; a bare run_with_cache() leaves it out (cache_budget.py)
        self.ctx: dict[Any, Any] = {}  # scratch space for hook functions (TL's hook.ctx), cleared by reset_hooks()
        self._taps: tuple[nn.Module, ...] = ()  # run after the hooks, in order (SAE splices, views)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (deepcopy, unpickling) holds its own model hooks and taps: they count as attached (hook-free
        reads the count); it holds no scoped hook, which lives in its scope under the original point."""
        super().__setstate__(state)
        self._n_scoped = 0
        _count_attached(len(self._hooks) + len(self._taps))

    def shape(self, batch: int, pos: int) -> tuple[int, ...]:
        """The activation's shape for a [batch, pos] input of a full forward (no decoding state)."""
        out = []
        for axis in self.axes:
            if axis == "batch":
                out.append(batch)
            elif axis in POSITION_AXES:
                out.append(pos)
            elif axis.isdigit():
                out.append(int(axis))
            elif "*" in axis and all(w in self.sizes for w in axis.split("*")):  # a flattened group (views)
                out.append(math.prod(self.sizes[w] for w in axis.split("*")))
            elif axis in self.sizes:
                out.append(self.sizes[axis])
            else:
                raise KeyError(f"hook {self.name!r}: no module on its path sizes axis {axis!r}")
        return tuple(out)

    def axis(self, word: str) -> int:
        """Index of axis `word` in the activation; "pos" finds q_pos where there are two."""
        for i, a in enumerate(self.axes):
            if a == word or (word == "pos" and a == "q_pos"):
                return i
        raise ValueError(f"hook {self.name!r} has no axis {word!r}; its axes are {' '.join(self.axes)}")

    def layer(self) -> int:
        """The block index of a hook named "blocks.{l}...."; a ValueError for other hooks."""
        parts = (self.name or "").split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(f"hook {self.name!r} is not inside a block (blocks.{{l}}....)")
        return int(parts[1])

    def visible_hooks(self) -> tuple[Hook, ...]:
        """The hooks this caller runs here, in order (see the module glossary)."""
        scoped = _SCOPED.get().get(self)
        if scoped is None:
            return tuple(self._hooks)
        return (*scoped[0], *self._hooks, *scoped[1])

    @property
    def has_hooks(self) -> bool:
        """True when a hook is visible to this caller (the model's or its own scoped ones), or a tap is active."""
        return bool(self._hooks) or (self._n_scoped > 0 and self in _SCOPED.get()) or any(t.is_active for t in self._taps)

    @property
    def is_active(self) -> bool:
        """True when something listens here; lazy quantities are computed only then."""
        if not (self._hooks or self._n_scoped or _recordings or self._taps):
            return False
        return self.has_hooks or _RECORDING.get() is not None

    def add_tap(self, name: str, tap: nn.Module) -> None:
        """Run `tap(x)` after this point's hooks, registered as child `name` (the root's setup() names its points)."""
        if name in self._modules:
            raise ValueError(f"{self.name!r} already has a tap named {name!r}")
        self._modules[name] = tap
        self._taps = (*self._taps, tap)
        _count_attached(1)  # a tap listens as a hook does: the layer's exact path builds what it reads

    def remove_tap(self, name: str) -> nn.Module:
        """Detach and return the tap registered as `name`."""
        tap = self._modules.pop(name)
        self._taps = tuple(t for t in self._taps if t is not tap)
        _count_attached(-1)
        return tap

    def add_hook(self, fn: HookFn, dir: str = "fwd", is_permanent: bool = False, level: Any = None,
                 prepend: bool = False) -> Callable[[], None]:
        """Add a model hook `fn` (seen by every caller); returns a function that removes exactly this one.
        TransformerLens's signature and order: dir="bwd" runs `fn(grad, hook)` on the activation's gradient;
        is_permanent=True survives `reset_hooks()`; `level` (TL's context level) is refused when set."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        if level is not None:
            raise ValueError("level= (TransformerLens's hook context levels) is not supported: use model.hooks() scopes")
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} must be callable, got {type(fn).__name__}")
        hook = Hook(_as_backward_hook(fn) if dir == "bwd" else fn, dir)
        if prepend:
            self._hooks.insert(0, hook)
        else:
            self._hooks.append(hook)
        _count_attached(1)
        if is_permanent:
            self._permanent.append(hook)

        def remove() -> None:
            for i, h in enumerate(self._hooks):
                if h is hook:
                    del self._hooks[i]
                    _count_attached(-1)
                    hook.detach()
                    return

        return remove

    def remove_hooks(self, dir: str = "both", including_permanent: bool = True, level: Any = None) -> None:
        """Remove this point's model hooks of direction `dir` ("fwd", "bwd", "both"), the permanent
        ones only when asked (scoped hooks belong to their scopes; taps stay)."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"dir must be 'fwd', 'bwd' or 'both', got {dir!r}")

        def kept(h: Hook) -> bool:
            return (dir != "both" and h.dir != dir) or (not including_permanent and any(h is p for p in self._permanent))

        keep = [h for h in self._hooks if kept(h)]
        removed = [h for h in self._hooks if not kept(h)]
        self._hooks[:] = keep
        self._permanent[:] = [p for p in self._permanent if any(p is k for k in keep)]
        _count_attached(-len(removed))
        for hook in removed:
            hook.detach()

    def __call__(self, x: Tensor) -> Tensor:  # skips nn.Module's call machinery: this is the hot path
        if not (self._hooks or self._n_scoped or _recordings or self._taps):  # hook-free: no context variable read
            return x
        on_fire = _RECORDING.get()
        if on_fire is not None:  # recording the forward order: no hook runs (taps do, so that theirs record)
            on_fire(self.name, x)
            for tap in self._taps:
                x = tap(x)
            return x
        if not self._hooks and not self._taps and self not in _SCOPED.get():
            return x
        for hook in self.visible_hooks():
            x = self._checked(hook.fn(x, self), x, "hook")
        for tap in self._taps:
            if tap.is_active:
                x = self._checked(tap(x), x, type(tap).__name__)
        return x

    def steps(self) -> list[Callable[[Tensor], Tensor]]:
        """What a call runs, one function per hook and tap, in order (each checked, None -> its input).

        Running them one after another is `self(x)`; hooked.state_edit runs them one at a time so that
        the recurrence is continued between them (a later hook sees the states an earlier edit left)."""
        out: list[Callable[[Tensor], Tensor]] = [
            (lambda x, fn=hook.fn: self._checked(fn(x, self), x, "hook")) for hook in self.visible_hooks()]
        for tap in self._taps:
            if tap.is_active:
                if isinstance(tap, HookPoint):  # a view: its own hooks (and taps), each a step
                    out.extend(tap.tap_steps())
                else:
                    out.append(lambda x, tap=tap: self._checked(tap(x), x, type(tap).__name__))
        return out

    def tap_steps(self) -> list[Callable[[Tensor], Tensor]]:
        """`steps()` of this point run as a tap of its parent (a view reshapes around each)."""
        return self.steps()

    def _checked(self, out: Any, x: Tensor, what: str) -> Tensor:
        """`out` when it may replace `x` (same shape and dtype), `x` for None; otherwise an error naming the hook."""
        if out is None:
            return x
        if not isinstance(out, Tensor):
            raise TypeError(f"{what} on {self.name!r} returned {type(out).__name__}, expected a Tensor or None")
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(
                f"{what} on {self.name!r} returned shape {tuple(out.shape)} dtype {out.dtype}; "
                f"the activation has shape {tuple(x.shape)} dtype {x.dtype}"
            )
        return out

    def forward(self, x: Tensor) -> Tensor:
        return self(x)

    def extra_repr(self) -> str:
        n = len(self.visible_hooks())
        lazy = ", lazy" if self.lazy else ""
        return f"[{' '.join(self.axes)}]{lazy}" + (f", {n} hook(s)" if n else "")


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
        for name, point in self._points.items():
            point.sizes = self._path_dims(name)
        self._hook_order: list[str] | None = None

    def _path_dims(self, name: str) -> dict[str, int]:
        """The `dims` of every module from the root down to `name`'s owner, nearer ones winning."""
        sizes: dict[str, int] = {}
        module: nn.Module = self
        for part in name.split(".")[:-1]:
            sizes.update(getattr(module, "dims", None) or {})
            module = getattr(module, part)
        sizes.update(getattr(module, "dims", None) or {})
        return sizes

    def _make_view(self, name: str) -> HookPoint | None:
        """A hook point made on first use under `name` (hooked.sae.views: `{hook}.hook_heads`); none here."""
        return None

    def _gated(self, name: str) -> bool:
        """True for a hook that filters skip until a switch turns it on (hooked.tl_switches); none here."""
        return False

    def hook_shape(self, name: str | Callable[[str], bool], batch: int = 1, pos: int = 1) -> tuple[int, ...]:
        """Shape of hook `name`'s activation for a [batch, pos] input, from its axes (no forward). A filter
        (a function of the name) must match hooks of one shape."""
        batch, pos = (check(v, f"hook_shape: {what}", Integer(ge=1)) for v, what in ((batch, "batch"), (pos, "pos")))
        shapes: dict[tuple[int, ...], list[str]] = {}
        for p in self._resolve(name):
            shapes.setdefault(tuple(p.shape(batch, pos)), []).append(p.name)
        if not shapes:
            raise ValueError("hook_shape: name: the filter matches no hook")
        if len(shapes) > 1:
            listed = "; ".join(f"{list(shape)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                               for shape, names in shapes.items())
            raise ValueError(f"hook_shape: name: the filter matches hooks of {len(shapes)} shapes: {listed}; pass one name")
        return next(iter(shapes))

    # ----------------------------------------------------------------------------------- lookup
    def _example_input(self, pos: int = 2) -> Any:
        """A tiny input used to record the forward order (and the sizes) of the hooks."""
        return torch.zeros(1, pos, dtype=torch.long, device=self._device())

    @property
    def device(self) -> torch.device:
        """Where inputs go: a dispatched model's main device, else the first parameter's device."""
        return self._device()

    def _device(self) -> torch.device:
        """Where inputs go: a dispatched model's main device (its accelerate hook's), else the first parameter's."""
        main = getattr(getattr(self, "_hf_hook", None), "execution_device", None)
        if main is not None:
            return torch.device("cuda", main) if isinstance(main, int) else torch.device(main)
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
            self._hook_order = self._record_order()
        ordered = {n: points[n] for n in self._hook_order if n in points}
        ordered.update({n: p for n, p in points.items() if n not in ordered})
        return ordered

    def _record_order(self) -> list[str]:
        """Hook names in the order they fire, from a batch-1 run of 2 tokens with every hook active
        and none running (only this caller's HookPoints record)."""
        order: dict[str, None] = {}
        with recording(lambda name, x: order.setdefault(name)), torch.no_grad():
            self(self._example_input())
        return list(order)

    def _resolve(self, name: str | Callable[[str], bool]) -> list[HookPoint]:
        points = self._module_hooks()
        if callable(name):
            return [p for n, p in self.hook_dict.items() if name(n) and not self._gated(n)]
        if not isinstance(name, str):
            raise TypeError(f"a hook name must be a str or a callable filter, got {type(name).__name__}")
        if name in points:
            return [points[name]]
        view = self._make_view(name)
        if view is not None:
            return [view]
        close = difflib.get_close_matches(name, list(points), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise KeyError(f"unknown hook name {name!r}{hint}")

    def names_matching(self, names_filter: NamesFilter) -> list[str]:
        """Hook names selected by a filter: None (all), a name, a list of names, or a predicate."""
        if names_filter is None:
            return [n for n in self.hook_dict if not self._gated(n)]
        if isinstance(names_filter, str):
            return [p.name for p in self._resolve(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n) and not self._gated(n)]
        if not isinstance(names_filter, (list, tuple, set, frozenset)):
            raise WrongType(f"names_filter: expected None, a hook name, a list of names or a function of the name, "
                            f"got {names_filter!r} ({type(names_filter).__name__})")
        return [p.name for n in names_filter for p in self._resolve(n)]

    # ------------------------------------------------------------------------------ add / remove
    def add_hook(self, name: str | Callable[[str], bool], fn: HookFn, dir: str = "fwd",
                 prepend: bool = False, is_permanent: bool = False) -> list[Callable[[], None]]:
        """Attach model hook `fn` to the named HookPoint(s), for every caller. dir="bwd" hooks the gradient.
        `is_permanent=True`: reset_hooks() keeps it (reset_hooks(including_permanent=True) does not)."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        points = self._resolve(name)
        return [p.add_hook(fn, prepend=prepend, dir=dir, is_permanent=is_permanent) for p in points]

    def reset_hooks(self, including_permanent: bool = False, clear_contexts: bool = True) -> None:
        """Remove the model hooks (permanent ones too when `including_permanent`); scoped hooks belong
        to their `hooks()` / `run_with_*` scopes. `clear_contexts` empties every hook.ctx."""
        for p in self._module_hooks().values():
            p.remove_hooks(including_permanent=including_permanent)
            if clear_contexts:
                p.ctx = {}

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[HookSpec] = (), bwd_hooks: Sequence[HookSpec] = (),
              prepend: bool = False) -> Iterator["HookedRootModule"]:
        """Context manager: hooks visible to this thread / task only, attached on entry, removed on exit.
        prepend: they run before the hooks already attached at their points (else after)."""
        # resolve everything first so that a bad name attaches nothing
        front = check(prepend, "hooks: prepend", Flag())
        plan = [(p, fn, front) for n, fn in hook_pairs(fwd_hooks, "fwd_hooks") for p in self._resolve(n)]
        plan += [(p, _as_backward_hook(fn), front) for n, fn in hook_pairs(bwd_hooks, "bwd_hooks")
                 for p in self._resolve(n)]
        with scoped_hooks(plan):
            yield self

    def run_with_hooks(self, *args: Any, fwd_hooks: Sequence[HookSpec] = (), bwd_hooks: Sequence[HookSpec] = (),
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **kwargs: Any) -> Any:
        """Run the forward with temporary hooks (visible to this call only, removed on return, the
        backward ones included). reset_hooks_end=False adds them as model hooks instead, kept until
        reset_hooks(), so that a later backward pass reaches the bwd_hooks (as TL)."""
        reset_hooks_end = check(reset_hooks_end, "run_with_hooks: reset_hooks_end", Flag())
        if reset_hooks_end:
            with self.hooks(fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks):
                out = self(*args, **kwargs)
        else:
            plan = [(p, fn, "fwd") for n, fn in hook_pairs(fwd_hooks, "fwd_hooks") for p in self._resolve(n)]
            plan += [(p, fn, "bwd") for n, fn in hook_pairs(bwd_hooks, "bwd_hooks") for p in self._resolve(n)]
            for p, fn, direction in plan:
                self.add_hook(p.name, fn, dir=direction)
            out = self(*args, **kwargs)
        if clear_contexts:
            for p in self._module_hooks().values():
                p.ctx = {}
        return out

    @checked(device=Device(none=True), remove_batch_dim=Flag(), detach=Flag(), incl_lazy=Flag(),
             max_cache_bytes=Integer(ge=0, none=True), incl_bwd=Flag())
    def run_with_cache(self, *args: Any, names_filter: NamesFilter = None, device: str | torch.device | None = None,
                       remove_batch_dim: bool = False, detach: bool = True, incl_lazy: bool = False,
                       max_cache_bytes: int | None = None, incl_bwd: bool = False, pos_slice: Any = None,
                       return_cache_object: bool = True, **kwargs: Any):
        """Run the forward and return (output, ActivationCache) of the selected hooks.

        names_filter=None takes every hook except the lazy ones (states, kernels, per-head writes,
        whose size grows with pos^2 or width x width); name them in the filter, or pass
        `incl_lazy=True`, to cache them too. Before running, the cache's size is estimated
        (`hooked.cache_budget`); past `max_cache_bytes` (default: half the memory available on the
        model's device) a `CacheBudgetError` lists the hooks, their sizes and a filter that fits.
        `pos_slice` (TransformerLens's Slice input; an int keeps the axis, as TL's run_with_cache)
        keeps only those positions of each activation (the query positions of [batch heads q_pos
        k_pos] quantities). `incl_bwd=True` calls `backward()` on the output (a scalar, e.g.
        return_type="loss") and caches each gradient under "<name>_grad". `return_cache_object=False`
        (TL's) returns a plain dict instead of the ActivationCache.
        The caching hooks are scoped to this call: a concurrent caller neither sees nor fills them.
        """
        from hooked.cache import ActivationCache
        from hooked.cache_budget import check_cache_budget
        from hooked.cache_resid import slice_pos

        store: dict[str, Tensor] = {}
        shape = self._batch_pos(args, kwargs)
        if pos_slice is not None and shape is not None:
            pos_slice = pos_index(pos_slice, shape[1], "run_with_cache: pos_slice")
        if isinstance(pos_slice, int):
            pos_slice = slice(pos_slice, pos_slice + 1 if pos_slice != -1 else None)

        def save(x: Tensor, hook: HookPoint, suffix: str = "") -> None:
            y = x.detach() if detach or suffix else x
            if pos_slice is not None and y.ndim >= 2:
                y = slice_pos(y, pos_slice, dim=hook.axis("pos"))
            store[hook.name + suffix] = y.to(device) if device is not None else y

        def save_grad(g: Tensor, hook: HookPoint) -> None:
            save(g, hook, "_grad")

        names = self.names_matching(names_filter)
        if names_filter is None and not incl_lazy:
            names = [n for n in names if not self.hook_dict[n].lazy]
        if shape is not None:
            check_cache_budget(self, names, *shape, max_bytes=max_cache_bytes, device=device)
        bwd = [(n, save_grad) for n in names] if incl_bwd else []
        with self.hooks(fwd_hooks=[(n, save) for n in names], bwd_hooks=bwd):
            out = self(*args, **kwargs)
            if incl_bwd:
                if not torch.is_tensor(out) or out.numel() != 1:
                    raise ValueError("incl_bwd=True needs a scalar output to call backward() on: pass return_type='loss'")
                out.backward()
        order = [k for n in self.hook_dict for k in (n, n + "_grad")]
        cache = ActivationCache({k: store[k] for k in order if k in store}, self)
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
        return out, (cache if return_cache_object else dict(cache.cache_dict))

    def _batch_pos(self, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        """(batch, pos) of a forward's input, for the cache's size check; None when unknown."""
        x = args[0] if args else kwargs.get("input", kwargs.get("tokens"))
        if not torch.is_tensor(x) or x.ndim == 0:
            return None
        return (1, int(x.shape[0])) if x.ndim == 1 else (int(x.shape[0]), int(x.shape[1]))

    def hook_names(self, pattern: str | None = None) -> list[str]:
        """Hook names in forward order, optionally filtered by a regular expression."""
        names = list(self.hook_dict)
        return [n for n in names if re.search(pattern, n)] if pattern else names


def hook_pairs(hooks: Any, what: str) -> list[tuple[Any, HookFn]]:
    """`hooks` as a list of (name or filter, function) pairs, refused by name when it is not one."""
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, (list, tuple)):
        raise WrongType(f"{what}: expected a list of (hook name or filter, function) pairs, got {hooks!r} "
                        f"({type(hooks).__name__})")
    for i, pair in enumerate(hooks):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise WrongType(f"{what}[{i}]: expected a (hook name or filter, function) pair, got {pair!r}")
    return list(hooks)


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def through_hook(hook: HookPoint, value: Tensor,
                 rebuild: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """Pass a lazily built tensor through its hook: (value after the hook, value before it | None).

    The second item is None when the hooks changed nothing (returned None, the same tensor, or an
    equal copy), so that the model keeps its fast path and stays bit-identical. An equal tensor that
    carries its own gradient path (it requires grad and is not the value: a hook's
    `act.detach().requires_grad_()` or `act.clone()` under autograd) counts as an edit: dropping it
    would cut d metric / d hooked quantity, which attribution patching reads. An in-place edit is
    seen through the tensor's version counter and the original is rebuilt with `rebuild()`; tensors
    made under torch.inference_mode() have no counter, so a copy is kept to compare with.
    """
    if not hook.has_hooks:
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
    carries_grad = out is not value and out.requires_grad and torch.is_grad_enabled()
    if original is value and not carries_grad and (out is value or torch.equal(out, value)):
        return out, None
    return out, original


def _as_backward_hook(fn: HookFn) -> HookFn:
    """Wrap `fn(grad, hook)` so that it runs on the gradient of the hooked activation.

    The gradient hooks it registers go with it (`remove_grad_hooks`, called by Hook.detach): a
    backward hook added for one run does not fire in a later backward pass.
    """
    if not callable(fn):
        raise TypeError(f"a backward hook must be callable, got {type(fn).__name__}")
    handles: list[Any] = []

    def fwd(x: Tensor, hook: HookPoint) -> None:
        if x.requires_grad:
            handles.append(x.register_hook(lambda g: fn(g, hook)))

    def remove_grad_hooks() -> None:
        while handles:
            handles.pop().remove()

    fwd.remove_grad_hooks = remove_grad_hooks  # type: ignore[attr-defined]
    return fwd
