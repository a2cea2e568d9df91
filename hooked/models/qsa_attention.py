"""QSA: gated attention whose keys are a top-k selection of key blocks (Qwen4-Exp's indexed attention, HF
Qwen4ExpTextQSAIndexer + Qwen4ExpTextAttention).

Glossary
    r           compress_ratio: consecutive real keys pooled into one index block
    budget      tokens selected from complete blocks per query: top_blocks = budget / r blocks
    n_idx       index heads (indexer_n_heads), each d_idx wide; one index key head
    rank_i      key i's rank among the row's real keys (0, 1, ..); block c holds the keys of rank c*r .. c*r + r - 1
    complete    a block is complete for query j when all its keys are visible to j (rank < n_j, the number
                of real keys at or before j); the keys of j's last, incomplete block (the tail) are always kept

Indexer, per row and query j (the keys as in attention: causal, padding excluded):
    q_j      = rotary(rmsnorm(index_q(x_j)))                    [n_idx d_idx]   (rotary on the attention's d_rot)
    K_c      = rotary(rmsnorm(mean of index_k over block c))     at the position of the block's first key
    score_c  = sum_h relu(q_j,h . K_c) / sqrt(d_idx)             over j's complete blocks, in float32
    selected = the keys of the top_blocks best blocks (all, if fewer) + the tail
Attention is gated_attention.py's, the selection part of its mask: a key not selected is masked like a future
key, so hook_attn_scores and hook_pattern show the sparse pattern (unselected keys 0), and a knockout edge
cut on them removes nothing more. The selection is read from x, not from the scores, so cutting edges, editing
the pattern or patching values never changes it; it changes only through x (an edit upstream of the layer).
Top-k is called per query on exactly HF's scores (its ties are broken as torch's topk breaks them), so the
same keys are selected. The selection has no gradient: attribution by gradients holds it fixed.

Hooks under blocks.{l}.attn.indexer.: hook_q [batch pos n_idx d_idx] (before its norm), hook_k [batch pos d_idx].
While decoding, the state keeps every earlier index key and its position (blocks are pooled afresh).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention
from hooked.models.base import Context
from hooked.models.decode_state import stepping_state
from hooked.models.gated_attention import GatedAttention
from hooked.models.grouped_norm import GroupedRMSNorm
from hooked.ops.rotary import Rotary, apply_rotary


class QSAIndexer(nn.Module):
    def __init__(self, d_in: int, n_heads: int, d_head: int, budget: int, ratio: int, rotary: Rotary, eps: float) -> None:
        super().__init__()
        if budget % ratio or rotary.d_rot > d_head:
            raise ValueError(f"QSA needs budget ({budget}) divisible by compress_ratio ({ratio}) and the rotary "
                             f"width ({rotary.d_rot}) within an index head ({d_head})")
        self.n_heads, self.d_head, self.ratio, self.top_blocks, self.rotary = n_heads, d_head, ratio, budget // ratio, rotary
        self.index_qk_proj = nn.Linear(d_in, (n_heads + 1) * d_head, bias=False)
        self.q_layernorm = GroupedRMSNorm(d_head, d_head, eps)
        self.k_layernorm = GroupedRMSNorm(d_head, d_head, eps)
        self.dims = {"n_idx": n_heads, "d_idx": d_head}
        self.hook_q = HookPoint("batch pos n_idx d_idx")
        self.hook_k = HookPoint("batch pos d_idx")

    def forward(self, x: Float[Tensor, "batch pos d_in"], ctx: Context) -> Bool[Tensor, "batch 1 pos keys"]:
        batch, pos, _ = x.shape
        q, k = self.index_qk_proj(x).split([self.n_heads * self.d_head, self.d_head], dim=-1)
        q = self.hook_q(q.unflatten(-1, (self.n_heads, self.d_head)))
        k = self.hook_k(k)
        state = stepping_state()
        positions = ctx.position_ids
        if state is not None:
            k, positions = state.history(self, "keys", k), state.history(self, "positions", positions)
        keys = k.shape[1]
        past = keys - pos
        cos, sin = self.rotary(positions, q.dtype, max_position=keys - 1)
        q = apply_rotary(self.q_layernorm(q), cos[:, past:], sin[:, past:])
        real = ctx.keys_mask()
        real = torch.ones(batch, keys, dtype=torch.bool, device=x.device) if real is None else real.bool()
        selected = torch.zeros(batch, pos, keys, dtype=torch.bool, device=x.device)
        for b in range(batch):
            idx = real[b].nonzero().flatten()  # the row's real keys, in order: rank = place in idx
            n_blocks = len(idx) // self.ratio
            members = idx[: n_blocks * self.ratio].view(n_blocks, self.ratio)
            pooled = k[b].index_select(0, members.flatten()).view(n_blocks, self.ratio, self.d_head)
            pooled = self.k_layernorm(pooled.float().mean(dim=1).to(k.dtype))
            starts = members[:, 0]
            blocks = apply_rotary(pooled[None, :, None], cos[b, starts][None], sin[b, starts][None])[0, :, 0]
            seen = torch.cumsum(real[b].long(), 0)  # real keys at or before each key
            for j in range(pos):
                n_j = int(seen[past + j])  # the real keys query j sees
                complete = n_j // self.ratio
                if complete:
                    scores = torch.matmul(q[b, j].float(), blocks[:complete].float().transpose(-1, -2)).transpose(-1, -2)
                    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.d_head)
                    best = scores.topk(min(self.top_blocks, complete), dim=0).indices
                    selected[b, j, members.index_select(0, best).flatten()] = True
                selected[b, j, idx[complete * self.ratio: n_j]] = True
        return selected[:, None]


class IndexedAttention(GatedAttention):
    """gated_attention.py's attention, its keys restricted to the indexer's selection (never SDPA: the selection
    is a per-query mask)."""

    eager_only = True

    def __init__(self, d_in: int, n_heads: int, n_kv_heads: int, d_head: int, indexer: QSAIndexer, **kwargs) -> None:
        super().__init__(d_in, n_heads, n_kv_heads, d_head, **kwargs)
        self.indexer = indexer
        self._selected: Tensor | None = None

    def forward(self, x: Float[Tensor, "batch pos d_in"], ctx: Context) -> Float[Tensor, "batch pos d_out"]:
        self._selected = self.indexer(x, ctx)
        try:
            return super().forward(x, ctx)
        finally:
            self._selected = None

    def visible(self, ctx: Context, pos: int, device: torch.device, q_len: int | None = None,
                window: int | None = None) -> Tensor:
        """Attention's causal, padding and window mask, and the indexer's selection of this forward."""
        return Attention.visible(ctx, pos, device, q_len, window) & self._selected
