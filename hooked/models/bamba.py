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

Hooks: block.py, attention.py (blocks.{l}.attn.*), mamba2.py (blocks.{l}.mixer.*), mlp.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hooked.models.config import derived
from hooked.models.hybrid import check_kinds, hybrid_attention, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
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
    d_head: int = derived(lambda c: c.d_inner // c.n_heads)  # P
    d_inner: int = derived(lambda c: 2 * c.d_model)
    d_state: int = 256  # N
    n_groups: int = 1  # G
    d_conv: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: c.d_model // c.n_attn_heads)
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
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, self.n_layers, LAYER_TYPES))
        object.__setattr__(self, "dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        if self.d_inner != self.n_heads * self.d_head:
            raise ValueError(f"d_inner ({self.d_inner}) must equal n_heads * d_head ({self.n_heads} * {self.d_head})")
        self.mixer  # validates the SSM fields

    @property
    def mixer(self) -> Mamba2Spec:
        return Mamba2Spec.of(self)

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(int(self.d_attn_head * self.partial_rotary_factor), self.rope_theta, self.rope_scaling)


def build(cfg: BambaConfig) -> LanguageModel:
    """Bamba with a hook on every quantity; attention layers are `blocks.{l}.attn`, Mamba-2 ones `blocks.{l}.mixer`."""
    rotary, mixer = cfg.rotary, cfg.mixer
    blocks = []
    for kind in cfg.layer_types:
        if kind == "attention":
            first = ("attn", hybrid_attention(cfg, bias=cfg.attention_bias, rotary=rotary))
        else:
            first = ("mixer", Mamba2Mixer(mixer))
        mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)
        blocks.append(pre_norm_block(cfg.d_model, cfg.eps, first, ("mlp", mlp)))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
