"""Zamba2 (Glorioso et al. 2024): Mamba-2 layers, some of which first call a shared transformer.

Glossary (TransformerLens / SSM names; HF Zamba2Config names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]
    layer_types [layers_block_type]  "mamba" (HF "linear_attention") or "hybrid", one per layer
    hybrid_layer_ids  the layers whose type is "hybrid"; invocation i = the i-th of them
    Mamba-2 layers (mamba2.py's glossary): n_heads [n_mamba_heads] SSM heads, d_head [mamba_headdim],
        d_inner [mamba_expand * hidden_size], d_state [mamba_d_state], n_groups [mamba_ngroups],
        d_conv [mamba_d_conv], chunk_size, dt_limit [(time_step_min, inf)]
    shared transformer (zamba2_shared.py): n_attn_heads [num_attention_heads], n_attn_kv_heads
        [num_key_value_heads], d_attn_head [attention_head_dim = 2 d_model / n_attn_heads],
        d_mlp [intermediate_size], act_fn [hidden_act], num_mem_blocks (shared blocks, cycled over
        the invocations), use_shared_attention_adapter, adapter_rank, use_mem_rope, rope_theta
    proj_bias [add_bias_linear]  biases of in_proj, out_proj, gate_up_proj and down_proj
    embedding  the token embedding, read again by every shared block (Context.embedding)

    resid_0 = W_E[token]                                                   hook_embed
    mamba layer l:   resid = resid + mixer(ln1(resid))
    hybrid layer l:  shared_out = linear_l(shared_{i % num_mem_blocks}([resid, embedding]))
                     resid = resid + mixer(ln1(resid + shared_out))        (block.py's Side input)
    logits = ln_final(resid) @ W_U^T  (W_U tied to W_E by default)

The shared block's output enters the Mamba layer's INPUT only; the residual skips it.

Hooks: hook_embed; every layer blocks.{l}.hook_resid_pre, hook_mixer_in, ln1.hook_normalized, mixer.*
(Mamba-2, mamba2.py), hook_mixer_out, hook_resid_post; hybrid layers also blocks.{l}.shared.* (one set
per invocation, zamba2_shared.py) and blocks.{l}.hook_shared_out [batch pos d_model] after linear_l,
before hook_mixer_in (which is then resid + shared_out); ln_final.hook_normalized. A shared attention head at one invocation is ("blocks.{l}.shared.attn", h).

The shared blocks read the original embedding: `model(resid, start_at_layer=k, tokens=tokens)` needs
`tokens` when a hybrid layer follows k (it is embedded again, without hook_embed firing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hooked.models.block import ResidualBlock, Side, Sublayer
from hooked.models.config import derived
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hooked.models.norms import RMSNorm
from hooked.models.zamba2_shared import SharedSizes, SharedTransformer, shared_invocation
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("mamba", "hybrid")
GATED_NORM_EPS = 1e-5  # HF's Zamba2MambaMixer fixes its gated RMSNorm's eps, whatever rms_norm_eps says


@dataclass(frozen=True)
class Zamba2Config:
    n_layers: int
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]  # "mamba" or "hybrid", one per layer (stored as a tuple)
    n_heads: int  # H, SSM heads of every Mamba-2 layer
    d_head: int = derived(lambda c: c.d_inner // c.n_heads)  # P
    d_inner: int = derived(lambda c: 2 * c.d_model)  # HF mamba_expand = 2
    d_state: int = 64  # N
    n_groups: int = 1  # G
    d_conv: int = 4
    chunk_size: int = 256  # SSD chunk length; HF parity needs HF's value
    dt_limit: tuple[float, float] = (0.001, math.inf)  # HF (time_step_min, inf)
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: 2 * c.d_model // c.n_attn_heads)
    d_mlp: int = derived(lambda c: 4 * c.d_model)
    act_fn: str = "gelu"
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_mem_rope: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters minus rope_theta
    eps: float = 1e-5  # every RMSNorm but the gated one (GATED_NORM_EPS)
    tied: bool = True  # unembed shares the embedding matrix
    n_ctx: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        self._check()

    def _check(self) -> None:
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types must hold {self.n_layers} entries from {LAYER_TYPES}; got "
                             f"{len(self.layer_types)} entries{f', unknown {bad}' if bad else ''}")
        if self.d_inner != self.n_heads * self.d_head or self.n_heads % self.n_groups:
            raise ValueError(f"need d_inner == n_heads * d_head and n_groups | n_heads; got d_inner={self.d_inner}, "
                             f"n_heads={self.n_heads}, d_head={self.d_head}, n_groups={self.n_groups}")
        if self.n_attn_heads % self.n_attn_kv_heads:
            raise ValueError(f"n_attn_heads ({self.n_attn_heads}) must be a multiple of n_attn_kv_heads "
                             f"({self.n_attn_kv_heads})")
        if self.num_mem_blocks < 1:
            raise ValueError(f"num_mem_blocks must be >= 1, got {self.num_mem_blocks}")
        width = 2 * self.d_model
        if self.use_shared_attention_adapter and not (
                self.n_attn_kv_heads == self.n_attn_heads and self.n_attn_heads * self.d_attn_head == width):
            raise ValueError(f"q/k/v adapters write 2 * d_model = {width} features (as HF's Zamba2 does), so they need "
                             f"n_attn_kv_heads == n_attn_heads and n_attn_heads * d_attn_head == {width}; got "
                             f"{self.n_attn_heads} heads, {self.n_attn_kv_heads} kv heads of {self.d_attn_head}")

    @property
    def mixer(self) -> Mamba2Spec:
        """HF's Zamba2 conv always has a bias, and its gated norm a fixed eps (GATED_NORM_EPS)."""
        return Mamba2Spec.of(self, conv_bias=True, eps=GATED_NORM_EPS)

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "hybrid")

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def rotary(self) -> Rotary | None:
        return Rotary.of(self.d_attn_head, self.rope_theta, self.rope_scaling) if self.use_mem_rope else None

    def shared_block_of(self, layer: int) -> int:
        """Which shared block hybrid layer `layer` invokes: its invocation index mod num_mem_blocks."""
        return self.hybrid_layer_ids.index(layer) % self.num_mem_blocks

    @property
    def shared_sizes(self) -> SharedSizes:
        return SharedSizes(self.d_model, self.n_attn_heads, self.n_attn_kv_heads, self.d_attn_head, self.d_mlp,
                           self.act_fn, self.eps, self.adapter_rank, self.use_shared_attention_adapter,
                           self.proj_bias, self.rotary)


def build(cfg: Zamba2Config) -> LanguageModel:
    """Zamba2 with a hook on every quantity; every shared-block invocation has its own hooks."""
    mixer = cfg.mixer
    firsts: dict[int, SharedTransformer] = {}  # shared block -> its first invocation (owns the weights)
    blocks = []
    for layer, kind in enumerate(cfg.layer_types):
        side = None
        if kind == "hybrid":
            block_id = cfg.shared_block_of(layer)
            shared = shared_invocation(cfg.shared_sizes, firsts.get(block_id))
            firsts.setdefault(block_id, shared)
            shared.attn.unit_tag = "SH"  # labels "L{l}SH{h}": one invocation of a shared head
            side = Side("shared", shared, nn.Linear(cfg.d_model, cfg.d_model, bias=False))
        blocks.append(ResidualBlock([Sublayer("mixer", RMSNorm(cfg.d_model, cfg.eps), Mamba2Mixer(mixer), side=side)]))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embed_init_std=None)
