"""Attention with learned per-head sinks (GPT-OSS): an extra logit in each softmax row that reads no value.

Glossary
    sink      one learned logit per query head, s_h [sinks]; it joins every score row of head h as one
              more column, so the row's softmax has the denominator sum_k exp(score_k) + exp(s_h)
    sink mass the share of a row the sink takes, exp(s_h) / (that denominator) = 1 - pattern.sum(-1):
              it reads no value, so it writes nothing; it only scales the head's z down

    pattern[.., q, k] = exp(score[q, k]) / (sum_k' exp(score[q, k']) + exp(sink[q]))   (HF's eager GPT-OSS:
                        softmax over [scores | sink], the sink column dropped)

Hooks, under `blocks.{l}.attn.` (attention.py's, and):
    hook_sink  [batch n_heads q_pos 1]  each row's sink logit, s_h broadcast over batch and q_pos; an
                                        edit is what the softmax reads (raise it: the head attends less)

Attribution. The sink has no value vector, so it is no term of the residual decomposition: its whole
effect is inside each head's write (hook_result = pattern @ v @ W_O with pattern rows summing to
1 - sink mass). The decomposition of a GPT-OSS residual therefore has the same terms as Llama's.

The layer is eager only (SDPA has no sink term): hook_attn_scores and hook_pattern fire on every forward.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention


class SinkAttention(Attention):
    """attention.py's Attention plus `sinks` [n_heads], a term of each softmax denominator."""

    eager_only = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))
        self.hook_sink = HookPoint("batch n_heads q_pos 1")

    def normalise(self, attn_scores: Float[Tensor, "batch n_heads q_pos k_pos"]) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
        batch, n_heads, q_pos, _ = attn_scores.shape
        sink = self.sinks.to(attn_scores.dtype)[None, :, None, None].expand(batch, n_heads, q_pos, 1)
        sink = self.hook_sink(sink)
        dtype = torch.promote_types(attn_scores.dtype, torch.float32)
        return torch.cat([attn_scores, sink], dim=-1).softmax(dim=-1, dtype=dtype)[..., :-1]
