"""Phi-3: Llama with fused q/k/v and gate/up projections in the checkpoint, an optional sliding window in
every layer, and optional partial rotary.

Glossary (TransformerLens names; HF Phi3Config names in brackets): as llama.py, plus
    sliding_window [sliding_window]   W in every layer (2047 in Phi-3-mini-4k); None: full causal
    partial_rotary_factor [rope_parameters.partial_rotary_factor]   the first int(d_head * factor)
                                      features of each head rotate (1.0 in the released Phi-3)

    resid_0 = W_E[token]                                       hook_embed
    resid   = resid + attn_W(ln1(resid))   (rotary, windowed)
    resid   = resid + mlp(ln2(resid))      (SwiGLU)
    logits  = ln_final(resid) @ W_U^T

The fused tensors (qkv_proj [q | k | v], gate_up_proj [gate | up]) are split at load
(loaders/phi3.py), so the model and its hooks are Llama's (attention.py, mlp.py). LongRoPE (the
128k Phi-3 checkpoints) is refused at build time (ops/rotary.py names the supported rope types).
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.llama import LlamaConfig
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    n_ctx: int = 4096
    eps: float = 1e-5
    sliding_window: int | None = None  # W in every layer; None: full causal
    partial_rotary_factor: float = 1.0

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(int(self.d_head * self.partial_rotary_factor), self.rope_theta, self.rope_scaling)

    def window(self, layer: int) -> int | None:
        return self.sliding_window
