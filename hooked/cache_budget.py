"""The size of a cache before it is built, and the memory budget it must fit.

Glossary
    lazy hook    a `HookPoint(lazy=True)`: its quantity is built only when something listens
                 (hook_result, hook_A_bar, hook_B_bar, hook_h, hook_kernel, hook_head_out). A bare
                 `run_with_cache()` leaves lazy hooks out; a filter that selects them, or
                 `incl_lazy=True`, takes them.
    size         bytes of one hook for a [batch, pos] input: the product of its declared axes
                 (`HookPoint.shape`) times its element size (the model's dtype, at least float32
                 for "wide" hooks, 8 for indices); nothing runs to find it.
    budget       `max_cache_bytes`; by default `CACHE_BUDGET_FRACTION` of the memory available on
                 the device the cache goes to when the run starts (run_with_cache's `device=`, else
                 the model's; CPU: MemAvailable of /proc/meminfo; CUDA: free plus what torch holds
                 unused, hooked/device_memory.py). Override it per call (`max_cache_bytes=`) or here.

`check_cache_budget` raises `CacheBudgetError` before anything is built, listing the hooks (grouped
over layers), their sizes, and a filter that would fit.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from hooked.device_memory import available_device_bytes, cache_device

CACHE_BUDGET_FRACTION = 0.5  # of the memory available where the cache goes


class CacheBudgetError(MemoryError):
    """A run_with_cache request whose estimated size is past the budget; raised before the forward."""


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device` now (hooked/device_memory.py)."""
    return available_device_bytes(device)


def default_budget(model: Any, device: torch.device | str | None = None) -> int:
    """CACHE_BUDGET_FRACTION of the memory available where the cache goes (`device`, else the model's)."""
    return int(CACHE_BUDGET_FRACTION * available_bytes(cache_device(model._device(), device)))


def element_bytes(model: Any, element: str) -> int:
    """Bytes of one element of a hook whose element type is `element` (hook_points.py's glossary)."""
    if element == "int64":
        return 8
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None else torch.float32
    if element == "wide":
        dtype = torch.promote_types(dtype, torch.float32)
    return torch.empty((), dtype=dtype).element_size()


def estimate_cache_bytes(model: Any, names: list[str], batch: int, pos: int) -> dict[str, int]:
    """Bytes of each named hook's activation for a [batch, pos] input, from the hooks' declared axes."""
    points = model.hook_dict
    return {n: math.prod(points[n].shape(batch, pos)) * element_bytes(model, points[n].element)
            for n in names if n in points}


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _group(name: str) -> str:
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name)


def check_cache_budget(model: Any, names: list[str], batch: int, pos: int, max_bytes: int | None = None,
                       device: torch.device | str | None = None) -> int:
    """The estimated cache size in bytes; raises CacheBudgetError (before any forward) past the budget
    (`max_bytes`, else the default budget of the device the cache goes to: `device`, else the model's)."""
    sizes = estimate_cache_bytes(model, names, batch, pos)
    total = sum(sizes.values())
    budget = default_budget(model, device) if max_bytes is None else int(max_bytes)
    if total <= budget:
        return total
    groups: dict[str, list[int]] = {}
    for n, b in sizes.items():
        groups.setdefault(_group(n), []).append(b)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    points = model.hook_dict
    lines = [f"  {g:<40} {len(bs):>3} x {_gib(max(bs)):>10} = {_gib(sum(bs)):>10}"
             + ("  (lazy)" if any(points[n].lazy for n in sizes if _group(n) == g) else "")
             for g, bs in rows[:12]]
    if len(rows) > 12:
        lines.append(f"  ... and {len(rows) - 12} more groups totalling {_gib(sum(sum(bs) for _, bs in rows[12:]))}")
    where = "max_cache_bytes" if max_bytes is not None else (
        f"the default budget, CACHE_BUDGET_FRACTION={CACHE_BUDGET_FRACTION} of the memory available now; "
        "pass max_cache_bytes= to change it")
    msg = [f"run_with_cache on [{batch}, {pos}] tokens would cache {_gib(total)} in {len(sizes)} hooks, "
           f"over the budget of {_gib(budget)} ({where}). Largest hooks (count x each = total):", *lines]
    msg.append(_fitting_filter(sizes, budget))
    if any(points[n].lazy and "k_pos" in points[n].axes for n in sizes):
        msg.append("hook_kernel is [batch, channels, pos, pos]: for a few target (or source) positions, compute "
                   "kernel rows or columns instead, memory linear in pos: analysis.kernel_rows.kernel_rows(model, "
                   "tokens, rows=[-1]) / kernel_cols (hooked.ops selective_kernel / ssd_kernel underneath).")
    raise CacheBudgetError("\n".join(msg))


def _fitting_filter(sizes: dict[str, int], budget: int) -> str:
    """A names_filter leaving out the largest hook kinds (by last name component) until the rest fits."""
    by_kind: dict[str, int] = {}
    for n, b in sizes.items():
        by_kind[n.rsplit(".", 1)[-1]] = by_kind.get(n.rsplit(".", 1)[-1], 0) + b
    dropped: list[str] = []
    left = sum(sizes.values())
    for kind, b in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        if left <= budget:
            break
        dropped.append(kind)
        left -= b
    if left > budget or len(dropped) == len(by_kind):
        return ("No filter by hook kind fits: cache fewer layers (names_filter=lambda name: "
                "name.startswith('blocks.0.')), or run fewer tokens or a smaller batch.")
    return (f"A filter that fits ({_gib(left)}): your selection without the names ending in {tuple(dropped)!r}, "
            f"e.g. names_filter=lambda name: not name.endswith({tuple(dropped)!r}) when you asked for every hook.")
