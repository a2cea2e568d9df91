"""A block whose residual path runs through the sublayer's norm (MiniMax-01's DeepNorm-style steps).

    x     = ln_i(resid)
    resid = alpha_i * x + beta_i * module(x)        (HF MiniMax: residual = the normed input)

Each step is block.py's Sublayer (its `scale` is beta_i) plus its alpha_i; hooks are block.py's:
hook_resid_pre, hook_{kind}_in, ln{i}.*, {kind}.*, hook_{kind}_out (beta_i * module(x), what the
sublayer adds), hook_resid_mid, hook_resid_post. So zeroing hook_{kind}_out removes the sublayer exactly
(resid = alpha_i * x), as in every other block.

Not as in other blocks: the writers do not sum to resid_post - resid_pre, since the stream itself is
renormalised at every step (resid_mid = alpha_1 * ln1(resid_pre) + attn_out). `stream_norms` lists those
steps: the cache's decompositions (hooked/cache_resid.py) carry each earlier component through them, alpha
times the norm with its cached scale (linear in the stream once the scale is fixed), so they stay exact.
fold_ln is refused: the norm's weight multiplies the stream, not only its readers.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtyping import Float
from torch import Tensor, nn

from hooked.models.base import Context
from hooked.models.block import ResidualBlock, Sublayer


class NormResidualBlock(ResidualBlock):
    """Serial steps resid = alpha * ln(resid) + scale * module(ln(resid)), one alpha per step."""

    def __init__(self, steps: Sequence[Sublayer], alphas: Sequence[float]) -> None:
        if len(alphas) != len(steps) or not all(isinstance(s, Sublayer) and s.side is None and s.post_norm is None
                                                for s in steps):
            raise ValueError("a NormResidualBlock has serial sublayers (no side input, no post-norm), one alpha each")
        super().__init__(steps)
        self.alphas = tuple(float(a) for a in alphas)

    def stream_norms(self) -> list[tuple[int, nn.Module, float]]:
        return [(i, getattr(self, f"ln{i}"), a) for (_, i, _), a in zip(self._plan, self.alphas)]

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        raise ValueError("fold_ln: this block's residual path runs through its norms (resid = alpha * ln(resid) "
                         "+ ...), so a norm's weight cannot move into its readers alone")

    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        for n, (_, i, step) in enumerate(self._plan):
            if n == 1:
                resid = self.hook_resid_mid(resid)
            x = getattr(self, f"ln{i}")(getattr(self, f"hook_{step.kind}_in")(resid))
            out = getattr(self, step.kind)(x, ctx)
            out = getattr(self, f"hook_{step.kind}_out")(out if step.scale == 1.0 else out * step.scale)
            resid = (x if self.alphas[n] == 1.0 else x * self.alphas[n]) + out
        return self.hook_resid_post(resid)

    def extra_repr(self) -> str:
        steps = zip(self.alphas, self._plan)
        return ", then ".join(f"{a:g}*ln{i}(resid) + {s.scale:g}*{s.kind}" for a, (_, i, s) in steps)
