"""A checkpoint that does not fit the model: one error listing every missing, unexpected and mis-shaped tensor.

Glossary
    missing      a parameter none of whose checkpoint names is present (`expected`: its shape, shown after it)
    unexpected   a checkpoint tensor no parameter reads (`found`: its shape and file, shown after it)
    mis-shaped   a tensor whose shape (after its Key's transform) is not the parameter's: the tensor's
                 name, the shape found, the shape expected, and the file it is in
    hint         a line saying what the lists suggest (the checkpoint's layers against the config's)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; `.missing`, `.unexpected`, `.mismatched` list all of it."""

    def __init__(self, origin: str, arch: str, missing: list[str], unexpected: list[str], mismatched: list[str],
                 unmapped: list[str] = (), hints: Iterable[str] = (), expected: dict[str, Any] | None = None,
                 found: dict[str, str] | None = None) -> None:
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        self.unmapped, self.hints, self.expected = list(unmapped), list(hints), dict(expected or {})
        self.found = dict(found or {})
        self.origin, self.arch = origin, arch
        shown = [f"{n} {list(self.expected[n])}" if n in self.expected else n for n in self.missing]
        stray = [f"{n} {self.found[n]}" if n in self.found else n for n in self.unexpected]
        parts = [*self.hints,
                 f"missing ({len(missing)}): {_listed(shown, ', ', 'missing')}" if missing else "",
                 f"unexpected ({len(unexpected)}): {_listed(stray, ', ', 'unexpected')}" if unexpected else "",
                 f"mis-shaped ({len(mismatched)}): {_listed(mismatched, '; ', 'mismatched')}" if mismatched else "",
                 f"parameters the {arch} key map does not cover ({len(self.unmapped)}): {', '.join(self.unmapped)}"
                 if self.unmapped else ""]
        super().__init__(f"{origin}: checkpoint does not fit {arch}:\n  " + "\n  ".join(p for p in parts if p))


SHOWN = 12  # entries of each list in the message; the attribute holds them all


def _listed(items: list[str], sep: str, attr: str) -> str:
    if len(items) <= SHOWN:
        return sep.join(items)
    return sep.join(items[:SHOWN]) + f"{sep}... ({len(items) - SHOWN} more: the error's .{attr} lists all)"


def where(source: Any, name: str) -> str:
    """The file holding checkpoint tensor `name` (a sharded checkpoint's shard), else the source's origin."""
    file_of = getattr(source, "file_named", None) or getattr(source, "file_of", None)  # a view's, else the file's
    try:
        return str(file_of(name)) if file_of is not None else getattr(source, "origin", "checkpoint")
    except KeyError:
        return getattr(source, "origin", "checkpoint")


def layer_hint(names: Iterable[str], n_layers: int | None) -> list[str]:
    """A line when the checkpoint's layer indices disagree with the config's layer count."""
    found = {int(m.group(1)) for n in names if (m := LAYER.search(n))}
    if n_layers is None or not found or max(found) + 1 == n_layers:
        return []
    return [f"the checkpoint holds layers 0..{max(found)} ({max(found) + 1}), the config says {n_layers}: "
            f"config.json and the weights are not of one model (a multimodal config's text_config missing?)"]
