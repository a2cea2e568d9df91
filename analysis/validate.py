"""The command line's file-system arguments: output directories, input files, comma-separated integers.

Every index, count, position, metric value and example list is checked by hooked.validate (the index
grammar, indices.py, and the scalar rules, rules.py), which this module re-exports under its old names
for callers that imported them from here; nothing here checks an index. hooked/ holds the grammar
because analysis imports hooked and never the reverse (hooked/sae and hook_shape use it too).

Glossary
    WritableDir  an output directory created and written to at the check, before any work
    ExistingFile an input file that must exist before a model is loaded
    CommaInts    "10,20,30" as a non-empty list of integers, each passing a rule
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hooked.validate import (IndexOutOfRange, Integer, NotAnIndex, Rule, as_index, index_list, index_mask,  # noqa: F401
                             layer_index, layer_list, metric_value, nonempty, position_mask, positive_int)


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

