"""Attention through torch's scaled_dot_product_attention: the eager path's z without its pattern.

Glossary (as hooked/models/attention.py)
    q_pos, k_pos  query and key positions; while decoding the q_pos queries are the LAST q_pos of
                  the k_pos keys
    n_heads, n_kv_heads  query and key/value heads; query head h reads kv head h // group
    window        sliding window W: key k is visible from query q iff q - W < k <= q
    key_mask      [batch k_pos] bool, False for padding keys (Context.keys_mask()); None: none
    visible       [q_pos k_pos] or [batch 1 q_pos k_pos] bool, what Attention.visible returns

`sdpa_attention` returns what the eager path writes to hook_z (the pattern-weighted values) for
the same q (after rotary), k, v, scale, window and padding, without the [batch n_heads q_pos
k_pos] scores or pattern, which therefore cannot be hooked: a caller takes this path only when no
score, pattern or soft-cap hook (nor a knockout that edits them) is active, and never for a
soft-capped layer (SDPA has no cap). A masked key gets finfo(dtype).min added, as the eager
path sets it, so a query with no visible key (a left-padding query) reads the uniform average of
the values as there, never NaN. Without a window or padding, the causal mask is SDPA's own
(is_causal, or nothing for a single decoding query), so no mask tensor is built and the flash
kernels apply; otherwise an additive [q_pos k_pos] or [batch 1 q_pos k_pos] mask is passed.
GQA: SDPA's enable_gqa (torch >= 2.5) when no mask is passed (the flash kernel takes it);
otherwise the kv heads are repeated ([batch k_pos n_heads d_head], never q_pos x k_pos).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Bool, Float
from torch import Tensor

_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def visible_keys(q_len: int, k_len: int, device: torch.device, *, window: int | None = None,
                 key_mask: Bool[Tensor, "batch k_pos"] | None = None) -> Tensor:
    """Bool [q_pos k_pos] (no key_mask) or [batch 1 q_pos k_pos]: key at or before the query (and
    within `window` of it), not padding; the queries are the last q_len of the k_len keys.
    The same mask as Attention.visible, from plain arguments."""
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    if window is not None:  # drop k <= q - W, q counted over all k_len keys
        causal = causal & ~torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len - window)
    if key_mask is None:
        return causal
    return causal & key_mask[:, None, None, :]


def sdpa_attention(
    q: Float[Tensor, "batch q_pos n_heads d_head"],
    k: Float[Tensor, "batch k_pos n_kv_heads d_head"],
    v: Float[Tensor, "batch k_pos n_kv_heads d_head"],
    scale: float,
    *,
    window: int | None = None,
    key_mask: Bool[Tensor, "batch k_pos"] | None = None,
) -> Float[Tensor, "batch q_pos n_heads d_head"]:
    """z = softmax(scale q.k + mask) v per head, as the eager path computes it (module docstring).

    Args:
        q: queries after rotary (hook_rot_q, or hook_q without rotary). k, v: every key and value
            (the past ones too while decoding), kv heads not repeated.
        scale: multiplier of q.k. window: sliding window, or None. key_mask: padding of the keys.
    Returns:
        z: [batch q_pos n_heads d_head], what hook_z would hold.
    """
    q_len, k_len = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    mask = None
    causal = False
    if window is None and key_mask is None and q_len == k_len:
        causal = True
    elif window is not None or key_mask is not None or q_len > 1:  # one decoding query sees every key
        visible = visible_keys(q_len, k_len, q.device, window=window, key_mask=key_mask)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~visible, torch.finfo(q.dtype).min)
    extra = {}
    if group > 1 and mask is None and _ENABLE_GQA:
        extra["enable_gqa"] = True
    elif group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    q, k, v = (rearrange(t, "b l h d -> b h l d") for t in (q, k, v))
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **extra)
    return rearrange(z, "b h l d -> b l h d")
