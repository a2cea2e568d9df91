"""Rows and columns of the SSM kernel without the pos x pos matrix (DESIGN.md section 4).

Glossary
    site     a mixer with a kernel to slice (hooked/models/protocol.py: `kernel_slices`): the SSM
             mixers (blocks.{l}.mixer of Mamba-1 / Mamba-2, Zamba2's Mamba layers, the hybrids')
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

from hooked.models.model_map import model_map
from hooked.validate import position_list


def ssm_sites(model: Any) -> list[str]:
    """Every mixer whose kernel can be sliced (the recurrent mixers), in forward order, from the model map."""
    return [s.path for s in model_map(model).mixers() if s.recurrent]


def slice_hooks(model: Any, site: str, positions: int | Sequence[int] | Tensor, on_slice: Callable[[Tensor], None],
                axis: str = "rows") -> list[tuple[str, Callable]]:
    """Forward hooks (name, fn) that call on_slice(kernel[:, :, positions, :]) (axis="rows") or
    on_slice(kernel[:, :, :, positions]) (axis="cols") of `site` (the mixer's `kernel_slices`)."""
    hooks = model.get_submodule(site).kernel_slices(lambda pos, device: _positions(positions, pos, axis, device),
                                                    on_slice, axis)
    return [(point.name, fn) for point, fn in hooks]


def _positions(positions: int | Sequence[int] | Tensor, pos: int, what: str, device: torch.device) -> Tensor:
    """1-D long tensor of positions in [0, pos) (hooked.validate's position grammar)."""
    return torch.tensor(position_list(positions, pos, what), dtype=torch.long, device=device)


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
    sites = known if sites is None else [sites] if isinstance(sites, str) else list(sites)  # one name: that site
    unknown = [s for s in sites if s not in known]
    if unknown:
        raise ValueError(f"not SSM mixers: {unknown}; the model's are {known}")
    if not sites:
        raise ValueError("the model has no state-space mixer (no kernel to slice)")
    out: dict[str, Tensor] = {}
    hooks = [h for s in sites for h in slice_hooks(model, s, positions, lambda x, s=s: out.__setitem__(s, x), axis)]
    stop = max(int(s.split(".")[1]) for s in sites) + 1  # sites live under blocks.{l}.
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens, attention_mask, stop_at_layer=stop)
    return out
