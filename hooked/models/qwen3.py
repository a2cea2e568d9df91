"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before rotary, an explicit head_dim, and
optional sliding-window layers as Qwen2 configures them.

Glossary (TransformerLens names; HF Qwen3Config names in brackets): as llama.py and qwen2.py, plus
    d_head [head_dim]          set explicitly (128 in every Qwen3), not d_model / n_heads
    q_norm, k_norm             RMSNorm over d_head, one weight shared by all heads [d_head]
    attention_bias             biases on q, k, v and o (False in every released Qwen3)

    resid_0 = W_E[token]                                       hook_embed
    q, k    = q_proj(ln1(resid)), k_proj(ln1(resid))           blocks.{l}.attn.hook_q, hook_k
    q, k    = q_norm(q), k_norm(k)    (per head, over d_head)  attn.q_norm.hook_normalized, k_norm.hook_normalized
    q, k    = rotary(q), rotary(k)                             attn.hook_rot_q, hook_rot_k
    resid   = resid + attn(...) ; resid = resid + mlp(ln2(resid))   (SwiGLU)
    logits  = ln_final(resid) @ W_U^T

The other hooks are Llama's (attention.py, mlp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hooked.models.qwen2 import Qwen2Config


@dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    qkv_bias: bool = False  # Qwen3 has no q/k/v-only biases; attention_bias puts one on all four
    qk_norm: ClassVar[bool] = True
