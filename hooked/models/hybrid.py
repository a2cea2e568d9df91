"""What the hybrid families (Bamba, Granite 4, Falcon-H1, NemotronH, Jamba, Zamba2) share: pre-RMSNorm
steps of one sublayer each, and a check of their per-layer kind lists.

    pre_norm_block(d_model, eps, ("attn", attention), ("mlp", mlp), scale=m)
        = ResidualBlock([Sublayer("attn", RMSNorm, attention, scale=m), Sublayer("mlp", RMSNorm, mlp, scale=m)])
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.norms import RMSNorm


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
