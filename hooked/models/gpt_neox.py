"""GPT-NeoX (Pythia): LayerNorm blocks whose attention and MLP read the same residual (parallel residual),
partial rotary attention with biases, a GELU MLP, an untied unembedding.

Glossary (TransformerLens names; HF GPTNeoXConfig names in brackets)
    n_layers [num_hidden_layers]   d_model [hidden_size]   n_heads [num_attention_heads]
    d_head = d_model / n_heads     d_mlp [intermediate_size]   d_vocab [vocab_size]
    n_ctx [max_position_embeddings]   eps [layer_norm_eps]   act_fn [hidden_act]
    rotary_pct [rotary_pct, rope_parameters.partial_rotary_factor]   the rotated fraction of each head:
                                   d_rot = int(d_head * rotary_pct) features rotate, the rest pass
    rope_theta [rotary_emb_base, rope_parameters.rope_theta]
    parallel [use_parallel_residual]   True in every Pythia
    attention_bias [attention_bias]    biases on the fused qkv projection and on the output (True in Pythia)

    resid_0 = W_E[token]                                            hook_embed
    parallel:  resid = resid + attn(ln1(resid)) + mlp(ln2(resid))   blocks.{l}.hook_attn_in, hook_mlp_in
                                                                    (both the residual), ln1.*, ln2.*
    serial:    resid = resid + attn(ln1(resid)); resid = resid + mlp(ln2(resid))
    logits  = ln_final(resid) @ W_U^T                               ln_final.hook_normalized

The checkpoint's fused query_key_value is split into q_proj, k_proj, v_proj at load (loaders/gpt_neox.py):
HF lays it out per head, [head][q | k | v]. Attention and MLP hooks are attention.py's and mlp.py's;
hook_rot_q / hook_rot_k rotate the first d_rot features of each head. A parallel block has no
hook_resid_mid (nothing sits between the two sublayers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hooked.models.attention import Attention
from hooked.models.block import Branch, Parallel, ResidualBlock, Sublayer
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import MLP
from hooked.models.norms import LayerNorm
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class GPTNeoXConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    d_vocab: int
    n_ctx: int = 2048
    eps: float = 1e-5
    act_fn: str = "gelu"
    rotary_pct: float = 0.25  # fraction of d_head that rotates
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters without theta
    parallel: bool = True  # attention and MLP both read the block's input
    attention_bias: bool = True
    tied: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if not 0 < self.d_rot <= self.d_head:
            raise ValueError(f"rotary_pct={self.rotary_pct} rotates {self.d_rot} of {self.d_head} features per head")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def d_rot(self) -> int:
        return int(self.d_head * self.rotary_pct)  # HF's rotary_ndims

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(self.d_rot, self.rope_theta, self.rope_scaling)


def block(cfg: GPTNeoXConfig, rotary: Rotary) -> ResidualBlock:
    attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                     o_bias=cfg.attention_bias, rotary=rotary)
    mlp = MLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=True)
    ln1, ln2 = LayerNorm(cfg.d_model, cfg.eps), LayerNorm(cfg.d_model, cfg.eps)
    if cfg.parallel:
        return ResidualBlock([Parallel(None, (Branch("attn", attn, norm=ln1), Branch("mlp", mlp, norm=ln2)))])
    return ResidualBlock([Sublayer("attn", ln1, attn), Sublayer("mlp", ln2, mlp)])


def build(cfg: GPTNeoXConfig) -> LanguageModel:
    """GPT-NeoX / Pythia with a hook on every quantity; load weights with `loaders.from_hf` / `from_pretrained`."""
    rotary = cfg.rotary
    blocks = [block(cfg, rotary) for _ in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, LayerNorm(cfg.d_model, cfg.eps))
