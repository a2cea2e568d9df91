"""The mixer protocol: what every sublayer that moves information between positions tells the analyses.

Analyses (knockout, head ablation, G&A, decay features, the head-unit names) read these methods;
they never look at module names, parameter names or tensor ranks.

Glossary
    TokenMixer   a sublayer mixing positions: attention (attention.py), the SSM mixers (mamba.py,
                 mamba2.py), the delta-rule mixers. A base class, so `isinstance(m, TokenMixer)` finds
                 them anywhere in a block (Zamba2's shared attention included).
    Heads        the mixer's units and where each one's write can be cut: n units of `width` features
                 at `write_hook` (attention: query heads at hook_z [.. n_heads d_head]; Mamba-2: SSM
                 heads at hook_gated [.. d_inner], d_head each; Mamba-1: channels, width 1). Zeroing a
                 unit there zeroes its columns of the output projection.
    unit_tag     the letter of its units in labels "L{layer}{tag}{h}": "H" (attention heads), "M" (SSM
                 heads or channels), "SH" (Zamba2's shared attention, set by the family's build)
    edge         (target j <- source i) inside one layer; `cut_edges` returns the hooks that remove
                 exactly those edges in a forward (hooked/ops/edge_cut.py holds the arithmetic)
    masks        `masks(batch, pos, device) -> (target, source)`, bool [batch pos] each: the edges'
                 positions, resolved when the forward's length is known
    channels     a bool mask over the units (None: every unit) an SSM cut is restricted to;
                 attention always cuts every head

Every sublayer (mixers, MLPs, MoE) also answers, for weight processing and attribution:
    input_linears()  the linear maps applied to its (normalised) input: fold_ln folds the norm into them
    output_bias()    what it adds whatever its input (o_proj's / down_proj's / out_proj's bias), or None
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hooked.ops.edge_cut import attention_cut, conv_channels, conv_cut, kernel_cut

Masks = Callable[[int, int, torch.device], tuple[Tensor, Tensor]]
Index = Callable[[int, torch.device], Tensor]  # (pos, device) -> long positions
HookPoint = Any  # hooked.hook_points.HookPoint: not imported, the hook engine's cache reads this module
CutHooks = list[tuple[HookPoint, Callable[[Tensor, Any], Any]]]
ATTENTION_MODES = ("scores", "pattern")


@dataclass(frozen=True)
class Heads:
    n: int
    width: int
    write_hook: HookPoint
    kind: str  # "attn" or "ssm"
    result_hook: HookPoint  # each unit's write after the output projection [.. pos n d_out] (lazy)


class TokenMixer:
    """Base class of the sublayers that mix positions (see the module glossary)."""

    unit_tag: ClassVar[str] = "H"

    def heads(self) -> Heads:
        raise NotImplementedError

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        raise NotImplementedError

    def decay_norms(self) -> Tensor:
        """||exp(A)||_1 over d_state at dt = 1 per unit: large = slow decay (long memory)."""
        raise TypeError(f"{type(self).__name__} has no state decay (decay_norms is for state-space mixers)")

    def kernel_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        """Hooks that call on_slice(kernel[:, :, idx, :]) (axis "rows") or on_slice(kernel[..., idx])
        ("cols") of this mixer's kernel in a forward, idx = index(pos, device), without the pos x pos
        matrix; from hook_kernel itself when something already listens there (edits seen)."""
        raise TypeError(f"{type(self).__name__} has no kernel to slice (kernel rows are for state-space mixers)")


class AttentionCut:
    """`cut_edges` for attention: -inf on hook_attn_scores ("scores") or zeros on hook_pattern ("pattern").

    Needs `hook_attn_scores` and `hook_pattern` [batch heads q_pos k_pos]. With "scores" a query row
    whose every visible key is cut gets an all-zero pattern (the head writes nothing there)."""

    hook_attn_scores: HookPoint
    hook_pattern: HookPoint

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        state: dict[str, Tensor] = {}

        def edges(x: Tensor) -> Tensor:
            t, s = masks(x.shape[0], x.shape[-1], x.device)
            return t[:, :, None] & s[:, None, :]

        def on_scores(scores: Tensor, hook: Any) -> Tensor | None:
            cut = edges(scores)
            if not cut.any():  # nothing to cut: leave the tensor itself (bit-identical downstream)
                return None
            new, state["dead"] = attention_cut(scores, cut, "scores")
            return new

        def on_pattern(pattern: Tensor, hook: Any) -> Tensor | None:
            if attention == "pattern":
                cut = edges(pattern)
                return attention_cut(pattern, cut, "pattern")[0] if cut.any() else None
            dead = state.pop("dead", None)
            return pattern if dead is None or not dead.any() else pattern.masked_fill(dead[..., None], 0.0)

        hooks: CutHooks = [(self.hook_pattern, on_pattern)]
        if attention == "scores":
            hooks.insert(0, (self.hook_attn_scores, on_scores))
        return hooks


class StateSpaceMixer:
    """`cut_edges` and `decay_norms` for the selective-scan mixers (Mamba-1, Mamba-2).

    y_j -= sum_{i cut} K[j, i] u_i at hook_y on the cut units, with u, dt, B, C read from this very
    forward (hook_ssm_in, hook_dt, hook_B, hook_C) and the kernel entries from `kernel_pairs`; with
    cut_conv, hook_conv[j] -= weight[:, w-1-(j-i)] * hook_in[i] too (the conv channels of the cut
    units; channels every unit shares, Mamba-2's B and C, only when every unit is cut).
    A subclass gives `kernel_pairs`, `kernel_rows`, `kernel_cols` (hooked.ops's kernel functions of
    its family), `A()`, `conv_weight` [conv channels, width] and the hooks named above."""

    kernel_pairs: ClassVar[Callable[..., Tensor]]
    kernel_rows: ClassVar[Callable[..., Tensor]]
    kernel_cols: ClassVar[Callable[..., Tensor]]
    conv_weight: Tensor
    d_inner: int
    d_state: int
    hook_in: HookPoint
    hook_conv: HookPoint
    hook_ssm_in: HookPoint
    hook_dt: HookPoint
    hook_B: HookPoint
    hook_C: HookPoint
    hook_y: HookPoint
    hook_A_bar: HookPoint
    hook_B_bar: HookPoint
    hook_kernel: HookPoint

    def A(self) -> Tensor:
        raise NotImplementedError

    def decay_norms(self) -> Tensor:
        A = self.A().double()
        return torch.exp(A).sum(-1) if A.ndim == 2 else torch.exp(A) * self.d_state

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        pairs = type(self).kernel_pairs

        def keep(key: str) -> Callable[[Tensor, Any], None]:
            def fn(x: Tensor, hook: Any) -> None:
                seen[key] = x
            return fn

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            u, dt, B, C = (seen.pop(k) for k in ("u", "dt", "B", "C"))
            t, s = masks(y.shape[0], y.shape[1], y.device)
            if not (t.any() and s.any()) or (channels is not None and not channels.any()):
                return None  # nothing to cut: the tensor itself goes on
            return y - kernel_cut(pairs, u, dt, B, C, self.A(), t, s, channels)  # A read now: real when offloaded

        hooks: CutHooks = [(self.hook_ssm_in, keep("u")), (self.hook_dt, keep("dt")), (self.hook_B, keep("B")),
                           (self.hook_C, keep("C")), (self.hook_y, on_y)]
        if not cut_conv:
            return hooks
        conv_chan = conv_channels(channels, self.conv_weight.shape[0], self.d_inner)

        def on_conv(conv: Tensor, hook: Any) -> Tensor | None:
            t, s = masks(conv.shape[0], conv.shape[1], conv.device)
            conv_in = seen.pop("in")
            if not (t.any() and s.any()) or (conv_chan is not None and not conv_chan.any()):
                return None
            return conv - conv_cut(conv_in, self.conv_weight, t, s, conv_chan)  # read now: real when offloaded

        return [(self.hook_in, keep("in")), (self.hook_conv, on_conv)] + hooks

    def kernel_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if any(p.has_hooks for p in (self.hook_A_bar, self.hook_B_bar, self.hook_kernel)):

            def on_kernel(kernel: Tensor, hook: Any) -> None:  # the kernel others asked for, edits included
                idx = index(kernel.shape[-1], kernel.device)
                on_slice(kernel[:, :, idx] if axis == "rows" else kernel[..., idx])

            return [(self.hook_kernel, on_kernel)]
        seen: dict[str, Tensor] = {}
        fn = type(self).kernel_rows if axis == "rows" else type(self).kernel_cols

        def keep(key: str) -> Callable[[Tensor, Any], None]:
            def hook(x: Tensor, hook: Any) -> None:
                seen[key] = x
            return hook

        def on_C(C: Tensor, hook: Any) -> None:
            A = self.A()
            dt, B, C = (t.to(A.dtype) for t in (seen.pop("dt"), seen.pop("B"), C))
            on_slice(fn(dt, A, B, C, index(dt.shape[1], dt.device)))

        return [(self.hook_dt, keep("dt")), (self.hook_B, keep("B")), (self.hook_C, on_C)]


class ExpertMixture:
    """Base class of the mixtures of experts (moe.py): `n_experts`, `shared` (the always-on MLP or
    None) and the hooks hook_chosen, hook_routing_weights, hook_expert_out, hook_shared_out."""

    n_experts: int


def unit_tags(model: Any) -> dict[str, str]:
    """{mixer name: label letter} for every TokenMixer of the model, the one naming every analysis and
    the cache use ("L{layer}{tag}{h}"): "H" for a block's own heads (attention, or the SSM mixer of a
    block without attention), "M" for SSM units beside attention in the same block (Falcon-H1), "SH"
    for a shared attention invocation (Zamba2)."""
    tags = {}
    for layer, block in enumerate(model.blocks):
        mixers = token_mixers(block)
        beside_attention = any(m.unit_tag == "H" for _, m in mixers)
        for name, m in mixers:
            tags[f"blocks.{layer}.{name}"] = "H" if m.unit_tag == "M" and not beside_attention else m.unit_tag
    return tags


def token_mixers(module: torch.nn.Module) -> list[tuple[str, TokenMixer]]:
    """(relative name, mixer) of every TokenMixer inside `module` (a block), in registration order,
    which the blocks keep equal to forward order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, TokenMixer) and name]
