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

from hooked.models.attention import Attention, TransformerBlock
from hooked.models.llama import Llama, LlamaConfig
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int | None = 4096  # W; None: full causal attention

    def window(self, layer: int) -> int | None:
        return self.sliding_window


class Mistral(Llama):
    """Mistral with a hook on every quantity. Build with `Mistral(cfg)`, load with `loaders.from_hf`."""

    @staticmethod
    def _block(cfg: MistralConfig, rotary: Rotary, layer: int) -> TransformerBlock:
        attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias, rotary=rotary, window=cfg.window(layer))
        mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)
        return TransformerBlock(RMSNorm(cfg.d_model, cfg.eps), attn, RMSNorm(cfg.d_model, cfg.eps), mlp)
