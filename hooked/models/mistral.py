"""Mistral: Llama with sliding-window attention in every layer.

Glossary (TransformerLens names; HF MistralConfig names in brackets): as llama.py, plus
    sliding_window [sliding_window]   W: a query reads itself and the W - 1 tokens before it; None
                                      (HF's default for Mistral v0.2+ checkpoints): full causal

    resid_0 = W_E[token]                                       hook_embed
    resid   = resid + attn_W(ln1(resid))   (rotary, windowed)  blocks.{l}.attn.hook_pattern is zero
                                                               outside the window
    resid   = resid + mlp(ln2(resid))      (SwiGLU)
    logits  = ln_final(resid) @ W_U^T

Hooks are Llama's (attention.py, mlp.py); the window is part of the mask, so hook_attn_scores holds
the masked value (finfo.min) and hook_pattern zero for keys W or more tokens back.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.llama import LlamaConfig


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int | None = 4096  # W; None: full causal attention

    def window(self, layer: int) -> int | None:
        return self.sliding_window
