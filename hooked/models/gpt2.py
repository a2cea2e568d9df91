"""GPT-2: learned token and position embeddings, pre-LayerNorm blocks, GELU MLP, tied unembedding.

Glossary (TransformerLens names; HF GPT2Config names in brackets)
    n_layers [n_layer]   d_model [n_embd]   n_heads [n_head]   d_head = d_model / n_heads
    d_mlp [n_inner, default 4 d_model]   d_vocab [vocab_size]   n_ctx [n_positions]
    eps [layer_norm_epsilon]   act_fn [activation_function]

    resid_0 = W_E[token] + W_pos[position]          hook_embed, hook_pos_embed
    resid   = resid + attn(ln1(resid))               blocks.{l}.hook_resid_pre .. hook_resid_mid
    resid   = resid + mlp(ln2(resid))                blocks.{l}.hook_mlp_out, hook_resid_post
    logits  = ln_final(resid) @ W_U^T                ln_final.hook_normalized

Positions are `ctx.position_ids`, counted over real tokens: a left-padded prompt sees the same
position embeddings as the prompt alone. Attention and MLP hooks are listed in attention.py and
mlp.py; every hook has shape [batch pos d_model] unless said there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import MLP
from hooked.models.norms import LayerNorm


@dataclass(frozen=True)
class GPT2Config:
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    d_mlp: int = 3072
    d_vocab: int = 50257
    n_ctx: int = 1024  # longest sequence: the number of learned positions
    eps: float = 1e-5
    act_fn: str = "gelu_new"
    tied: bool = True  # unembed shares the embedding matrix
    scale_attn_weights: bool = True  # False: scores are q.k, not divided by sqrt(d_head)
    scale_attn_by_inverse_layer_idx: bool = False  # True: layer l's scores also divided by l + 1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    def attn_scale(self, layer: int) -> float:
        scale = self.d_head**-0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale


def block(cfg: GPT2Config, layer: int) -> ResidualBlock:
    attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_heads, cfg.d_head, qkv_bias=True, o_bias=True,
                     scale=cfg.attn_scale(layer))
    mlp = MLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=True)
    return ResidualBlock([Sublayer("attn", LayerNorm(cfg.d_model, cfg.eps), attn),
                          Sublayer("mlp", LayerNorm(cfg.d_model, cfg.eps), mlp)])


def build(cfg: GPT2Config) -> LanguageModel:
    """GPT-2 with a hook on every quantity; load weights with `loaders.from_hf` / `from_pretrained`."""
    blocks = [block(cfg, layer) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, LayerNorm(cfg.d_model, cfg.eps), pos_embed=True)
