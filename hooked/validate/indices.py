"""The index grammar: what a layer, position, head, unit, token id or metric value may be, checked in one
place with one range convention, for every public entry point (hooked, analysis, circuits, SAEs).

Glossary
    index        a Python int (numpy / 0-d integer tensors too) in [-n, n); a negative one counts from the
                 end, as in Python and TransformerLens: -1 is the last. Never a bool, float or string:
                 `1.7`, `True`, "12" are refused, not rounded, cast or split into characters. Returned in
                 [0, n)
    index list   one index, a list / tuple / range / set / generator of them, or a 1-D integer tensor or array
    mask         a bool tensor (or list of bools) of exactly the axis' length: its True entries
    positions    an index list or a mask over the sequence axis (`position_list`: in order;
                 `position_mask`: [batch pos], a [batch pos] mask too). A list of 0s and 1s with repeats
                 ([0, 1, 1, 0]) is refused as ambiguous (a 0/1 mask meant as positions 0 and 1)
    pos_slice    TransformerLens's Slice (cache and run_with_cache): None, an index, a slice, a tuple
                 (slice(*t)) or an index list
    layer bound  a block count: `stop_at_layer` / `start_at_layer` in [-n, n] (a Python slice bound, TL's);
                 a residual point (`accumulated_resid(layer)`): [0, n], None or -1 the final residual (TL's)
    count        an integer >= a minimum (batch sizes, sample counts, top-n): hooked.validate.rules.Integer
    metric value one number per run: a metric that returns a value per batch row, a tuple or no
                 gradient where one is needed is refused by the metric's name
    what         the argument's name, put in every message with its valid range, e.g.
                 "layers=[9]: 9 is outside [-2, 2) (the model's 2 layers)"

Errors: a wrong type is a NotAnIndex (a TypeError), an index outside its range an IndexOutOfRange (an
IndexError), a wrong mask shape a ValueError; the first two are ValueErrors as well, so the CLI reports
all of them as usage errors (exit 2) without a traceback.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from hooked.validate.rules import Integer, WrongType, _is_bool, _number, _show


_UNKNOWN = 2**62  # an axis length not known yet (positions before the run): types are checked, ranges later


class NotAnIndex(WrongType):
    """A float, bool, string or other non-integer where an index was expected."""


class IndexOutOfRange(IndexError, ValueError):
    """An integer index outside [-n, n)."""


# ------------------------------------------------------------------------------------- indices
def _at(what: str, value: Any) -> str:
    """"layers=9" for an argument's name, "the layer of head (5, 0) is 5" for a description."""
    return f"{what}={value}" if re.search(r"(^|: )[\w.\[\]-]+$", what) else f"{what} is {value}"


def as_index(value: Any, n: int, what: str, unit: str = "entries") -> int:
    """`value` as an index in [0, n) (negative counts from the end); refuses non-integers by name."""
    if torch.is_tensor(value):
        if value.ndim != 0 or value.dtype.is_floating_point or value.is_complex() or value.dtype == torch.bool:
            raise NotAnIndex(f"{what}: expected an integer index, got a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)}")
        value = int(value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        within = f" in [-{n}, {n})" if n < _UNKNOWN else " (negative counts from the end)"  # n unknown yet
        raise NotAnIndex(f"{what}: expected an integer index{within}, got {_show(value)} ({type(value).__name__})")
    value = int(value)
    if not -n <= value < n:
        raise IndexOutOfRange(f"{_at(what, value)}: must be in [-{n}, {n}) (the {n} {unit})")
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
    elif not isinstance(spec, (list, tuple, range)) and hasattr(spec, "__iter__") and not hasattr(spec, "__len__"):
        spec = list(spec)  # a generator or other one-pass iterable of indices
    if not isinstance(spec, (list, tuple, range)):
        raise NotAnIndex(f"{what}: expected an index or a list of indices, got {_show(spec)} ({type(spec).__name__})")
    return [as_index(v, n, f"{what}[{i}]" if len(spec) > 1 else what, unit) for i, v in enumerate(spec)]


def is_mask(spec: Any) -> bool:
    """A bool tensor, or a non-empty list / tuple of bools."""
    return (torch.is_tensor(spec) and spec.dtype == torch.bool) or \
        (isinstance(spec, (list, tuple)) and len(spec) > 0 and all(_is_bool(v) for v in spec))


def index_mask(spec: Any, n: int, what: str, unit: str = "entries",
               device: torch.device | str = "cpu") -> Bool[Tensor, "n"]:
    """A bool mask [n] from indices (see index_list) or a bool mask of exactly n entries."""
    if is_mask(spec):
        mask = torch.as_tensor(spec, dtype=torch.bool)
        if tuple(mask.shape) != (n,):
            raise ValueError(f"{what}: a bool mask must have shape ({n},) (the {n} {unit}), got {tuple(mask.shape)}")
        return mask.to(device)
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    idx = index_list(spec, n, what, unit)
    if idx:
        mask[idx] = True
    return mask


def axis_index(i: Any, n: int, what: str) -> Any:
    """One entry of an index tuple over an axis of n: a slice or Ellipsis (kept), an index list, a bool mask
    [n], or one index (all checked against n, negatives counted from the end)."""
    if isinstance(i, slice) or i is Ellipsis:
        return i
    if is_mask(i):
        return index_mask(i, n, what)
    if isinstance(i, (list, tuple, range)) or (torch.is_tensor(i) and i.ndim == 1):
        return index_list(i, n, what)
    return as_index(i, n, what)


def head_index(value: Any, n_heads: int, what: str = "head") -> int:
    return as_index(value, n_heads, what, "heads")


# ----------------------------------------------------------------------------------- positions
def not_a_01_mask(spec: Any, what: str) -> None:
    """Refuse a 0/1 integer list given where positions are read: [0, 1, 1, 0] would mean positions 0 and 1."""
    if torch.is_tensor(spec) and spec.dtype == torch.uint8:
        raise ValueError(f"{what}: a uint8 tensor is ambiguous (a byte mask or positions?): pass a bool mask "
                         "(.bool()) or integer positions (.long())")
    values = spec.tolist() if torch.is_tensor(spec) else spec
    if isinstance(values, (list, tuple)) and len(values) > 2 and all(type(v) is int for v in values) \
            and set(values) <= {0, 1} and len(set(values)) < len(values):
        raise ValueError(f"{what}={values!r} repeats positions 0 and 1: it reads as a 0/1 mask, which would select "
                         "positions 0 and 1 only; pass a bool mask (torch.tensor(...).bool()) or the positions")


def position_list(spec: Any, pos: int, what: str = "positions") -> list[int]:
    """Positions in [0, pos), in the order given: indices (negative from the end) or a bool mask [pos]."""
    if is_mask(spec):
        return index_mask(spec, pos, what, "positions").nonzero().flatten().tolist()
    not_a_01_mask(spec, what)
    if isinstance(spec, (list, tuple, range)) and len(spec) == 0 or torch.is_tensor(spec) and spec.numel() == 0:
        raise ValueError(f"{what}: no position given")
    return index_list(spec, pos, what, "positions")


def position_mask(spec: Any, batch: int, pos: int, device: torch.device | str = "cpu",
                  what: str = "positions", open_end: bool = False) -> Bool[Tensor, "batch pos"]:
    """A bool mask [batch pos]: integer positions shared by the batch, or a bool mask [pos] / [batch pos].

    open_end (decoding: the sequence read so far will grow): positions at or past `pos` are not read
    yet and left out, and a bool mask may be wider than `pos` (its first `pos` columns are taken);
    negative positions still count from `pos`, the end of what has been read."""
    if is_mask(spec):
        mask = torch.as_tensor(spec, dtype=torch.bool).to(device)
        if mask.ndim == 1:
            mask = mask.expand(batch, -1)
        if open_end and mask.ndim == 2 and mask.shape[0] == batch and mask.shape[1] > pos:
            mask = mask[:, :pos]
        if tuple(mask.shape) != (batch, pos):
            reach = (f"; while decoding a mask covers at least every position read so far ({pos}: past and new), "
                     "columns past them being positions not read yet") if open_end else ""
            raise ValueError(f"{what}: mask has shape {tuple(torch.as_tensor(spec).shape)}; the sequence is "
                             f"[batch pos] = {(batch, pos)}{reach}")
        return mask
    not_a_01_mask(spec, what)
    if open_end:
        kept = [v for v in _signed_positions(spec, what) if v < pos]
        row = index_mask(kept, pos, what, "positions read so far", device)
    else:
        row = index_mask(spec, pos, what, "positions", device)
    return row.expand(batch, -1).clone()


def check_positions(spec: Any, what: str = "positions") -> Any:
    """The types of a positions argument, checked before the sequence length is known (ranges: at the run)."""
    if spec is None or is_mask(spec):
        return spec
    not_a_01_mask(spec, what)
    index_list(spec, _UNKNOWN, what, "positions")
    return spec


def _signed_positions(spec: Any, what: str) -> list[int]:
    """The integers of an index list as given (types checked by index_list, no range)."""
    return [v - _UNKNOWN if v >= _UNKNOWN // 2 else v for v in index_list(spec, _UNKNOWN, what, "positions")]


def pos_index(pos_slice: Any, n_pos: int, name: str = "pos_slice", unit: str = "positions") -> Any:
    """TransformerLens's Slice input checked against `n_pos` positions, as an index for that axis.

    None (every position), an int (negative counts from the end; kept as given: TL keeps the axis), a
    slice or a tuple (slice(*t)) of ints, or a list / 1-D integer tensor of positions. Refused by name:
    a bool, a float, a string, a position outside [-n_pos, n_pos), and a slice that selects no position.
    """
    if pos_slice is None:
        return None
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        for field in ("start", "stop", "step"):
            part = getattr(pos_slice, field)
            if part is not None:
                Integer().check(part, f"{name}.{field}")
        if pos_slice.step == 0:
            raise ValueError(f"{name}={pos_slice!r}: the step must not be 0")
        chosen = range(n_pos)[pos_slice]
        if len(chosen) == 0:
            raise ValueError(f"{name}={pos_slice!r} selects none of the {n_pos} positions")
        return pos_slice if pos_slice.step is None or pos_slice.step > 0 else torch.tensor(chosen, dtype=torch.long)
    if isinstance(pos_slice, (list, np.ndarray)) or (torch.is_tensor(pos_slice) and pos_slice.ndim == 1):
        if len(pos_slice) == 0:
            raise ValueError(f"{name}=[]: selects no position")
        return torch.tensor(index_list(pos_slice, n_pos, name, unit), dtype=torch.long)
    if _is_bool(pos_slice) or not isinstance(_number(pos_slice), numbers.Integral):
        raise NotAnIndex(f"{name}: expected None, an integer in [-{n_pos}, {n_pos}), a slice, a tuple or a list of "
                         f"positions, got {_show(pos_slice)} ({type(pos_slice).__name__})")
    as_index(pos_slice, n_pos, name, unit)
    return int(_number(pos_slice))


# -------------------------------------------------------------------------------------- layers
def layer_index(value: Any, n_layers: int, what: str = "layer") -> int:
    return as_index(value, n_layers, what, "layers of the model")


def layer_list(spec: Any, n_layers: int, what: str = "layers") -> list[int]:
    """Sorted, distinct block indices from one layer or a list of them (negative counts from the end)."""
    return sorted(set(index_list(spec, n_layers, what, "layers of the model")))


def layer_bound(value: Any, n_layers: int, what: str, default: int) -> int:
    """A slice bound over the blocks (`start_at_layer`, `stop_at_layer`: TL's) in [-n, n], as [0, n]; None: default."""
    if value is None:
        return default
    bound = Integer().check(value, what)
    if not -n_layers <= bound <= n_layers:
        raise IndexOutOfRange(f"{what}={bound}: must be in [-{n_layers}, {n_layers}] (a slice bound over the model's "
                              f"{n_layers} layers)")
    return bound + n_layers if bound < 0 else bound


def resid_layer(value: Any, n_layers: int, what: str = "layer") -> int:
    """A residual point (TL's `accumulated_resid(layer)`): the input of block `layer` in [0, n]; None, -1
    and n the final residual."""
    if value is None:
        return n_layers
    layer = Integer().check(value, what)
    if layer == -1:
        return n_layers
    if not 0 <= layer <= n_layers:
        raise IndexOutOfRange(f"{what}={layer}: must be in [0, {n_layers}], or -1 / None for the final residual")
    return layer


def token_edge(target: Any, source: Any, pos: int | None, what: str) -> tuple[int, int]:
    """(target j, source i) of a token edge as positions in [0, pos), negative ones counted from the end; a
    source after its target is refused (a position reads only itself and earlier ones). pos None (the
    length is not known yet): the order is checked where both count from the same end, nothing returned."""
    if pos is None:
        j, i = Integer().check(target, f"{what}: target"), Integer().check(source, f"{what}: source")
        if (i < 0) == (j < 0) and i > j:
            raise ValueError(f"{what}: source {i} is after target {j}: no such edge")
        return j, i
    j = as_index(target, pos, f"{what}: target", "positions")
    i = as_index(source, pos, f"{what}: source", "positions")
    if i > j:
        raise ValueError(f"{what}: source {source} (position {i}) is after target {target} (position {j}) of the "
                         f"{pos} positions: no such edge")
    return j, i


# ------------------------------------------------------------------------------------ token ids
def token_ids(value: Any, d_vocab: int | None, name: str) -> Int[Tensor, "..."]:
    """Token ids as a long tensor (shape kept): an int, a list of ints or an integer tensor, each in
    [0, d_vocab); floats, bools and strings are refused by name, as is an id outside the vocabulary
    (d_vocab None: not known yet, ids >= 0 only)."""
    if torch.is_tensor(value):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise WrongType(f"{name}: expected token ids (integers), got a {value.dtype} tensor")
        ids = value.long()
    elif isinstance(value, (list, tuple)):
        ids = torch.tensor([Integer().check(v, f"{name}[{i}]") for i, v in enumerate(value)], dtype=torch.long)
    else:
        ids = torch.tensor(Integer(ge=0, lt=d_vocab).check(value, name), dtype=torch.long)
    bad = (ids < 0) | (ids >= (d_vocab if d_vocab is not None else ids.max() + 1 if ids.numel() else 0))
    if bool(bad.any()):
        shown = sorted(set(ids[bad].tolist()))[:10]
        where = f"the vocabulary [0, {d_vocab})" if d_vocab is not None else "[0, d_vocab) (negative ids)"
        raise ValueError(f"{name}: token ids outside {where}: {shown}")
    return ids


# --------------------------------------------------------------------------------------- counts
def positive_int(value: Any, what: str, minimum: int = 1) -> int:
    """An integer >= minimum (counts such as --n), refusing floats, bools and strings by name."""
    return Integer(ge=minimum).check(value, what)


def nonempty(items: Any, what: str) -> list[Any]:
    """`items` as a list, refused by name when empty (there is nothing to average or rank)."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise WrongType(f"{what}: expected a list of examples, got {type(items).__name__}")
    items = list(items)
    if not items:
        raise ValueError(f"{what} is empty: pass at least one example")
    return items


# -------------------------------------------------------------------------------------- metrics
def metric_name(metric: Callable[..., Any]) -> str:
    name = getattr(metric, "__qualname__", None) or type(metric).__name__
    return f"metric {name}" if name != "<lambda>" else "metric (a lambda)"


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


def metric_tensor(value: Any, metric: Callable[..., Any], grad: bool = False) -> Tensor:
    """A metric's result where circuits need a scalar tensor (grad: one that depends on the logits through
    operations autograd can follow), refused by the metric's name otherwise."""
    what = metric_name(metric)
    if not torch.is_tensor(value):
        raise WrongType(f"{what} must return one number per run (a scalar), got {type(value).__name__} "
                        f"{_show(value)}: circuits need it as a tensor (a mean over the prompts)")
    if value.numel() != 1:
        raise ValueError(f"{what} must return one number per run (a scalar), got a tensor of shape "
                         f"{tuple(value.shape)}: reduce it over the batch inside the metric (e.g. .mean())")
    if value.is_complex() or value.dtype == torch.bool or not value.is_floating_point():
        raise WrongType(f"{what} must return a real floating-point scalar, got a {value.dtype} tensor")
    if grad and not value.requires_grad:
        raise ValueError(f"{what} has no gradient with respect to the logits (it does not depend on them, or "
                         "reads them through detach / argmax / .item()): attribution needs d metric / d logits")
    return value
