"""LFM2 (Liquid AI): gated short-convolution layers and attention layers, SwiGLU MLPs.

Glossary (TransformerLens names; HF Lfm2Config names in brackets)
    n_layers = len(layer_types)   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types  "conv" or "attention" [full_attention], one per layer [layer_types, or full_attn_idxs]
    conv layers (short_conv.py): d_conv [conv_L_cache] taps, conv_bias [conv_bias] (in_proj, conv, out_proj)
    attention layers: n_heads [num_attention_heads], n_kv_heads [num_key_value_heads], d_head =
        d_model / n_heads, per-head q/k RMSNorms before full rotary (rope_theta)
    d_mlp: the MLP width as HF computes it from intermediate_size (block_auto_adjust_ff_dim: 2/3 of it,
        times block_ffn_dim_multiplier, rounded up to block_multiple_of)
    eps [norm_eps]; tied [tie_word_embeddings / tie_embedding] (True in the released models)

    layer l: resid = resid + (mixer or attn)(ln1(resid));  resid = resid + mlp(ln2(resid))
    logits = ln_final(resid) @ W_U^T    (HF names the final norm embedding_norm)

Hooks: short_conv.py (blocks.{l}.mixer), attention.py (blocks.{l}.attn), mlp.py, block.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hooked.models.attention import Attention
from hooked.models.config import derived
from hooked.models.hybrid import check_kinds, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.models.short_conv import GatedShortConv
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("conv", "attention")


@dataclass(frozen=True)
class Lfm2Config:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int
    d_mlp: int
    n_kv_heads: int = derived(lambda c: c.n_heads)
    d_head: int = derived(lambda c: c.d_model // c.n_heads)
    d_conv: int = 3
    conv_bias: bool = False
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    eps: float = 1e-5
    tied: bool = True
    n_ctx: int = 128000

    def __post_init__(self) -> None:
        kinds = check_kinds("layer_types", self.layer_types, len(self.layer_types), LAYER_TYPES)
        object.__setattr__(self, "layer_types", kinds)

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)


def build(cfg: Lfm2Config) -> LanguageModel:
    """LFM2; conv layers `blocks.{l}.mixer`, attention layers `blocks.{l}.attn`."""
    rotary = Rotary.of(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    blocks = []
    for kind in cfg.layer_types:
        if kind == "attention":
            first = ("attn", Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, rotary=rotary,
                                       q_norm=RMSNorm(cfg.d_head, cfg.eps), k_norm=RMSNorm(cfg.d_head, cfg.eps)))
        else:
            first = ("mixer", GatedShortConv(cfg.d_model, cfg.d_conv, cfg.conv_bias))
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", GatedMLP(cfg.d_model, cfg.d_mlp, "silu"))))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
