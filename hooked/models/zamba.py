"""Zamba (Glorioso et al. 2024, v1): grouped Mamba-1 layers, some of which first call ONE shared transformer.

Glossary (TransformerLens / SSM names; HF ZambaConfig names in brackets)
    n_layers [num_hidden_layers]  d_model [hidden_size]  d_vocab [vocab_size]
    layer_types [layers_block_type]  "mamba" (HF "linear_attention") or "hybrid", one per layer
    Mamba layers (grouped_mamba.py): n_groups [n_mamba_heads] channel groups, each with its own x_proj and
        dt_proj; d_inner [mamba_expand * hidden_size], d_state [mamba_d_state], d_conv [mamba_d_conv],
        dt_rank [mamba_dt_rank], conv_bias [mamba_conv_bias], proj_bias [mamba_proj_bias]
    shared transformer (zamba2_shared.py's SharedTransformer, no adapters): n_attn_heads [num_attention_heads],
        n_attn_kv_heads [num_key_value_heads], d_attn_head [attention_head_dim = 2 d_model / n_attn_heads],
        d_mlp [intermediate_size], act_fn [hidden_act]; no positional encoding; scores scaled by
        (d_attn_head / 2)^-1/2 as HF's ZambaAttention does
    embedding  the token embedding, read again by every shared-block invocation (Context.embedding)

    resid_0 = W_E[token]                                                   hook_embed
    mamba layer l:   resid = resid + mixer(ln1(resid))
    hybrid layer l:  shared_out = linear_l(mlp(ln2(attn(ln1([resid, embedding])))))   (one block, all layers)
                     resid = resid + mixer(ln1(resid + shared_out))        (block.py's Side input)
    logits = ln_final(resid) @ W_U^T  (W_U tied to W_E by default)

HF (transformers 5.24) ties the hybrid layers' blocks through `_tied_weights_keys`, which it applies only with
tie_word_embeddings: an untied config gives each hybrid layer a block of its own (shared_tied = tied, as HF).

For ablation a channel of a Mamba layer is a "head" (as in mamba.py): cfg.n_heads = d_inner.
Hooks: as zamba2.py's (blocks.{l}.shared.*, blocks.{l}.hook_shared_out), with the grouped Mamba-1 mixer's
blocks.{l}.mixer.* (mamba.py's, hook_B and hook_C [batch pos n_groups d_state]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Side, Sublayer
from hooked.models.config import derived
from hooked.models.grouped_mamba import GroupedMambaMixer
from hooked.models.hybrid import check_kinds
from hooked.models.language_model import LanguageModel
from hooked.models.mamba import MambaSpec
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.models.zamba2_shared import SharedTransformer


@dataclass(frozen=True)
class ZambaConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]  # "mamba" or "hybrid", one per layer (stored as a tuple)
    n_groups: int = 2  # G, channel groups of every Mamba layer (HF n_mamba_heads)
    d_inner: int = derived(lambda c: 2 * c.d_model)  # E*D
    d_state: int = 16  # N
    d_conv: int = 4
    dt_rank: int = derived(lambda c: math.ceil(c.d_model / 16))  # R
    conv_bias: bool = True
    proj_bias: bool = False  # bias of in_proj and out_proj
    n_attn_heads: int = 16
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = derived(lambda c: 2 * c.d_model // c.n_attn_heads)
    d_mlp: int = derived(lambda c: 4 * c.d_model)
    act_fn: str = "gelu"
    eps: float = 1e-5
    tied: bool = True  # unembed shares the embedding matrix
    shared_tied: bool = derived(lambda c: c.tied)  # one block for every hybrid layer (False: one block per layer)
    n_ctx: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, self.n_layers,
                                                            ("mamba", "hybrid")))
        if self.n_groups < 1 or self.d_inner % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide d_inner ({self.d_inner})")
        if self.n_attn_kv_heads < 1 or self.n_attn_heads % self.n_attn_kv_heads:
            raise ValueError(f"n_attn_heads ({self.n_attn_heads}) must be a multiple of n_attn_kv_heads "
                             f"({self.n_attn_kv_heads})")

    @property
    def mixer(self) -> MambaSpec:
        return MambaSpec(self.d_model, self.d_inner, self.d_state, self.d_conv, self.dt_rank, self.conv_bias,
                         self.proj_bias)

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "hybrid")

    @property
    def n_heads(self) -> int:
        """For ablation a Mamba-1 "head" is one inner channel."""
        return self.d_inner

    @property
    def d_head(self) -> int:
        return 1


def shared_invocation(cfg: ZambaConfig, first: SharedTransformer | None) -> SharedTransformer:
    """One invocation of the shared block: fresh hooks; the weights of `first` (None: new weights). Its linear
    maps are the same nn.Linear modules as first's, its norms new RMSNorms holding first's Parameters."""
    d_in = 2 * cfg.d_model
    attn = Attention(d_in, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head, d_out=cfg.d_model,
                     scale=(cfg.d_attn_head / 2) ** -0.5)
    ln1, ln2 = RMSNorm(d_in, cfg.eps), RMSNorm(cfg.d_model, cfg.eps)
    mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
    if first is not None:  # share weights, not hooks
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, proj, getattr(first.attn, proj))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, proj, getattr(first.mlp, proj))
        ln1.weight, ln2.weight = first.ln1.weight, first.ln2.weight
    return SharedTransformer(ln1, attn, ln2, mlp)


def build(cfg: ZambaConfig) -> LanguageModel:
    """Zamba with a hook on every quantity; every shared-block invocation has its own hooks."""
    first = None
    blocks = []
    for kind in cfg.layer_types:
        side = None
        if kind == "hybrid":
            shared = shared_invocation(cfg, first)
            first = (first or shared) if cfg.shared_tied else None
            shared.attn.unit_tag = "SH"  # labels "L{l}SH{h}": one invocation of the shared heads
            side = Side("shared", shared, nn.Linear(cfg.d_model, cfg.d_model, bias=False))
        mixer = GroupedMambaMixer(cfg.mixer, cfg.n_groups)
        blocks.append(ResidualBlock([Sublayer("mixer", RMSNorm(cfg.d_model, cfg.eps), mixer, side=side)]))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), embed_init_std=None)
