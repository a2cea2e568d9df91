"""The analysis side of the validation layer: indices (positions, layers, heads, channels), metric
values, example lists and output directories. Scalar arguments (counts, probabilities, flags,
choices) use hooked.validate's rules, whose WrongType NotAnIndex is.

Glossary
    index        a Python int (numpy / 0-d integer tensors too) in [-n, n); a negative one counts from
                 the end, explicitly: -1 is the last. Never a bool, float or string: `1.7`, `True`,
                 "12" are refused, not rounded, cast or split into characters.
    index list   one index, a list / tuple / range of them, or a 1-D integer tensor
    mask         a bool tensor (or list of bools) of exactly the axis' length, shape-checked
    what         the argument's name, put in every message with its valid range, e.g.
                 "layers=[9]: 9 is outside [-2, 2) (the model's 2 layers)"
    metric value one number per run: a metric that returns a value per batch row is refused, not
                 averaged behind the caller's back
    WritableDir  an output directory created and written to at the check, before any work

Used by knockout, ablation, patching, info_flow, ga and the CLI, so that each refuses the same
inputs with the same kind of message. Nothing here wraps around silently: an index outside its
range is an IndexOutOfRange (an IndexError), a wrong type a NotAnIndex (a TypeError), a wrong mask
shape a ValueError; the first two are ValueErrors as well, so the CLI reports all of them as usage
errors (exit 2) without a traceback.
"""

from __future__ import annotations

import numbers
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool
from torch import Tensor

from hooked.validate import Integer, Rule, WrongType


class NotAnIndex(WrongType):
    """A float, bool, string or other non-integer where an index was expected."""


class IndexOutOfRange(IndexError, ValueError):
    """An integer index outside [-n, n)."""


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_)) or (torch.is_tensor(x) and x.dtype == torch.bool)


def as_index(value: Any, n: int, what: str, unit: str = "entries") -> int:
    """`value` as an index in [0, n) (negative counts from the end); refuses non-integers by name."""
    if torch.is_tensor(value):
        if value.ndim != 0 or value.dtype.is_floating_point or value.is_complex() or value.dtype == torch.bool:
            raise NotAnIndex(f"{what}: expected an integer index, got a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)}")
        value = int(value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise NotAnIndex(f"{what}: expected an integer index in [-{n}, {n}), got {value!r} "
                         f"({type(value).__name__})")
    value = int(value)
    if not -n <= value < n:
        raise IndexOutOfRange(f"{what}: {value} is outside [-{n}, {n}) (the {n} {unit})")
    return value + n if value < 0 else value


def index_list(spec: Any, n: int, what: str, unit: str = "entries") -> list[int]:
    """Indices in [0, n) from one index, a list / tuple / range / set of them or a 1-D integer array (order kept)."""
    if isinstance(spec, (str, bytes)):
        raise NotAnIndex(f"{what}: expected integer indices, got the string {spec!r}")
    if torch.is_tensor(spec) or hasattr(spec, "__array__"):
        try:
            t = torch.as_tensor(spec)
        except (TypeError, ValueError, RuntimeError):
            raise NotAnIndex(f"{what}: expected integer indices, got an array of {getattr(spec, 'dtype', '?')}") from None
        if t.ndim == 0:
            return [as_index(t, n, what, unit)]
        if t.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D list of indices, got shape {tuple(t.shape)}")
        if t.dtype == torch.bool:
            raise NotAnIndex(f"{what}: a bool mask is not accepted here; pass integer indices")
        spec = t.tolist()  # floats stay floats and are refused below
    if isinstance(spec, numbers.Integral) or _is_bool(spec):
        return [as_index(spec, n, what, unit)]
    if isinstance(spec, (set, frozenset)):
        spec = sorted(spec, key=lambda v: (str(type(v)), v))
    if not isinstance(spec, (list, tuple, range)):
        raise NotAnIndex(f"{what}: expected an index or a list of indices, got {spec!r} ({type(spec).__name__})")
    return [as_index(v, n, f"{what}[{i}]" if len(spec) > 1 else what, unit) for i, v in enumerate(spec)]


def index_mask(spec: Any, n: int, what: str, unit: str = "entries",
               device: torch.device | str = "cpu") -> Bool[Tensor, "n"]:
    """A bool mask [n] from indices (see index_list) or a bool mask of exactly n entries."""
    if torch.is_tensor(spec) and spec.dtype == torch.bool or \
            (isinstance(spec, (list, tuple)) and spec and all(_is_bool(v) for v in spec)):
        mask = torch.as_tensor(spec, dtype=torch.bool)
        if tuple(mask.shape) != (n,):
            raise ValueError(f"{what}: a bool mask must have shape ({n},) (the {n} {unit}), got {tuple(mask.shape)}")
        return mask.to(device)
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    idx = index_list(spec, n, what, unit)
    if idx:
        mask[idx] = True
    return mask


def position_mask(spec: Any, batch: int, pos: int, device: torch.device | str = "cpu",
                  what: str = "positions") -> Bool[Tensor, "batch pos"]:
    """A bool mask [batch pos]: integer positions shared by the batch, or a bool mask [pos] / [batch pos]."""
    if torch.is_tensor(spec) and spec.dtype == torch.bool:
        mask = spec.to(device)
        if mask.ndim == 1:
            mask = mask.expand(batch, -1)
        if tuple(mask.shape) != (batch, pos):
            raise ValueError(f"{what}: mask has shape {tuple(spec.shape)}; the sequence is [batch pos] = {(batch, pos)}")
        return mask
    row = index_mask(spec, pos, what, "positions", device)
    return row.expand(batch, -1).clone()


def layer_list(spec: Any, n_layers: int, what: str = "layers") -> list[int]:
    """Sorted, distinct block indices from one layer or a list of them (negative counts from the end)."""
    return sorted(set(index_list(spec, n_layers, what, "layers of the model")))


def layer_index(value: Any, n_layers: int, what: str = "layer") -> int:
    return as_index(value, n_layers, what, "layers of the model")


def positive_int(value: Any, what: str, minimum: int = 1) -> int:
    """An integer >= minimum (counts such as --n), refusing floats, bools and strings by name."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise NotAnIndex(f"{what}: expected an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what}={value}: must be >= {minimum}")
    return int(value)


def metric_value(value: Any, what: str = "metric") -> float:
    """A metric's result as a float: one number per run (a Python number or a one-element tensor).
    A value per batch row is refused rather than averaged behind the caller's back."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"{what} must return one number per run (a scalar), got a tensor of shape "
                             f"{tuple(value.shape)}: reduce it over the batch inside the metric (e.g. .mean())")
        value = value.item()
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise WrongType(f"{what} must return one number per run (a scalar), got {type(value).__name__}")
    return float(value)


def nonempty(items: Any, what: str) -> list[Any]:
    """`items` as a list, refused by name when empty (there is nothing to average or rank)."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise WrongType(f"{what}: expected a list of examples, got {type(items).__name__}")
    items = list(items)
    if not items:
        raise ValueError(f"{what} is empty: pass at least one example")
    return items


def writable_dir(path: Any, what: str = "--out") -> Path:
    """Create `path` if needed and prove it writable now, before a long sweep writes there."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {str(out)!r} is not a writable directory ({e.strerror or e})") from None
    return out


class WritableDir(Rule):
    """An output directory, created if needed and proven writable at the check (`writable_dir`)."""

    def allowed(self, args: dict[str, Any]) -> str:
        return "a writable directory"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Path:
        if not isinstance(value, (str, Path)):
            raise self.wrong_type(value, name, args)
        return writable_dir(value, name)


class CommaInts(Rule):
    """Comma-separated integers ("10,20,30") as a non-empty list, each passing `item`."""

    def __init__(self, item: Rule = Integer(ge=1)) -> None:
        self.item = item

    def allowed(self, args: dict[str, Any]) -> str:
        return f"comma-separated integers, each {self.item.allowed(args)}"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> list[int]:
        try:
            items = [int(s) for s in str(value).split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"{name} must be comma-separated integers, got {value!r}") from None
        if not items:
            raise ValueError(f"{name} needs at least one integer, got {value!r}")
        return [self.item.check(v, name, args) for v in items]


class ExistingFile(Rule):
    """A path to a file that exists now (an input read after a model is loaded, checked before)."""

    def __init__(self, none: bool = False) -> None:
        self.none = none

    def allowed(self, args: dict[str, Any]) -> str:
        return "an existing file"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Path:
        if not isinstance(value, (str, Path)):
            raise self.wrong_type(value, name, args)
        if not Path(value).is_file():
            raise ValueError(f"{name} {str(value)!r}: no such file")
        return Path(value)

