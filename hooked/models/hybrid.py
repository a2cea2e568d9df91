"""What the hybrid families (Bamba, Granite 4, Falcon-H1, NemotronH, Jamba, Zamba2) share: pre-RMSNorm
steps of one sublayer each, and a check of their per-layer kind lists.

    pre_norm_block(d_model, eps, ("attn", attention), ("mlp", mlp), scale=m)
        = ResidualBlock([Sublayer("attn", RMSNorm, attention, scale=m), Sublayer("mlp", RMSNorm, mlp, scale=m)])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary


def hybrid_attention(cfg: Any, *, bias: bool = False, rotary: Rotary | None = None,
                     scale: float | None = None) -> Attention:
    """The attention layer of a hybrid config, which spells its sizes d_model, n_attn_heads,
    n_attn_kv_heads and d_attn_head (`bias` on q, k, v and o)."""
    return Attention(cfg.d_model, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head, qkv_bias=bias, o_bias=bias,
                     rotary=rotary, scale=scale)


def pre_norm_block(d_model: int, eps: float, *sublayers: tuple[str, nn.Module], scale: float = 1.0) -> ResidualBlock:
    """One or two serial sublayers, each read through its own RMSNorm, outputs times `scale`."""
    return ResidualBlock([Sublayer(kind, RMSNorm(d_model, eps), module, scale=scale) for kind, module in sublayers])


def check_kinds(name: str, kinds: Sequence[str], n_layers: int, known: Sequence[str]) -> tuple[str, ...]:
    """`kinds` as a tuple, after checking it names one of `known` for each of the n_layers layers."""
    kinds = tuple(kinds)
    bad = sorted(set(kinds) - set(known))
    if bad or len(kinds) != n_layers:
        raise ValueError(f"{name} must hold {n_layers} entries from {tuple(known)}; got {len(kinds)} entries"
                         f"{f', unknown {bad}' if bad else ''}")
    return kinds
