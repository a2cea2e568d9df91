"""Hyper-connections (Qwen4-Exp's gated residual): the residual is n_streams copies of d_model, read and
written through learned, input-dependent weights (HF Qwen4ExpTextGatedResidual).

Glossary
    n_streams   hc_count: parallel residual streams; the stream is [batch pos n_streams * d_model] ("d_stream")
    rank        hc_lowrank: the width of the read weights' bottleneck
    stream      the residual, n_streams blocks of d_model side by side (stream s = features s*d .. (s+1)*d)

HyperConnection (a sublayer's "norm": what the sublayer reads, and how its output is written back):
    normed = grouped_rmsnorm(stream)                             one RMS per stream (grouped_norm.py)
    mix    = sigmoid(up(silu(down(normed) / n_streams)))          [.. n_streams d_model]   hook_mix
    x      = mean_s(mix_s * normed_s)                             [.. d_model]   hook_normalized (the read)
    inject = 2 * sigmoid(block_inject(normed) / n_streams)        [.. n_streams] hook_inject
The final one (the model's ln_final) has no block_inject: it only reads.

HyperBlock: each step adds its sublayer's output to every stream, weighted by the stream's inject weight:
    stream = stream + flatten(inject[.., s] * module(x))          hook_{kind}_out [batch pos d_stream]
so the residual is still a plain sum of what the steps add (hook_{kind}_out is exactly that: zeroing it
removes the sublayer), but the read is not a norm of a d_model residual, and what a unit writes reaches the
stream through the inject weights of its own forward. A layer with per-layer embeddings (ple.py) first adds
`hook_ple_out` [batch pos d_stream] to the stream. Block hooks: block.py's, on d_stream.

What the analyses are told (the block protocol): `stream_map()` says the stream is n_streams x d_model wide and
how a step's output enters it; decompositions that project a d_model component into the stream need the inject
weights of the forward, and are refused by name (hooked/cache_resid.py asks `residual_sum()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.grouped_norm import GroupedRMSNorm
from hooked.models.language_model import LanguageModel
from hooked.models.norms import Norm

STREAM = ("batch", "pos", "d_stream")


class HyperConnection(Norm):
    """Read a sublayer's input from the streams (forward: x) and the weights its output is written with (`read`)."""

    def __init__(self, d_model: int, n_streams: int, rank: int, eps: float, combine: bool = True) -> None:
        super().__init__()
        if n_streams < 2:
            raise ValueError(f"hyper-connections need at least 2 streams, got {n_streams}")
        self.d_model, self.n_streams = d_model, n_streams
        d_stream = n_streams * d_model
        self.hc_norm = GroupedRMSNorm(d_stream, d_model, eps)
        self.input_mix_weight_down = nn.Linear(d_stream, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, d_stream, bias=False)
        self.block_inject_weight = nn.Linear(d_stream, n_streams, bias=False) if combine else None
        self.dims = {"n_streams": n_streams}
        self.hook_mix = HookPoint("batch pos n_streams d_model")  # the read weights, after the sigmoid
        self.hook_normalized = HookPoint("batch pos d_model")  # what the sublayer reads
        if combine:
            self.hook_inject = HookPoint("batch pos n_streams")  # the write weights

    def read(self, stream: Float[Tensor, "batch pos d_stream"]
             ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos n_streams"] | None]:
        normed = self.hc_norm(stream)
        mix = F.silu(self.input_mix_weight_down(normed) / self.n_streams)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.n_streams, self.d_model))
        mix = self.hook_mix(mix)
        x = (mix * normed.unflatten(-1, (self.n_streams, self.d_model))).mean(dim=-2)
        x = self.hook_normalized(x)
        if self.block_inject_weight is None:
            return x, None
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.n_streams)
        inject = self.hook_inject(inject)
        return x, inject

    def forward(self, stream: Float[Tensor, "batch pos d_stream"]) -> Float[Tensor, "batch pos d_model"]:
        return self.read(stream)[0]

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}, d_model={self.d_model}, combine={self.block_inject_weight is not None}"


def spread(inject: Float[Tensor, "*lead n_streams"], out: Float[Tensor, "*lead d_model"]) -> Float[Tensor, "*lead d_stream"]:
    """A d_model output written into every stream with its inject weight: [.., s * d + i] = inject_s * out_i."""
    return (inject[..., :, None] * out[..., None, :]).flatten(-2)


class HyperBlock(ResidualBlock):
    """Serial steps on hyper-connected streams (module docstring); `ple` adds per-layer embeddings first."""

    def __init__(self, steps: Sequence[Sublayer], n_streams: int, d_model: int, ple: nn.Module | None = None) -> None:
        if not all(isinstance(s, Sublayer) and isinstance(s.norm, HyperConnection) and s.side is None
                   and s.post_norm is None and s.scale == 1.0 for s in steps):
            raise ValueError("a HyperBlock has serial sublayers read through HyperConnections (no side input, "
                             "post-norm or scale)")
        super().__init__(steps)
        self.n_streams = n_streams
        self.dims = {"d_stream": n_streams * d_model, "n_streams": n_streams}
        if ple is not None:
            self.ple = ple
            self.hook_ple_out = HookPoint("batch pos d_stream")
        else:
            self.ple = None
        for name, point in self.named_children():
            if name.startswith("hook_") and name != "hook_ple_out":
                point.axes = STREAM

    @property
    def reads_tokens(self) -> bool:
        return self.ple is not None

    def residual_sum(self) -> bool:
        """False: what a unit writes reaches the stream through this forward's inject weights, so a d_model
        decomposition of the residual is not this block's (decompositions refuse it by name)."""
        return False

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        raise ValueError("fold_ln: a hyper-connection's read is not a norm followed by linear maps (its weights "
                         "depend on the streams), so nothing can be folded into the sublayers")

    def forward(self, resid: Float[Tensor, "batch pos d_stream"], ctx: Context) -> Float[Tensor, "batch pos d_stream"]:
        resid = self.hook_resid_pre(resid)
        if self.ple is not None:
            resid = resid + self.hook_ple_out(self.ple(resid, ctx))
        for n, (_, i, step) in enumerate(self._plan):
            if n == 1:
                resid = self.hook_resid_mid(resid)
            x, inject = getattr(self, f"ln{i}").read(getattr(self, f"hook_{step.kind}_in")(resid))
            out = getattr(self, step.kind)(x, ctx)
            resid = resid + getattr(self, f"hook_{step.kind}_out")(spread(inject, out))
        return self.hook_resid_post(resid)

    def extra_repr(self) -> str:
        ple = "ple, then " if self.ple is not None else ""
        return ple + ", then ".join(f"streams + inject * {s.kind}(read(streams))" for _, _, s in self._plan)


class StreamsLanguageModel(LanguageModel):
    """language_model.py's model on n_streams copies of the residual: the embedding enters every stream
    (stream = [embed, .., embed], the input of block 0), and ln_final is a HyperConnection's read."""

    def __init__(self, cfg: Any, blocks: Sequence[nn.Module], final_read: HyperConnection, **kwargs: Any) -> None:
        self.n_streams = final_read.n_streams
        super().__init__(cfg, blocks, final_read, **kwargs)
        self.reads_embedding = False

    @property
    def dims(self) -> dict[str, int]:
        return {**super().dims, "d_stream": self.n_streams * self.cfg.d_model, "n_streams": self.n_streams}

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_stream"]:
        return super().embed_input(tokens, ctx).repeat(1, 1, self.n_streams)
