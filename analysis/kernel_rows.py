"""Rows and columns of the SSM kernel without the pos x pos matrix (DESIGN.md section 4).

Glossary
    site     an SSM mixer: a module with hook_dt, hook_B, hook_C and A() (blocks.{l}.mixer of
             Mamba-1 / Mamba-2, Zamba2's Mamba layers), found through the hook names
    c        the kernel's channel axis: d_inner (Mamba-1 channels) or n_heads (Mamba-2 heads)
    rows     target positions j: kernel[:, :, rows, :], what each target reads from every source
    cols     source positions i: kernel[:, :, :, cols], where each source is read
             (ints shared by the batch, negative ok, indexing the padded tensor)

`kernel_rows(model, tokens, rows)[site]` equals `cache[site + ".hook_kernel"][:, :, rows]` at
O(rows x pos x c x d_state) cost and memory linear in pos (hooked.ops: mamba1_kernel_rows,
mamba2_kernel_rows; columns likewise): the last 8 rows of a mamba-130m layer at 8,192 tokens
take 0.4 GB where the whole kernel would take 384 GB. The numbers come from this forward's dt,
B, C, so edits made to those hooks are seen. When something already listens at the site's
hook_A_bar, hook_B_bar or hook_kernel (an edit may be there, e.g. `ga.aggregate_only`), the
slices are taken from hook_kernel instead, after those hooks: the kernel is built then, and
every edit is seen. `slice_hooks` gives the same slices inside a forward the caller runs (the
G&A scores and reads use it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hooked.ops import mamba1_kernel_cols, mamba1_kernel_rows, mamba2_kernel_cols, mamba2_kernel_rows

# by the rank of A: [d_inner d_state] (Mamba-1) or [n_heads] (Mamba-2)
_ROWS = {2: mamba1_kernel_rows, 1: mamba2_kernel_rows}
_COLS = {2: mamba1_kernel_cols, 1: mamba2_kernel_cols}


def ssm_sites(model: Any) -> list[str]:
    """Every SSM mixer of the model, in forward order (modules with hook_dt, hook_B, hook_C and A(), or that
    give their own slices: `kernel_slices`, the delta rule's and the gated short conv's)."""
    names = set(model.hook_dict)
    sites = [n[: -len(".hook_kernel")] for n in model.hook_dict if n.endswith(".hook_kernel")]
    return [s for s in sites if ({f"{s}.hook_dt", f"{s}.hook_B", f"{s}.hook_C"} <= names
                                 and callable(getattr(model.get_submodule(s), "A", None)))
            or callable(getattr(model.get_submodule(s), "kernel_slices", None))]


def _positions(positions: int | Sequence[int] | Tensor, pos: int, what: str, device: torch.device) -> Tensor:
    """1-D long tensor of positions in [0, pos); negatives count from the end."""
    given = torch.as_tensor(positions)
    if given.dtype == torch.bool or given.is_floating_point():
        raise TypeError(f"{what} must be integer positions, got {positions!r}")
    idx = given.long().reshape(-1)
    bad = idx[(idx < -pos) | (idx >= pos)]
    if len(bad):
        raise IndexError(f"{what} {bad.tolist()} outside the sequence of {pos} positions")
    return (idx % pos).to(device)


def slice_hooks(model: Any, site: str, positions: int | Sequence[int] | Tensor, on_slice: Callable[[Tensor], None],
                axis: str = "rows") -> list[tuple[str, Callable]]:
    """Forward hooks that call on_slice(kernel[:, :, positions, :]) (axis="rows") or
    on_slice(kernel[:, :, :, positions]) (axis="cols") of `site` once its dt, B, C are known."""
    if axis not in ("rows", "cols"):
        raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
    mixer = model.get_submodule(site)
    seen: dict[str, Tensor] = {}
    points = model.hook_dict
    if any(points[f"{site}.hook_{n}"].has_hooks for n in ("A_bar", "B_bar", "kernel") if f"{site}.hook_{n}" in points):

        def on_kernel(kernel: Tensor, hook: Any) -> None:  # the kernel others asked for, edits included
            idx = _positions(positions, kernel.shape[-1], axis, kernel.device)
            on_slice(kernel[:, :, idx] if axis == "rows" else kernel[..., idx])

        return [(f"{site}.hook_kernel", on_kernel)]

    if callable(getattr(mixer, "kernel_slices", None)):  # the mixer computes its own (delta rule, short conv)
        where = lambda pos, device: _positions(positions, pos, axis, device)  # noqa: E731
        return [(point.name, fn) for point, fn in mixer.kernel_slices(where, on_slice, axis)]

    def keep(key: str) -> Callable:
        def hook(x: Tensor, hook: Any) -> None:
            seen[key] = x
        return hook

    def on_C(C: Tensor, hook: Any) -> None:
        A = mixer.A()
        dt, B, C = (t.to(A.dtype) for t in (seen.pop("dt"), seen.pop("B"), C))
        idx = _positions(positions, dt.shape[1], axis, dt.device)
        fn = (_ROWS if axis == "rows" else _COLS)[A.ndim]
        on_slice(fn(dt, A, B, C, idx))

    return [(f"{site}.hook_dt", keep("dt")), (f"{site}.hook_B", keep("B")), (f"{site}.hook_C", on_C)]


def kernel_rows(model: Any, tokens: Tensor, rows: int | Sequence[int] | Tensor, sites: Sequence[str] | None = None,
                attention_mask: Tensor | None = None) -> dict[str, Tensor]:
    """{site: kernel[:, :, rows, :]} ([batch c row k_pos]) for every SSM site (or those listed)."""
    return _slices(model, tokens, rows, sites, attention_mask, "rows")


def kernel_cols(model: Any, tokens: Tensor, cols: int | Sequence[int] | Tensor, sites: Sequence[str] | None = None,
                attention_mask: Tensor | None = None) -> dict[str, Tensor]:
    """{site: kernel[:, :, :, cols]} ([batch c q_pos col]) for every SSM site (or those listed)."""
    return _slices(model, tokens, cols, sites, attention_mask, "cols")


def _slices(model: Any, tokens: Tensor, positions: Any, sites: Sequence[str] | None,
            attention_mask: Tensor | None, axis: str) -> dict[str, Tensor]:
    known = ssm_sites(model)
    sites = known if sites is None else list(sites)
    unknown = [s for s in sites if s not in known]
    if unknown:
        raise ValueError(f"not SSM mixers: {unknown}; the model's are {known}")
    if not sites:
        raise ValueError("the model has no SSM mixer (no hook_kernel with hook_dt, hook_B, hook_C)")
    out: dict[str, Tensor] = {}
    hooks = [h for s in sites for h in slice_hooks(model, s, positions, lambda x, s=s: out.__setitem__(s, x), axis)]
    stop = max(int(s.split(".")[1]) for s in sites) + 1  # sites live under blocks.{l}.
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens, attention_mask, stop_at_layer=stop)
    return out
