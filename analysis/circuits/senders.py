"""The graph's senders: what writes into the residual stream (or into one step's input), per run.

Glossary
    sender group  the senders one sublayer contributes, read at its hooks in one forward:
                  EmbedSender ("embed": the stream entering block 0), UnitSender (a token mixer split
                  into units: "L{l}{tag}{h}"), ExpertSender (a mixture of experts: "L{l}E{e}" and its
                  always-on MLP "L{l}shared"), WholeSender (any other sublayer: "mlp{l}", "mixer{l}",
                  "attn{l}"), SideSender (a side block's output, "shared{l}": Zamba2's shared transformer,
                  which enters its step's input only, never the stream)
    activation    a [n, batch, pos, d_model] tensor per group: what each sender adds. For units and experts,
                  each part as it reaches the stream (times the block's output scale, through a post-norm
                  with that run's scale, as hooked.cache_resid takes them) plus 1/n of the remainder
                  (the output bias and what else belongs to no unit), so a group's senders sum to the
                  sublayer's `hook_{kind}_out` exactly and every run decomposes on its own terms
    emit          `emit(group, activation, emb=None)`: called once per forward when a group's
                  activation is known (its out hook); the embed group also passes `emb`, the token
                  embedding (hook_embed: what side blocks read as Context.embedding, without positions).
                  A unit group passes `Parts`: its activation unbuilt (`.tensor()` builds it), so a
                  recording that only subtracts two runs builds the difference once (`.minus`)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hooked.models.model_map import label
from hooked.models.protocol import ExpertMixture, keeper

Emit = Callable[..., None]
Hooks = list[tuple[Any, Callable[[Tensor, Any], Any]]]


class SenderGroup:
    labels: list[str]
    stage: int  # the step after which the group's writes are in the stream (-1: before block 0)
    layer: int
    side: bool = False  # writes into its own step's input only

    def hooks(self, emit: Emit) -> Hooks:
        raise NotImplementedError


class EmbedSender(SenderGroup):
    def __init__(self, model: Any) -> None:
        self.labels, self.stage, self.layer = ["embed"], -1, -1
        self.resid_hook = model.blocks[0].hook_resid_pre
        self.embed_hook = model.hook_embed

    def hooks(self, emit: Emit) -> Hooks:
        seen: dict[str, Tensor] = {}

        def on_embed(x: Tensor, hook: Any) -> None:
            seen["emb"] = x

        def on_resid(x: Tensor, hook: Any) -> None:
            emit(self, x[None], emb=seen.pop("emb")[None])

        return [(self.embed_hook, on_embed), (self.resid_hook, on_resid)]


class _Writes(SenderGroup):
    """Shared by the groups that split one writer's output: parts -> activations."""

    def __init__(self, writer: Any, layer: int, stage: int) -> None:
        self.writer, self.layer, self.stage = writer, layer, stage
        self.scale_hook = writer.post_norm.hook_scale if writer.post_norm is not None else None

    def _to_stream(self, parts: Tensor, out: Tensor, scale: Tensor | None) -> Tensor:
        """parts [n b p d] as they reach the stream, plus 1/n of what the parts leave out of `out`."""
        w = self.writer
        parts = parts.to(out.dtype)
        if w.post_norm is not None:
            parts = w.post_norm.normalize_with_scale(parts, scale).to(out.dtype)
        if w.scale != 1.0:
            parts = parts * w.scale
        return parts.add_((out - parts.sum(0)) / parts.shape[0])  # parts is new here: added in place

    def _scale_hooks(self, seen: dict[str, Tensor]) -> Hooks:
        if self.scale_hook is None:
            return []

        def on_scale(s: Tensor, hook: Any) -> None:
            seen["scale"] = s

        return [(self.scale_hook, on_scale)]


class Parts:
    """A unit group's activation in one run, kept as what it is built from: the units' input to the output
    projection (`write`), the sublayer's output and the post-norm's scale. `tensor()` builds it.

    Without a post-norm the activation is linear in (write, out): parts(w) * s + (out - sum parts(w) * s) / n
    with parts linear and s a constant, so two runs' difference is built once from the differences
    (`minus`): one per-unit product instead of two, on the difference."""

    def __init__(self, group: "UnitSender", write: Tensor, out: Tensor, scale: Tensor | None) -> None:
        self.group, self.write, self.out, self.scale = group, write, out, scale

    def detach(self) -> "Parts":
        return Parts(self.group, self.write.detach(), self.out.detach(),
                     None if self.scale is None else self.scale.detach())

    @torch.no_grad()  # recordings and patched runs: no graph through the build
    def tensor(self) -> Tensor:
        return self.group.build(self.write, self.out, self.scale)

    @torch.no_grad()
    def minus(self, other: "Parts") -> Tensor:
        if self.group.writer.post_norm is not None:  # scaled by each run's own norm: not linear
            return self.tensor() - other.tensor()
        return self.group.build(self.write - other.write, self.out - other.out, None)


class UnitSender(_Writes):
    """A token mixer's units (attention heads, Mamba-2 heads): each one's write as the mixer gives it,
    `head_writes` of its `unit_inputs` (a gated head's z times its gate) read at its `write_reads`."""

    def __init__(self, writer: Any, layer: int, stage: int, tag: str) -> None:
        super().__init__(writer, layer, stage)
        heads = writer.module.heads()
        self.reads = writer.module.write_reads()
        self.labels = [label(layer, tag, h) for h in range(heads.n)]

    def hooks(self, emit: Emit) -> Hooks:
        seen: dict[str, Tensor] = {}

        def on_out(out: Tensor, hook: Any) -> None:
            reads = [seen.pop(i) for i in range(len(self.reads))]
            write = self.writer.module.unit_inputs(*reads)  # linear in what build maps: Parts.minus holds
            emit(self, Parts(self, write, out, seen.pop("scale", None)))

        return ([(h, keeper(seen, i)) for i, h in enumerate(self.reads)] + self._scale_hooks(seen)
                + [(self.writer.out_hook, on_out)])

    def build(self, write: Tensor, out: Tensor, scale: Tensor | None) -> Tensor:
        """The activation [n b p d] from the units' input to the output projection and the sublayer's output."""
        parts = self.writer.module.head_writes(write).movedim(-2, 0)  # [n b p d]
        return self._to_stream(parts, out, scale)


class ExpertSender(_Writes):
    """A mixture of experts: routing weight times expert output per expert, and the always-on MLP."""

    def __init__(self, writer: Any, layer: int, stage: int) -> None:
        super().__init__(writer, layer, stage)
        moe = writer.module
        shared = [label(layer, "shared")] if moe.shared is not None else []  # the always-on MLP, whole
        self.labels = [label(layer, "E", e) for e in range(moe.n_experts)] + shared

    def hooks(self, emit: Emit) -> Hooks:
        moe, seen = self.writer.module, {}
        reads = moe.write_reads()  # what each expert's write is computed from (hooked.models.protocol)

        def on_out(out: Tensor, hook: Any) -> None:
            parts = moe.unit_writes(*(seen.pop(i) for i in range(len(reads)))).movedim(-2, 0)  # [E b p d]
            if moe.shared is not None:
                parts = torch.cat([parts, seen.pop("shared_out")[None]])
            emit(self, self._to_stream(parts, out, seen.pop("scale", None)))

        shared = [(moe.hook_shared_out, keeper(seen, "shared_out"))] if moe.shared is not None else []
        return ([(h, keeper(seen, i)) for i, h in enumerate(reads)] + shared + self._scale_hooks(seen)
                + [(self.writer.out_hook, on_out)])


class WholeSender(SenderGroup):
    """A sublayer as one sender: its `hook_{kind}_out` (or a side block's output)."""

    def __init__(self, label: str, out_hook: Any, layer: int, stage: int, side: bool = False) -> None:
        self.labels, self.out_hook, self.layer, self.stage, self.side = [label], out_hook, layer, stage, side

    def hooks(self, emit: Emit) -> Hooks:
        def on_out(out: Tensor, hook: Any) -> None:
            emit(self, out[None])

        return [(self.out_hook, on_out)]


def writer_senders(writer: Any, layer: int, stage: int, tag: str | None) -> SenderGroup:
    """The sender group of one writer: units when it is a token mixer whose units are heads (width > 1;
    Mamba-1's channels stay whole), experts for a mixture, else the sublayer whole."""
    module = writer.module
    if tag is not None and module.heads().width > 1:
        return UnitSender(writer, layer, stage, tag)
    if isinstance(module, ExpertMixture):
        return ExpertSender(writer, layer, stage)
    return WholeSender(f"{writer.kind}{layer}", writer.out_hook, layer, stage)
