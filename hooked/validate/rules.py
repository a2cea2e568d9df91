"""The rules of scalar arguments (counts, thresholds, probabilities, flags, choices, devices) and the
`@checked` decorator: one rule per argument, one message format. Indices are in indices.py.

Glossary
    rule       what one argument may be: `Integer(ge=0)`, `Number(gt=0, le=1)`, `Flag()`, `OneOf("a", "b")`,
               `Text()`, `Seq(Integer(ge=0))`, `AnyOf(rule, rule)`; `none=True` lets None through too.
               `rule.check(value, name, args)` returns the value (numpy and 0-d tensor numbers as
               Python ones) or raises; `rule.allowed(args)` says what is allowed, in words
    bound      a limit of Integer / Number: a number, or a function of the call's arguments (a dict), for
               limits that depend on the model (`lt=vocab`: token ids below model.cfg.d_vocab)
    checked    `@checked(temperature=Number(ge=0), ...)`: the call's arguments are bound to the signature
               and each named one is checked before the body runs (defaults too: a wrong default
               fails at once). The rules of every checked function are kept in RULES
    RULES      {"module.qualname": {argument: rule}}: the tests keep their own table of the documented
               rules (tests/entry_points.py) and compare the two
    messages   a wrong type: "f: name: expected <allowed>, got <value> (<type>)", a WrongType (a
               TypeError); a wrong value: "f: name=<value>: must be <allowed>", a ValueError. WrongType
               is a ValueError too, so the CLI reports both as usage errors (exit 2) without a traceback

Bools are never numbers here (`max_new_tokens=True` is refused, not read as 1), floats never integers
(`2.0` is refused, not truncated), strings never numbers or flags (`fold_ln="no"` is refused, not
read as true), and NaN is never in range.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from collections.abc import Sequence as CollectionSequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Bound = int | float | Callable[[dict[str, Any]], int | float] | None
RULES: dict[str, dict[str, "Rule"]] = {}


class WrongType(TypeError, ValueError):
    """An argument of the wrong type (a float where an integer is expected, a string for a flag, ...)."""


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_)) or (torch.is_tensor(x) and x.dtype == torch.bool)


def _number(x: Any) -> Any:
    """A 0-d tensor or numpy scalar as a Python number; anything else unchanged."""
    if torch.is_tensor(x) and x.ndim == 0 and not x.is_complex() and x.dtype != torch.bool:
        return x.item()
    if isinstance(x, np.generic) and not isinstance(x, np.bool_):
        return x.item()
    return x


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(b: Bound, args: dict[str, Any]) -> int | float | None:
    return b(args) if callable(b) else b


class Rule:
    none: bool = False

    def allowed(self, args: dict[str, Any]) -> str:
        raise NotImplementedError

    def check(self, value: Any, name: str, args: dict[str, Any] | None = None) -> Any:
        args = args or {}
        if value is None and self.none:
            return None
        return self._check(value, name, args)

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Any:
        raise NotImplementedError

    def is_container(self, value: Any) -> bool:
        """Does `value` have this rule's container type (then an item's error is the one to report)?"""
        return False

    def words(self, args: dict[str, Any]) -> str:
        return self.allowed(args) + (" or None" if self.none else "")

    def wrong_type(self, value: Any, name: str, args: dict[str, Any]) -> WrongType:
        return WrongType(f"{name}: expected {self.words(args)}, got {_show(value)} ({type(value).__name__})")

    def out_of_range(self, value: Any, name: str, args: dict[str, Any]) -> ValueError:
        return ValueError(f"{name}={_show(value)}: must be {self.words(args)}")


@dataclass(frozen=True)
class _Range(Rule):
    ge: Bound = None
    gt: Bound = None
    le: Bound = None
    lt: Bound = None
    none: bool = False
    kind: str = "a number"

    def allowed(self, args: dict[str, Any]) -> str:
        return f"{self.kind} {self.range_words(args)}".rstrip()

    def range_words(self, args: dict[str, Any]) -> str:
        """">= 0", "in (0, 1]", ... ("" without bounds)."""
        lo = [f">= {_bound(self.ge, args)}" if self.ge is not None else "",
              f"> {_bound(self.gt, args)}" if self.gt is not None else ""]
        hi = [f"<= {_bound(self.le, args)}" if self.le is not None else "",
              f"< {_bound(self.lt, args)}" if self.lt is not None else ""]
        lo_text, hi_text = "".join(lo), "".join(hi)
        if lo_text and hi_text:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            a = _bound(self.ge if self.ge is not None else self.gt, args)
            b = _bound(self.le if self.le is not None else self.lt, args)
            return f"in {left}{a}, {b}{right}"
        return lo_text or hi_text

    def out_of_range(self, value: Any, name: str, args: dict[str, Any]) -> ValueError:
        return ValueError(f"{name}={_show(value)}: must be {self.range_words(args)}")

    def in_range(self, v: int | float, args: dict[str, Any]) -> bool:
        ge, gt, le, lt = (_bound(b, args) for b in (self.ge, self.gt, self.le, self.lt))
        return not ((ge is not None and not v >= ge) or (gt is not None and not v > gt)
                    or (le is not None and not v <= le) or (lt is not None and not v < lt))


@dataclass(frozen=True)
class Integer(_Range):
    """An integer (Python, numpy or a 0-d integer tensor), never a bool or a float, within the bounds."""

    kind: str = "an integer"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> int:
        v = _number(value)
        if _is_bool(value) or _is_bool(v) or not isinstance(v, numbers.Integral):
            raise self.wrong_type(value, name, args)
        if not self.in_range(int(v), args):
            raise self.out_of_range(int(v), name, args)
        return int(v)


@dataclass(frozen=True)
class Number(_Range):
    """A real number (ints too), never a bool or a string; NaN is refused, and so is an infinity
    unless `finite=False` and the bounds allow it."""

    finite: bool = True
    kind: str = "a number"

    def allowed(self, args: dict[str, Any]) -> str:
        text = super().allowed(args)
        return text.replace("a number", "a finite number", 1) if self.finite else text

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> float:
        v = _number(value)
        if _is_bool(value) or _is_bool(v) or not isinstance(v, numbers.Real):
            raise self.wrong_type(value, name, args)
        v = float(v)
        if math.isnan(v) or (self.finite and math.isinf(v)):
            raise ValueError(f"{name}={v}: must be {self.allowed(args)}")
        if not self.in_range(v, args):
            raise self.out_of_range(v, name, args)
        return v


@dataclass(frozen=True)
class Flag(Rule):
    """True or False (a numpy bool too); never a string, a number or None (unless none=True)."""

    none: bool = False

    def allowed(self, args: dict[str, Any]) -> str:
        return "True or False"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise self.wrong_type(value, name, args)
        return bool(value)


class OneOf(Rule):
    """One of the given values (compared by type and value: True is not 1)."""

    def __init__(self, *choices: Any, none: bool = False) -> None:
        self.choices, self.none = choices, none

    def allowed(self, args: dict[str, Any]) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Any:
        if not any(type(value) is type(c) and value == c for c in self.choices):
            if any(type(value) is type(c) for c in self.choices):
                raise self.out_of_range(value, name, args)
            raise self.wrong_type(value, name, args)
        return value

    def __repr__(self) -> str:
        return f"OneOf{self.choices!r}"


@dataclass(frozen=True)
class Text(Rule):
    """A string; a non-empty one unless empty=True."""

    empty: bool = False
    none: bool = False

    def allowed(self, args: dict[str, Any]) -> str:
        return "a string" if self.empty else "a non-empty string"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> str:
        if not isinstance(value, str):
            raise self.wrong_type(value, name, args)
        if not self.empty and not value:
            raise self.out_of_range(value, name, args)
        return value


class Seq(Rule):
    """A list, tuple or other sequence (not a string) as a list, each item passing `item` (named
    name[i]; None: any item); non-empty unless empty=True."""

    def __init__(self, item: Rule | None = None, empty: bool = False, none: bool = False) -> None:
        self.item, self.empty, self.none = item, empty, none

    def allowed(self, args: dict[str, Any]) -> str:
        each = f", each {self.item.allowed(args)}" if self.item is not None else ""
        return f"a {'' if self.empty else 'non-empty '}list{each}"

    def is_container(self, value: Any) -> bool:
        return isinstance(value, CollectionSequence) and not isinstance(value, (str, bytes))

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> list[Any]:
        if not self.is_container(value):
            raise self.wrong_type(value, name, args)
        if not self.empty and not len(value):
            raise self.out_of_range(value, name, args)
        if self.item is None:
            return list(value)
        return [self.item.check(v, f"{name}[{i}]", args) for i, v in enumerate(value)]

    def __repr__(self) -> str:
        return f"Seq({self.item!r})"


class Instance(Rule):
    """An instance of `cls` (e.g. a tensor), described by `what`."""

    def __init__(self, cls: type | tuple[type, ...], what: str, none: bool = False) -> None:
        self.cls, self.what, self.none = cls, what, none

    def allowed(self, args: dict[str, Any]) -> str:
        return self.what

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Any:
        if not isinstance(value, self.cls):
            raise self.wrong_type(value, name, args)
        return value

    def __repr__(self) -> str:
        return f"Instance({self.what!r})"


@dataclass(frozen=True)
class Device(Rule):
    """A device this machine has, as a torch.device: "cpu", "cuda", "cuda:i", a GPU index, "mps" or a
    torch.device. "meta" (no data; unless meta=True) and devices the machine lacks are refused."""

    none: bool = False
    meta: bool = False

    def allowed(self, args: dict[str, Any]) -> str:
        return "a device ('cpu', 'cuda', 'cuda:i', a GPU index or a torch.device)"

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> torch.device:
        if _is_bool(value) or not isinstance(value, (str, int, torch.device)):
            raise self.wrong_type(value, name, args)
        try:
            d = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{name}={_show(value)}: not a device; expected {self.allowed(args)}") from None
        if d.type == "meta" and not self.meta:
            raise ValueError(f"{name}={_show(value)}: the meta device holds no data; expected {self.allowed(args)}")
        if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{name}={_show(value)}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        if d.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"{name}={_show(value)}: MPS is not available on this machine")
        return d



class AnyOf(Rule):
    """The first rule that takes the value; a value of the right type but out of range gets that
    rule's message, any other value a WrongType listing every alternative."""

    def __init__(self, *rules: Rule, none: bool = False) -> None:
        self.rules, self.none = rules, none

    def allowed(self, args: dict[str, Any]) -> str:
        return " or ".join(r.allowed(args) for r in self.rules)

    def is_container(self, value: Any) -> bool:
        return any(r.is_container(value) for r in self.rules)

    def _check(self, value: Any, name: str, args: dict[str, Any]) -> Any:
        for rule in self.rules:
            if rule.is_container(value):  # a list of the wrong items: name the item
                return rule.check(value, name, args)
        range_errors = []
        for rule in self.rules:
            try:
                return rule.check(value, name, args)
            except WrongType:
                continue
            except ValueError as e:
                range_errors.append(e)
        if range_errors:
            raise range_errors[0]
        raise self.wrong_type(value, name, args)

    def __repr__(self) -> str:
        return f"AnyOf{self.rules!r}"


# ---------------------------------------------------------------------------------- entry points
def checked(**rules: Rule) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Check the named arguments of every call against `rules` before the body runs (see the glossary)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        unknown = set(rules) - set(signature.parameters)
        if unknown:
            raise TypeError(f"checked({sorted(unknown)}): {fn.__qualname__} has no such parameters")
        where = fn.__qualname__.rsplit(".", 1)[0] if fn.__name__ == "__init__" else fn.__name__  # a class: its name

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{where}: {e}") from None
            bound.apply_defaults()
            values = bound.arguments
            for name, rule in rules.items():
                values[name] = rule.check(values[name], f"{where}: {name}", values)
            return fn(*bound.args, **bound.kwargs)

        inner.rules = rules  # type: ignore[attr-defined]
        RULES[f"{fn.__module__}.{fn.__qualname__}"] = rules
        return inner

    return wrap


def check(value: Any, name: str, rule: Rule, args: dict[str, Any] | None = None) -> Any:
    """`rule.check(value, name)`: for the checks a decorator cannot express (a method's keyword, a CLI option)."""
    return rule.check(value, name, args)


def checked_fields(**rules: Rule) -> Callable[[type], type]:
    """`@checked` for a settings object: put under `@dataclass(frozen=True)`, it checks the named fields at
    construction (the values as the rules return them: numpy numbers as Python ones) and registers the
    rules in RULES under the class's name."""

    def wrap(cls: type) -> type:
        unknown = set(rules) - set(getattr(cls, "__annotations__", {}))
        if unknown:
            raise TypeError(f"checked_fields({sorted(unknown)}): {cls.__qualname__} has no such fields")

        def __post_init__(self: Any) -> None:
            values = dict(self.__dict__)
            for name, rule in rules.items():
                values[name] = rule.check(values[name], f"{cls.__name__}: {name}", values)
                object.__setattr__(self, name, values[name])

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        cls.rules = rules  # type: ignore[attr-defined]
        RULES[f"{cls.__module__}.{cls.__qualname__}"] = rules
        return cls

    return wrap
