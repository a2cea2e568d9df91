"""Gemma 2: scaled embeddings, (1 + w) RMSNorms before and after attention and MLP, GeGLU,
soft-capped attention scores and logits, and sliding-window attention on alternating layers.

Glossary (TransformerLens names; HF Gemma2Config names in brackets)
    n_layers [num_hidden_layers]   d_model [hidden_size]   n_heads [num_attention_heads]
    n_kv_heads [num_key_value_heads]   d_head [head_dim, explicit: 256 in Gemma 2 2B/9B, 128 in 27B]
    d_mlp [intermediate_size]   d_vocab [vocab_size]   n_ctx [max_position_embeddings]
    eps [rms_norm_eps]   act_fn [hidden_activation, gelu_pytorch_tanh: GeGLU with tanh GELU]
    query_pre_attn_scalar          scores are q.k * query_pre_attn_scalar^-1/2 (not d_head^-1/2)
    attn_softcap [attn_logit_softcapping]    cap on the scaled scores (None: no cap)
    final_softcap [final_logit_softcapping]  cap on the logits (None: no cap)
    sliding_window, layer_types    as windows.py; HF's default makes even layers (0, 2, ..) slide
    (1 + w) RMSNorm                every norm's stored weight w acts as 1 + w (`UnitOffsetRMSNorm`)

    resid_0 = W_E[token] * sqrt(d_model)                       hook_embed (after the scale: the
                                                               residual stream's first term)
    attn_out = ln1_post(attn(ln1(resid)))                      blocks.{l}.ln1_post.hook_normalized
        scores = softcap(q.k * scale), masked, softmax         attn.softcap.hook_in / hook_out,
                                                               attn.hook_attn_scores (capped, masked)
    resid   = resid + attn_out                                 blocks.{l}.hook_attn_out
    mlp_out = ln2_post(mlp(ln2(resid)))   (GeGLU)              blocks.{l}.ln2_post.hook_normalized
    resid   = resid + mlp_out                                  blocks.{l}.hook_mlp_out
    logits  = softcap(ln_final(resid) @ W_U^T)                 unembed.softcap.hook_in / hook_out

W_U is the token embedding's weight (unscaled) when tied, as in every released Gemma. The embedding
scale is rounded to the weights' dtype first (as HF does: sqrt(3072) = 55.43 becomes 55.5 in bf16).
The other hooks are attention.py's and mlp.py's; the head results sum to ln1_post's input, not to
hook_attn_out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.norms import UnitOffsetRMSNorm
from hooked.models.windows import check_layer_types, layer_window
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Gemma2Config:
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    d_vocab: int
    n_kv_heads: int = derived(lambda c: c.n_heads)
    d_head: int = derived(lambda c: c.d_model // c.n_heads)
    n_ctx: int = 8192
    eps: float = 1e-6
    act_fn: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters without rope_theta
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0
    attn_softcap: float | None = 50.0
    final_softcap: float | None = 30.0
    sliding_window: int | None = 4096  # W, used by the "sliding_attention" layers
    layer_types: tuple[str, ...] | None = None  # None: every layer "full_attention"
    tied: bool = True  # unembed shares the embedding matrix

    qk_norm: ClassVar[bool] = False  # per-head (1 + w) RMSNorms on q and k (Gemma 3)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        check_layer_types(self.layer_types, self.n_layers, self.sliding_window)
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar!r}: must be > 0 (scores are scaled by "
                             "its inverse square root)")

    def window(self, layer: int) -> int | None:
        return layer_window(self.layer_types, self.sliding_window, layer)

    def rotary_of(self, layer: int) -> Rotary:
        return Rotary.of(self.d_head, self.rope_theta, self.rope_scaling)


def attention(cfg: Gemma2Config, layer: int) -> Attention:
    qk: dict[str, nn.Module] = {}
    if cfg.qk_norm:
        qk = dict(q_norm=UnitOffsetRMSNorm(cfg.d_head, cfg.eps), k_norm=UnitOffsetRMSNorm(cfg.d_head, cfg.eps))
    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                     o_bias=cfg.attention_bias, rotary=cfg.rotary_of(layer), scale=cfg.query_pre_attn_scalar**-0.5,
                     window=cfg.window(layer), softcap=cfg.attn_softcap, **qk)


def build(cfg: Gemma2Config) -> LanguageModel:
    """Gemma 2 (and Gemma 3: its config) with a hook on every quantity; load weights with `loaders`."""
    def norm() -> UnitOffsetRMSNorm:
        return UnitOffsetRMSNorm(cfg.d_model, cfg.eps)

    blocks = [ResidualBlock([
        Sublayer("attn", norm(), attention(cfg, layer), post_norm=norm()),
        Sublayer("mlp", norm(), GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=False), post_norm=norm()),
    ]) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, norm(), embedding_multiplier=cfg.d_model**0.5, round_multiplier=True,
                         final_softcap=cfg.final_softcap)
