"""Llama: token embedding, pre-RMSNorm blocks with rotary GQA attention and a SwiGLU MLP.

Glossary (TransformerLens names; HF LlamaConfig names in brackets)
    n_layers [num_hidden_layers]   d_model [hidden_size]   n_heads [num_attention_heads]
    n_kv_heads [num_key_value_heads]   d_head [head_dim, default d_model / n_heads]
    d_mlp [intermediate_size]   d_vocab [vocab_size]   n_ctx [max_position_embeddings]
    eps [rms_norm_eps]   act_fn [hidden_act]
    rope_theta, rope_scaling [rope_parameters: rope_type "default", "linear" or "llama3" + its fields]

    resid_0 = W_E[token]                                     hook_embed
    resid   = resid + attn(ln1(resid))   (rotary q and k)    blocks.{l}.attn.hook_rot_q, hook_rot_k
    resid   = resid + mlp(ln2(resid))    (SwiGLU)            blocks.{l}.mlp.hook_pre, hook_pre_linear
    logits  = ln_final(resid) @ W_U^T                        ln_final.hook_normalized

Rotary angles use `ctx.position_ids`, counted over real tokens, so left padding does not shift
them. Attention and MLP hooks are listed in attention.py and mlp.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived, is_given
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    d_vocab: int
    n_kv_heads: int = derived(lambda c: c.n_heads)  # no grouping unless given
    d_head: int = derived(lambda c: c.d_model // c.n_heads)
    n_ctx: int = 2048
    eps: float = 1e-6
    act_fn: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters without rope_theta
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False
    tied: bool = False  # unembed shares the embedding matrix

    qk_norm: ClassVar[bool] = False  # per-head RMSNorms on q and k (Qwen3)

    def __post_init__(self) -> None:
        if not is_given(self, "d_head") and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) is not a multiple of n_heads ({self.n_heads}); give d_head")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(self.d_head, self.rope_theta, self.rope_scaling)

    @property
    def qkv_bias(self) -> bool:
        """Biases on q, k and v only (Qwen2's layout); attention_bias puts them on all four."""
        return False

    def window(self, layer: int) -> int | None:
        """Sliding window of layer `layer`'s attention (None: full causal)."""
        return None


def attention(cfg: LlamaConfig, layer: int, rotary: Rotary) -> Attention:
    qk: dict[str, nn.Module] = {}
    if cfg.qk_norm:
        qk = dict(q_norm=RMSNorm(cfg.d_head, cfg.eps), k_norm=RMSNorm(cfg.d_head, cfg.eps))
    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.qkv_bias or cfg.attention_bias,
                     o_bias=cfg.attention_bias, rotary=rotary, window=cfg.window(layer), **qk)


def build(cfg: LlamaConfig) -> LanguageModel:
    """Llama (and Mistral, Qwen2, Qwen3: their configs) with a hook on every quantity; load weights with
    `loaders.from_hf` / `from_pretrained`."""
    rotary = cfg.rotary  # one spec shared by every layer (a dataclass, not a module)
    blocks = [ResidualBlock([
        Sublayer("attn", RMSNorm(cfg.d_model, cfg.eps), attention(cfg, layer, rotary)),
        Sublayer("mlp", RMSNorm(cfg.d_model, cfg.eps), GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)),
    ]) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
