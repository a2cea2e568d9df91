"""Bamba (IBM, Princeton, UIUC 2024): Mamba-2 and attention layers in a pattern, a SwiGLU MLP in every layer.

Glossary (TransformerLens / SSM names; HF BambaConfig names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]  d_mlp [intermediate_size]
    layer_types  "mamba" or "attention" per layer [attn_layer_indices lists the attention layers]
    Mamba-2 layers (mamba2.py's glossary): n_heads [mamba_n_heads], d_head [mamba_d_head],
        d_inner [mamba_expand * hidden_size], d_state [mamba_d_state], n_groups [mamba_n_groups],
        d_conv [mamba_d_conv], chunk_size [mamba_chunk_size], dt_limit [time_step_limit],
        conv_bias [mamba_conv_bias], proj_bias [mamba_proj_bias]
    attention layers: n_attn_heads [num_attention_heads], n_attn_kv_heads [num_key_value_heads],
        d_attn_head [hidden_size / num_attention_heads], rotary on the first
        partial_rotary_factor * d_attn_head features (HF fixes 0.5), attention_bias
    eps [rms_norm_eps], also the gated norm's; act_fn [hidden_act]; mlp_bias; tied [tie_word_embeddings]

    resid_0 = W_E[token]                                           hook_embed
    layer l: resid = resid + (attn or mixer)(ln1(resid))           hook_attn_out / hook_mixer_out
             resid = resid + mlp(ln2(resid))   (SwiGLU)            hook_mlp_out
    logits = ln_final(resid) @ W_U^T

Hooks: decoder.py (block), attention.py (blocks.{l}.attn.*), mamba2.py (blocks.{l}.mixer.*), mlp.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hooked.models.attention import Attention
from hooked.models.decoder import DecoderBlock, HybridLM
from hooked.models.mamba2 import Mamba2Mixer
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("mamba", "attention")


@dataclass(frozen=True)
class BambaConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    d_mlp: int
    layer_types: Sequence[str]  # "mamba" or "attention", one per layer (stored as a tuple)
    n_heads: int  # H, SSM heads
    d_head: int | None = None  # P; None: d_inner // n_heads
    d_inner: int | None = None  # None: 2 * d_model
    d_state: int = 256  # N
    n_groups: int = 1  # G
    d_conv: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int | None = None  # None: n_attn_heads
    d_attn_head: int | None = None  # None: d_model // n_attn_heads
    partial_rotary_factor: float = 0.5  # rotated share of each attention head (HF Bamba fixes 0.5)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    mlp_bias: bool = False
    act_fn: str = "silu"
    eps: float = 1e-5
    tied: bool = False
    n_ctx: int = 262144

    def __post_init__(self) -> None:
        fill_hybrid_defaults(self, LAYER_TYPES)

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(int(self.d_attn_head * self.partial_rotary_factor), self.rope_theta, self.rope_scaling)


def fill_hybrid_defaults(cfg: Any, layer_kinds: Sequence[str]) -> None:
    """Derived sizes and checks shared by the Mamba-2 + attention hybrid configs (Bamba, Granite 4):
    d_inner = 2 d_model, d_head = d_inner / n_heads, kv heads and attention head size from the
    attention fields; `layer_types` must name one kind from `layer_kinds` per layer."""
    put = lambda name, value: object.__setattr__(cfg, name, value)  # noqa: E731
    put("layer_types", tuple(cfg.layer_types))
    put("dt_limit", (float(cfg.dt_limit[0]), float(cfg.dt_limit[1])))
    if cfg.d_inner is None:
        put("d_inner", 2 * cfg.d_model)
    if cfg.d_head is None:
        put("d_head", cfg.d_inner // cfg.n_heads)
    if cfg.n_attn_kv_heads is None:
        put("n_attn_kv_heads", cfg.n_attn_heads)
    if cfg.d_attn_head is None:
        put("d_attn_head", cfg.d_model // cfg.n_attn_heads)
    bad = sorted(set(cfg.layer_types) - set(layer_kinds))
    if bad or len(cfg.layer_types) != cfg.n_layers:
        raise ValueError(f"layer_types must hold {cfg.n_layers} entries from {tuple(layer_kinds)}; got "
                         f"{len(cfg.layer_types)}{f', unknown {bad}' if bad else ''}")


def mamba2_layer(cfg: Any) -> Mamba2Mixer:
    """One Mamba-2 mixer from a hybrid config's SSM fields (Bamba and Granite 4 spell them alike)."""
    return Mamba2Mixer(cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.d_head, cfg.d_state, cfg.n_groups, cfg.d_conv,
                       cfg.chunk_size, cfg.conv_bias, cfg.proj_bias, cfg.eps, cfg.dt_limit)


class HookedBamba(HybridLM):
    """Bamba with a hook on every quantity; attention layers are `blocks.{l}.attn`, Mamba-2 ones `blocks.{l}.mixer`."""

    def __init__(self, cfg: BambaConfig) -> None:
        rotary = cfg.rotary
        blocks = []
        for kind in cfg.layer_types:
            if kind == "attention":
                first, name = Attention(cfg.d_model, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head,
                                        qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, rotary=rotary), "attn"
            else:
                first, name = mamba2_layer(cfg), "mixer"
            blocks.append(DecoderBlock(RMSNorm(cfg.d_model, cfg.eps), first, name, RMSNorm(cfg.d_model, cfg.eps),
                                       GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)))
        super().__init__(cfg, blocks)
        nn.init.normal_(self.embed.weight, std=0.02)
