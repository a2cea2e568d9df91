"""Keys and values of a selected decoding state: a shared past read through a row map, never copied per row.

Glossary
    shared past   k0, v0 [sources p0 n_kv_heads d_head]: the keys and values of the state a `select`
                  started from (a prefix read once), kept as they were
    row map       `RowMap`: row i of the selected state reads source row index[i] of the shared past
                  (rows may repeat: several continuations of one prefix; a source may have no row)
    grid          the rows grouped by source, [sources width], width = the most rows of one source;
                  row i sits in flat slot `slot[i]` = index[i] * width + its rank among its source's
                  rows; the other slots are empty (zeros in, ignored out). One grid per `select`,
                  shared by every layer's entry
    own part      k1, v1 [rows p1 n_kv_heads d_head]: the row's own keys and values, read after the
                  shared past (p1 = 0 right after a select)
    key order     the shared positions first, then the own ones: key j < p0 is shared position j

A row's keys are exactly cat([k0[index[i]], k1[i]]), so attention through a `SharedKV` equals attention
through that gathered copy; `scores` and `mix` compute the shared part as one batched matmul per layer
over the grid, without materialising k0[index] (rows x p0, a copy per continuation) nor repeating kv heads
(query head h reads kv head h // group, as `Attention.repeat_kv`). Everything is differentiable: the
gradients reach q, the pattern, k0 and v0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor


@dataclass(frozen=True)
class RowMap:
    """Row i reads source row index[i]; the grid that groups the rows by source."""

    index: Int[Tensor, " rows"]
    slot: Int[Tensor, " rows"]  # flat grid slot of each row
    sources: int
    width: int  # the most rows one source has

    @staticmethod
    def of(index: Int[Tensor, " rows"], sources: int) -> RowMap:
        index = index.long()
        counts = torch.bincount(index, minlength=sources)
        width = int(counts.max()) if len(index) else 0
        order = torch.argsort(index, stable=True)
        first = counts.cumsum(0) - counts  # first sorted position of each source's rows
        rank = torch.empty_like(index)
        rank[order] = torch.arange(len(index), device=index.device) - first[index[order]]
        return RowMap(index, index * width + rank, sources, width)

    def compose(self, index: Int[Tensor, " new_rows"]) -> RowMap:
        """The map of rows `index` of this map's rows (a select of a select)."""
        return RowMap.of(self.index[index.to(self.index.device)], self.sources)

    def to_grid(self, x: Float[Tensor, "rows *rest"]) -> Float[Tensor, "sources width *rest"]:
        grid = x.new_zeros((self.sources * self.width, *x.shape[1:])).index_copy(0, self.slot, x)
        return grid.view(self.sources, self.width, *x.shape[1:])

    def from_grid(self, grid: Float[Tensor, "sources width *rest"]) -> Float[Tensor, "rows *rest"]:
        return grid.reshape(self.sources * self.width, *grid.shape[2:])[self.slot]


@dataclass(frozen=True)
class SharedKV:
    """One attention module's entry in a selected state: a shared past through a row map, then the own part."""

    k0: Float[Tensor, "sources p0 n_kv_heads d_head"]
    v0: Float[Tensor, "sources p0 n_kv_heads d_v"]  # d_v: a value's width (MLA's differs from a key's)
    rows: RowMap
    k1: Float[Tensor, "rows p1 n_kv_heads d_head"]
    v1: Float[Tensor, "rows p1 n_kv_heads d_v"]

    @staticmethod
    def of(k: Tensor, v: Tensor, rows: RowMap) -> SharedKV:
        """A plain past (k, v) [sources p0 n_kv_heads d_head] read through `rows`, no own part yet."""
        n = len(rows.index)
        return SharedKV(k, v, rows, k.new_zeros(n, 0, *k.shape[2:]), v.new_zeros(n, 0, *v.shape[2:]))

    @property
    def shared_positions(self) -> int:
        return self.k0.shape[1]

    def select(self, rows: RowMap, index: Int[Tensor, " new_rows"]) -> SharedKV:
        """Rows `index` of this entry, `rows` being this map composed with index (shared by all layers)."""
        index = index.to(self.k1.device)
        return SharedKV(self.k0, self.v0, rows, self.k1[index], self.v1[index])

    def extend(self, k: Tensor, v: Tensor) -> SharedKV:
        """New keys and values [rows pos n_kv_heads d_head] appended to the own part."""
        return SharedKV(self.k0, self.v0, self.rows, torch.cat([self.k1, k], dim=1), torch.cat([self.v1, v], dim=1))

    def scores(self, q: Float[Tensor, "rows q_pos n_heads d_head"]) -> Float[Tensor, "rows n_heads q_pos p0"]:
        """q . k0[index] (unscaled), query head h against kv head h // group."""
        kv_heads = self.k0.shape[2]
        grid = self.rows.to_grid(q)
        grid = grid.view(*grid.shape[:3], kv_heads, -1, grid.shape[-1])  # n_heads = (n_kv_heads group)
        out = einsum(grid, self.k0, "src slot q_pos kv group d, src k_pos kv d -> src slot kv group q_pos k_pos")
        return self.rows.from_grid(out.flatten(2, 3))

    def mix(self, pattern: Float[Tensor, "rows n_heads q_pos p0"]) -> Float[Tensor, "rows q_pos n_heads d_v"]:
        """pattern . v0[index]: the shared keys' part of z."""
        kv_heads = self.v0.shape[2]
        grid = self.rows.to_grid(pattern)
        grid = grid.view(grid.shape[0], grid.shape[1], kv_heads, -1, *grid.shape[3:])
        out = einsum(grid, self.v0, "src slot kv group q_pos k_pos, src k_pos kv d -> src slot q_pos kv group d")
        return self.rows.from_grid(out.flatten(3, 4))
