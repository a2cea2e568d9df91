"""Hyper-connections (Qwen4-Exp's gated residual): the residual is n_streams copies of d_model, read and
written through learned, input-dependent weights (HF Qwen4ExpTextGatedResidual).

Glossary
    n_streams   hc_count: parallel residual streams; the stream is [batch pos n_streams * d_model] ("d_stream")
    rank        hc_lowrank: the width of the read weights' bottleneck
    stream      the residual, n_streams blocks of d_model side by side (stream s = features s*d .. (s+1)*d)

HyperConnection (a sublayer's "norm": what the sublayer reads, and the weights its output is written with):
    normed = grouped_rmsnorm(stream)                             one RMS per stream (grouped_norm.py)
    mix    = sigmoid(up(silu(down(normed) / n_streams)))          [.. n_streams d_model]  hook_mix
    x      = mean_s(mix_s * normed_s)                             [.. d_model]  hook_normalized (the read)
    inject = 2 * sigmoid(block_inject(normed) / n_streams)        [.. n_streams] hook_inject (`inject(stream)`)
`hook_scale` [.. d_stream] is the read as one factor per stream feature, x = sum_s factor_s * stream_s
(factor = mix * (1 + w) / (n_streams * rms_s)): the norm's "scale" as the analyses take it (normalize_with_scale
applies a cached factor to a stack of components: linear, so they sum to the read); an edited factor is what
the read multiplies by. The final read (the model's ln_final) has no block_inject.

HyperBlock: each step adds its sublayer's output to every stream, weighted by that stream's inject weight:
    stream = stream + flatten(inject[.., s] * module(x))          hook_{kind}_out [batch pos d_stream]
The residual is still a plain sum of what the steps add (hook_{kind}_out is exactly that; zeroing it removes
the sublayer). The writers say how a d_model output reaches the stream: their `post_norm` is a `StreamWrite`,
whose "scale" is the run's inject weights (hook_inject), so the analyses that carry a unit's write through a
post-norm with that run's scale (hooked/cache_resid.py, the circuits' senders) carry it into the streams. A layer
with per-layer embeddings (ple.py) has a first writer of kind "ple", reading the stream itself (a NoNorm,
`ple_in`): blocks.{l}.hook_ple_in, hook_ple_out [batch pos d_stream]. Block hooks are block.py's, on d_stream.
fold_ln is refused (a read is no norm followed by linear maps).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.block import ResidualBlock, Sublayer, Writer
from hooked.models.grouped_norm import GroupedRMSNorm
from hooked.models.language_model import LanguageModel
from hooked.models.norms import NoNorm, Norm

STREAM = ("batch", "pos", "d_stream")


class HyperConnection(Norm):
    """Read a sublayer's input from the streams (forward) and the weights its output is written with (`inject`)."""

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
        self.hook_scale = HookPoint("batch pos d_stream", element="wide")  # the read's factor per stream feature
        self.hook_normalized = HookPoint("batch pos d_model")  # what the sublayer reads
        if combine:
            self.hook_inject = HookPoint("batch pos n_streams")  # the write weights
            self.write = StreamWrite(self)  # how the sublayer's output enters the streams (its writer's post_norm)

    @property
    def weight(self) -> Tensor:
        return self.hc_norm.weight

    def input_grads_(self, x: Float[Tensor, "*lead d_stream"], grads: Float[Tensor, "n *lead d_model"]) -> None:
        """No closed form (the read narrows the stream, its weights depend on it): the caller takes autograd's."""
        return None

    def _mix(self, normed: Tensor) -> Tensor:
        mix = F.silu(self.input_mix_weight_down(normed) / self.n_streams)
        return torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.n_streams, self.d_model))

    def _factor(self, stream: Tensor, mix: Tensor) -> Tensor:
        """mix * (1 + w) / (n_streams * rms_s): the read as a factor of each stream feature (wide dtype)."""
        x32 = stream.to(torch.promote_types(stream.dtype, torch.float32)).unflatten(-1, (self.n_streams, self.d_model))
        inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.hc_norm.eps)
        gain = 1.0 + self.hc_norm.weight.to(x32.dtype).view(self.n_streams, self.d_model)
        return (mix.to(x32.dtype) * gain * inv / self.n_streams).flatten(-2)

    def forward(self, stream: Float[Tensor, "batch pos d_stream"]) -> Float[Tensor, "batch pos d_model"]:
        normed = self.hc_norm(stream)
        mix = self.hook_mix(self._mix(normed))
        fast = (mix * normed.unflatten(-1, (self.n_streams, self.d_model))).mean(dim=-2)
        if self.hook_scale.is_active:
            factor, edited = through_hook(self.hook_scale, self._factor(stream, mix))
            if edited is not None:
                fast = self.normalize_with_scale(stream, factor).to(stream.dtype)
        return self.hook_normalized(fast)

    def inject(self, stream: Float[Tensor, "batch pos d_stream"]) -> Float[Tensor, "batch pos n_streams"]:
        inject = 2 * torch.sigmoid(self.block_inject_weight(self.hc_norm(stream)) / self.n_streams)
        return self.hook_inject(inject)

    def normalize_with_scale(self, stack: Float[Tensor, "*comp d_stream"],
                             scale: Float[Tensor, "*batch d_stream"]) -> Float[Tensor, "*comp d_model"]:
        """The read of each component at a run's factor (hook_scale): linear, components sum to the read."""
        return (scale.to(stack.dtype) * stack).unflatten(-1, (self.n_streams, self.d_model)).sum(dim=-2)

    def normalize_fresh(self, stack: Float[Tensor, "*comp d_stream"]) -> Float[Tensor, "*comp d_model"]:
        """Each component read on its own (its own norms and mix weights; no hooks fire)."""
        normed = self.hc_norm(stack)
        return (self._mix(normed) * normed.unflatten(-1, (self.n_streams, self.d_model))).mean(dim=-2)

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}, d_model={self.d_model}, combine={self.block_inject_weight is not None}"


def spread(inject: Float[Tensor, "*lead n_streams"], out: Float[Tensor, "*units d_model"]) -> Tensor:
    """A d_model output written into every stream with its inject weight: [.., s * d + i] = inject_s * out_i
    (out may carry leading unit axes: [units .. d_model] -> [units .. d_stream])."""
    return (inject[..., :, None] * out[..., None, :]).flatten(-2)


class StreamWrite(nn.Module):
    """How a step's d_model output enters the streams, in the shape of a post-norm: `hook_scale` is the run's
    inject weights (its HyperConnection's hook_inject), `normalize_with_scale` spreads with them. In
    the module tree once, as ln{i}.write, holding no parameters or hooks of its own (its read's are ln{i}'s)."""

    def __init__(self, read: HyperConnection) -> None:
        super().__init__()
        self.__dict__["read"] = read  # not a child (it is the parent)

    @property
    def hook_scale(self) -> HookPoint:
        return self.read.hook_inject

    @property
    def weight(self) -> Tensor:
        return self.read.block_inject_weight.weight

    def normalize_with_scale(self, stack: Float[Tensor, "*comp d_model"],
                             scale: Float[Tensor, "*batch n_streams"]) -> Float[Tensor, "*comp d_stream"]:
        return spread(scale.to(stack.dtype), stack)


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
            self.hook_ple_in = HookPoint("batch pos d_stream")
            self.ple_in = NoNorm()
            self.ple = ple
            self.hook_ple_out = HookPoint("batch pos d_stream")
        else:
            self.ple = None
        for name, point in self.named_children():
            if name.startswith("hook_"):
                point.axes = STREAM

    def writers(self) -> Iterator[Writer]:
        """The PLE (when the layer has one, step 0), then the steps, each written through its StreamWrite."""
        if self.ple is not None:
            yield Writer("ple", self.ple, self.hook_ple_out, self.ple_in, step=0)
        for _, i, step in self._plan:
            read = getattr(self, f"ln{i}")
            yield Writer(step.kind, getattr(self, step.kind), getattr(self, f"hook_{step.kind}_out"), read,
                         post_norm=read.write, step=i)

    @property
    def kind(self) -> str:
        return self._plan[0][2].kind

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        raise ValueError("fold_ln: a hyper-connection's read is not a norm followed by linear maps (its weights "
                         "depend on the streams), so nothing can be folded into the sublayers")

    def forward(self, resid: Float[Tensor, "batch pos d_stream"], ctx: Context) -> Float[Tensor, "batch pos d_stream"]:
        resid = self.hook_resid_pre(resid)
        if self.ple is not None:
            resid = resid + self.hook_ple_out(self.ple(self.ple_in(self.hook_ple_in(resid)), ctx))
        for n, (_, i, step) in enumerate(self._plan):
            if n == 1:
                resid = self.hook_resid_mid(resid)
            stream = getattr(self, f"hook_{step.kind}_in")(resid)
            read = getattr(self, f"ln{i}")
            out = getattr(self, step.kind)(read(stream), ctx)
            resid = resid + getattr(self, f"hook_{step.kind}_out")(spread(read.inject(stream), out))
        return self.hook_resid_post(resid)

    def extra_repr(self) -> str:
        ple = "ple, then " if self.ple is not None else ""
        return ple + ", then ".join(f"streams + inject * {s.kind}(read(streams))" for _, _, s in self._plan)


class StreamsLanguageModel(LanguageModel):
    """language_model.py's model on n_streams copies of the residual: the embedding enters every stream
    (hook_embed [batch pos d_stream]: [embed, .., embed], the input of block 0), ln_final is a HyperConnection's
    read."""

    def __init__(self, cfg: Any, blocks: Sequence[nn.Module], final_read: HyperConnection, **kwargs: Any) -> None:
        self.n_streams = final_read.n_streams
        super().__init__(cfg, blocks, final_read, **kwargs)
        self.hook_embed.axes = STREAM

    @property
    def dims(self) -> dict[str, int]:
        return {**super().dims, "d_stream": self.n_streams * self.cfg.d_model, "n_streams": self.n_streams}

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_stream"]:
        return self.hook_embed(self._scaled(self.embed(tokens)).repeat(1, 1, self.n_streams))
