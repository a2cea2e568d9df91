"""Config fields whose default is derived from other fields.

    @dataclass(frozen=True)
    class LlamaConfig:
        n_heads: int
        n_kv_heads: int = derived(lambda c: c.n_heads)   # given, or computed on every read

A `derived` field is a real dataclass field (a keyword of the constructor, in `repr`, `==`, `hash`
and `asdict`), so a config states every size it uses; left out, its value is computed from the
other fields when read, never stored as a placeholder (passing None means the same). `dataclasses.replace` passes every field
it does not change as it reads now: derived values included, so replace the fields a derivation
depends on together with the derived ones (or build a new config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class derived:  # noqa: N801 (used like `field`)
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.key = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"_given_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self  # the dataclass default: "not given"
        given = obj.__dict__.get(self.key, self)
        return self.fn(obj) if given is self else given

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.key] = self if value is None else value  # None: derive it


def is_given(cfg: Any, name: str) -> bool:
    """Whether `derived` field `name` was given to the constructor (not computed)."""
    return cfg.__dict__.get(f"_given_{name}", None) is not getattr(type(cfg), name, None)
