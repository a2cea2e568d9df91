"""Qwen3.5 (text; dense and MoE): Qwen3-Next's layers (qwen3_next.py), built by its `build`.

What differs is on disk, not in the computation: the delta projections are stored plainly
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: our QwenDeltaMixer's own names), the rotary is an
interleaved M-RoPE whose three position rows are equal for text (so it is qwen3_next's partial rotary),
and the MLPs are all dense (Qwen3.5) or all MoE (Qwen3.5-MoE, always renormalising its top-k).
Released checkpoints are vision-language models; loaders/qwen3_next.py reads their text part.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.qwen3_next import Qwen3NextConfig


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):  # noqa: N801 (HF's spelling)
    d_attn_head: int = 256
