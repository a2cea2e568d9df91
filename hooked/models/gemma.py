"""Gemma (1): Llama with scaled embeddings, (1 + w) RMSNorms, a GeGLU MLP, d_head 256 and a tied unembedding.

Glossary (TransformerLens names; HF GemmaConfig names in brackets): as llama.py, plus
    d_head [head_dim]                256 in Gemma 2B and 7B (7B: n_heads * d_head = 4096 > d_model 3072)
    act_fn [hidden_act]              gelu_pytorch_tanh (HF reads the released "gelu" as the tanh form)
    (1 + w) RMSNorm                  every norm's stored weight w acts as 1 + w (`UnitOffsetRMSNorm`),
                                     the product in float32
    n_kv_heads [num_key_value_heads] 1 in Gemma 2B (multi-query), 16 in 7B

    resid_0 = W_E[token] * sqrt(d_model)                       hook_embed (after the scale; the scale is
                                                               rounded to the weights' dtype, as HF does)
    resid   = resid + attn(ln1(resid))   (rotary, scale d_head^-1/2)
    resid   = resid + mlp(ln2(resid))    (GeGLU)               blocks.{l}.mlp.hook_pre, hook_pre_linear
    logits  = ln_final(resid) @ W_E^T                          ln_final.hook_normalized

Gemma 2 (gemma2.py) adds post-norms, soft-caps and sliding windows to this. `W_E` is the stored
(unscaled) embedding; TransformerLens's Gemma W_E is it times sqrt(d_model). Hooks are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.language_model import LanguageModel
from hooked.models.llama import LlamaConfig, attention
from hooked.models.mlp import GatedMLP
from hooked.models.norms import UnitOffsetRMSNorm


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    n_ctx: int = 8192
    act_fn: str = "gelu_pytorch_tanh"
    tied: bool = True


def build(cfg: GemmaConfig) -> LanguageModel:
    """Gemma with a hook on every quantity; load weights with `loaders.from_hf` / `from_pretrained`."""
    def norm() -> UnitOffsetRMSNorm:
        return UnitOffsetRMSNorm(cfg.d_model, cfg.eps)

    rotary = cfg.rotary
    blocks = [ResidualBlock([
        Sublayer("attn", norm(), attention(cfg, layer, rotary)),
        Sublayer("mlp", norm(), GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)),
    ]) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, norm(), embedding_multiplier=cfg.d_model**0.5, round_multiplier=True)
