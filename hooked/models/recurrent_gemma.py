"""RecurrentGemma (Griffin, De et al. 2024): residual blocks whose temporal mixer is either Griffin's recurrent
block (RG-LRU, rg_lru.py) or local multi-query attention, each followed by a GeGLU MLP.

Glossary (TransformerLens names; HF RecurrentGemmaConfig names in brackets)
    n_layers [num_hidden_layers]   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types   "recurrent" or "attention" per layer [block_types, repeated over the layers]
    n_heads [num_attention_heads]  query heads, and the RG-LRU gates' diagonal blocks
    n_kv_heads [num_key_value_heads]  1 in the released 2B / 9B (multi-query)
    d_head = d_model // n_heads    rotary on its first d_rot = d_head * partial_rotary_factor (0.5) features
    window [attention_window_size] a query reads itself and the window - 1 keys before it
    lru_width [lru_width]          the recurrent block's channels (d_model when None)
    d_conv [conv1d_width]          taps of the recurrent block's causal depthwise conv
    d_mlp = intermediate_size // 2 the GeGLU MLP's width (HF halves its config field); biases everywhere
    final_softcap [logits_soft_cap]   logits = cap * tanh(logits / cap)
    (1 + w) RMSNorm                every norm's stored weight w acts as 1 + w, in float32 (UnitOffsetRMSNorm)

    resid_0 = W_E[token] * bf16(sqrt(d_model))        hook_embed (HF's normalizer is a bfloat16 buffer: the
                                                      scale is rounded to bfloat16 in every dtype)
    resid   = resid + temporal(ln1(resid))            blocks.{l}.mixer (rg_lru.py) or blocks.{l}.attn
    resid   = resid + mlp(ln2(resid))                 blocks.{l}.mlp (GeGLU, tanh GeLU, with biases)
    logits  = softcap(ln_final(resid) @ W_E^T)        unembed.softcap.hook_in / hook_out

Attention layers: q, k, v without bias (attention_bias), o_proj with a bias, scale d_head^-1/2, the window as
part of the mask. Positions are counted over real tokens (a left-padded row equals the prompt alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.hybrid import check_kinds
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.norms import UnitOffsetRMSNorm
from hooked.models.rg_lru import RGLRUBlock
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("recurrent", "attention")


@dataclass(frozen=True)
class RecurrentGemmaConfig:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int
    d_mlp: int
    n_kv_heads: int = derived(lambda c: c.n_heads)
    d_head: int = derived(lambda c: c.d_model // c.n_heads)
    lru_width: int = derived(lambda c: c.d_model)
    d_conv: int = 4
    window: int = 2048
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    attention_bias: bool = False
    final_softcap: float = 30.0
    eps: float = 1e-6
    act_fn: str = "gelu_pytorch_tanh"
    tied: bool = True
    n_ctx: int = 8192  # informational: local attention and the recurrence have no position limit

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, len(self.layer_types),
                                                            LAYER_TYPES))
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.lru_width % self.n_heads:
            raise ValueError(f"lru_width ({self.lru_width}) must be a multiple of n_heads ({self.n_heads}): the "
                             "RG-LRU's gates are n_heads diagonal blocks of lru_width / n_heads channels")
        if self.window < 1:
            raise ValueError(f"the attention window must hold at least one key, got {self.window}")

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def d_rot(self) -> int:
        return int(self.d_head * self.partial_rotary_factor)

    @property
    def embedding_multiplier(self) -> float:
        """sqrt(d_model) rounded to bfloat16, as HF's normalizer buffer holds it."""
        return float(torch.tensor(self.d_model**0.5, dtype=torch.bfloat16))


def build(cfg: RecurrentGemmaConfig) -> LanguageModel:
    """RecurrentGemma with a hook on every quantity; recurrent layers `blocks.{l}.mixer`, attention `blocks.{l}.attn`."""
    def norm() -> UnitOffsetRMSNorm:
        return UnitOffsetRMSNorm(cfg.d_model, cfg.eps)

    rotary = Rotary.of(cfg.d_rot, cfg.rope_theta, None)
    blocks = []
    for kind in cfg.layer_types:
        if kind == "attention":
            first = ("attn", Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                                       o_bias=True, rotary=rotary, window=cfg.window))
        else:
            first = ("mixer", RGLRUBlock(cfg.d_model, cfg.lru_width, cfg.n_heads, cfg.d_conv, cfg.act_fn))
        blocks.append(ResidualBlock([
            Sublayer(first[0], norm(), first[1]),
            Sublayer("mlp", norm(), GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=True)),
        ]))
    return LanguageModel(cfg, blocks, norm(), embedding_multiplier=cfg.embedding_multiplier,
                         final_softcap=cfg.final_softcap)
