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
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention, TransformerBlock
from hooked.models.base import Context, HookedModel
from hooked.models.embed import Unembed
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
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    d_head: int | None = None  # None: d_model // n_heads
    n_ctx: int = 2048
    eps: float = 1e-6
    act_fn: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters without rope_theta
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) is not a multiple of n_heads ({self.n_heads}); give d_head")
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(self.d_head, self.rope_theta, self.rope_scaling)


class Llama(HookedModel):
    """Llama with a hook on every quantity. Build with `Llama(cfg)`, load with `loaders.from_hf`."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = cfg.rotary  # one spec shared by every layer (a dataclass, not a module)
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList([self._block(cfg, rotary, l) for l in range(cfg.n_layers)])
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, tied_to=self.embed if cfg.tie_word_embeddings else None)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.hook_embed = HookPoint("batch pos d_model")
        self.setup()

    @staticmethod
    def _block(cfg: LlamaConfig, rotary: Rotary, layer: int) -> TransformerBlock:
        """Block `layer` (the same for every layer here; families built on Llama vary it)."""
        attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias, rotary=rotary)
        mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)
        return TransformerBlock(RMSNorm(cfg.d_model, cfg.eps), attn, RMSNorm(cfg.d_model, cfg.eps), mlp)

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        embed = self.embed(tokens)
        embed = self.hook_embed(embed)
        return embed
