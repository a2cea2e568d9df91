"""The mixer protocol: what every sublayer that moves information between positions tells the analyses.

Analyses (knockout, head ablation, G&A, decay features, the head-unit names) read these methods;
they never look at module names, parameter names or tensor ranks.

Glossary
    TokenMixer   a sublayer mixing positions: attention (attention.py), the SSM mixers (mamba.py,
                 mamba2.py), the delta-rule mixers. A base class, so `isinstance(m, TokenMixer)` finds
                 them anywhere in a block (Zamba2's shared attention included).
    Heads        (`heads()`, a site.Site the model map places) the mixer's units and where each one's write
                 can be cut: n units of `width` features
                 at `write_hook` (attention: query heads at hook_z [.. n_heads d_head]; Mamba-2: SSM
                 heads at hook_gated [.. d_inner], d_head each; Mamba-1: channels, width 1). Zeroing a
                 unit there zeroes its columns of the output projection.
    unit_tag     the letter of its units in labels "L{layer}{tag}{h}" (model_map.py): "H" (attention heads), "M" (SSM
                 heads or channels), "SH" (Zamba2's shared attention, set by the family's build)
    edge         (target j <- source i) inside one layer; `cut_edges` returns the hooks that remove
                 exactly those edges in a forward (hooked/ops/edge_cut.py holds the arithmetic)
    masks        `masks(batch, pos, device, open_end=False) -> (target, source)`, bool [batch pos] each:
                 the edges' positions, resolved when the forward's length is known. While decoding
                 (`stepping_state()` is the forward's DecodeState) they are resolved over the whole
                 sequence read so far, past and new (pos = past + new), with open_end: positions not
                 read yet are left out; the cut then continues across steps (cut_record.py) so that it
                 removes exactly the edges of the whole-sequence forward, or refuses the step
    channels     a bool mask over the units (None: every unit) an SSM cut is restricted to;
                 attention always cuts every head
    unit writes  `write_reads()` the hooks each unit's write is computed from (a bare cache has them),
                 `unit_inputs(*reads)` the output projection's input split by unit (gated attention:
                 z * sigmoid(gate)), `unit_writes(*reads)` each unit's write [.. pos n d_out]; mixtures
                 of experts answer write_reads / unit_writes too (routing weight x expert output).
                 hooked/models/model_map.py asks these for every site of a model
    mixing       `mixing()`: the unit x target x source matrix (Mixing: its hook, value, output, whether
                 signed, the scores before a softmax); `matrix_slices` gives rows or columns of it

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

from hooked.models.cut_record import CutRecord, resume_cut
from hooked.models.decode_state import DecodeState, StateRefused, forward_notes, stepping_state
from hooked.models.site import Site
from hooked.ops.edge_cut import attention_cut, conv_channels, conv_cut, edge_pairs, kernel_cut

Masks = Callable[..., tuple[Tensor, Tensor]]  # (batch, pos, device, open_end=False) -> (target, source)
Index = Callable[[int, torch.device], Tensor]  # (pos, device) -> long positions
HookPoint = Any  # hooked.hook_points.HookPoint: not imported, the hook engine's cache reads this module
CutHooks = list[tuple[HookPoint, Callable[[Tensor, Any], Any]]]
SourceScan = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]  # (only_sources, h0) -> (y_cut, h_cut)
ATTENTION_MODES = ("scores", "pattern")


def slicer(index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> Callable[[Tensor, Any], None]:
    """A hook on a [batch units q_pos k_pos] matrix (a pattern, a kernel) calling on_slice with its rows
    matrix[:, :, idx] (axis "rows") or columns matrix[..., idx], idx = index(pos, device): the slices of
    what the hook holds, edits of earlier hooks included."""
    def on_matrix(matrix: Tensor, hook: Any) -> None:
        idx = index(matrix.shape[-1], matrix.device)
        on_slice(matrix[:, :, idx] if axis == "rows" else matrix[..., idx])
    return on_matrix


def keeper(seen: dict, key: Any) -> Callable[[Tensor, Any], None]:
    """A hook storing what it sees in seen[key], for a later hook of the same forward to read."""
    def keep(x: Tensor, hook: Any) -> None:
        seen[key] = x
    return keep


def along(mask: Tensor, x: Tensor) -> Tensor:
    """A bool [batch pos] mask as x's dtype, broadcastable against x [batch pos ...]."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 2)).to(x.dtype)


Heads = Site  # a mixer's `heads()`: its site's first fields (n, width, write_hook, kind, result_hook), unplaced


@dataclass(frozen=True)
class Mixing:
    """A mixer's positions mixed by one matrix per unit: output[j] = sum_i matrix[unit, j, i] value[i]
    (attention: hook_pattern, per query head from hook_v, into hook_z; the recurrent mixers: hook_kernel,
    their input u into y; DESIGN.md section 4). `signed`: the entries carry a sign and rows no fixed sum
    (a kernel), so a row's weights are its magnitudes normalised; a pattern is its own weights. `scores`:
    the matrix before a softmax (attention's hook_attn_scores), where a "scores" cut sets -inf.
    `renormalised`: the mixer's knockout gives the cut entries' weight back to the rest of their row (RWKV's
    WKV is a ratio: a cut source leaves its numerator and its denominator), so it equals zeroing them and
    rescaling the row to its sum, not zeroing alone."""

    matrix: HookPoint  # [batch n target source]
    value: HookPoint
    output: HookPoint
    signed: bool = True
    scores: HookPoint | None = None
    renormalised: bool = False

    def weights(self, x: Tensor) -> Tensor:
        """Row weights [.. target source] from the matrix's value (or some of its rows)."""
        if not self.signed:
            return x
        w = x.abs()
        return w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)

    def cut_at(self, mode: str = "scores") -> tuple[HookPoint, float | None]:
        """(hook, fill) where an entry is cut: -inf (None: the dtype's min) on the scores before the softmax
        (mode "scores", which renormalises), else 0 on the matrix itself."""
        if mode == "scores" and self.scores is not None:
            return self.scores, None
        return self.matrix, 0.0


class TokenMixer:
    """Base class of the sublayers that mix positions (see the module glossary)."""

    unit_tag: ClassVar[str] = "H"

    def heads(self) -> Heads:
        raise NotImplementedError

    def write_reads(self) -> tuple[HookPoint, ...]:
        """The hooks each unit's write is computed from, in `unit_inputs`' argument order; a bare
        run_with_cache() caches them (all linear in pos x width). The write hook alone unless the
        mixer changes its units' output after it (gated attention: hook_z and hook_gate)."""
        return (self.heads().write_hook,)

    def unit_inputs(self, *reads: Tensor) -> Tensor:
        """The output projection's input split by unit [.. pos n width] from the activations at
        `write_reads()`: what `head_writes` maps, linearly, to each unit's write."""
        return reads[0]

    def unit_writes(self, *reads: Tensor) -> Tensor:
        """Each unit's write [.. pos n d_out] (the output projection's bias left out) from the
        activations at `write_reads()`: what `heads().result_hook` shows when it is hooked."""
        return self.head_writes(self.unit_inputs(*reads))

    def head_writes(self, inputs: Tensor) -> Tensor:
        """[.. pos n width] -> [.. pos n d_out]: each unit's part of the output projection (linear)."""
        raise NotImplementedError

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        raise NotImplementedError

    def mixing(self) -> Mixing | None:
        """The unit x target x source matrix this mixer mixes positions with, or None when it has none."""
        return None

    def matrix_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        """Hooks that call on_slice with rows (or columns) idx = index(pos, device) of `mixing().matrix` in a
        forward: the kernel's without the pos x pos matrix (kernel_slices), the pattern's from the pattern."""
        return self.kernel_slices(index, on_slice, axis)

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
    hook_v: HookPoint
    hook_z: HookPoint

    def mixing(self) -> Mixing:
        return Mixing(self.hook_pattern, self.hook_v, self.hook_z, signed=False, scores=self.hook_attn_scores)

    def repeat_kv(self, t: Tensor) -> Tensor:
        """hook_v's values per query head [.. pos n_heads d_head]: as they are here (latent attention); GQA
        attention repeats each key-value head over its group (attention.py)."""
        return t

    def matrix_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        return [(self.hook_pattern, slicer(index, on_slice, axis))]

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        state: dict[str, Tensor] = {}
        spec = ("attn", attention)

        def edges(x: Tensor, hook: Any) -> Tensor:
            """[batch q k]: the cut entries of this forward's rows, the last q of the k positions read."""
            q_len, k_len = x.shape[-2], x.shape[-1]
            step = stepping_state()
            if step is None:
                t, s = masks(x.shape[0], k_len, x.device)
                return t[:, :, None] & s[:, None, :]
            if k_len != step.length + q_len:
                raise RuntimeError(f"{hook.name}: {k_len} keys for {q_len} new queries after {step.length} positions")
            t, s = masks(x.shape[0], k_len, x.device, open_end=True)
            parent = resume_cut(step, self, hook.name.rsplit(".", 1)[0], spec, t, s, needs_h=False)
            step.add_cut(self, CutRecord(spec, t, s, None, parent))
            return t[:, step.length:, None] & s[:, None, :]

        def on_scores(scores: Tensor, hook: Any) -> Tensor | None:
            cut = edges(scores, hook)
            if not cut.any():  # nothing to cut: leave the tensor itself (bit-identical downstream)
                return None
            new, state["dead"] = attention_cut(scores, cut, "scores")
            return new

        def on_pattern(pattern: Tensor, hook: Any) -> Tensor | None:
            if attention == "pattern":
                cut = edges(pattern, hook)
                return attention_cut(pattern, cut, "pattern")[0] if cut.any() else None
            dead = state.pop("dead", None)
            return pattern if dead is None or not dead.any() else pattern.masked_fill(dead[..., None], 0.0)

        hooks: CutHooks = [(self.hook_pattern, on_pattern)]
        if attention == "scores":
            hooks.insert(0, (self.hook_attn_scores, on_scores))
        return hooks


class RecurrentCut:
    """What the recurrent mixers' cuts share (SSM, delta rule, short conv): refusing two knockouts that
    cut one edge twice, the cut continued across decoding steps (h_cut), and the conv window over the
    past inputs the state keeps. A subclass gives `conv_weight` [conv channels, width] and hook_in,
    hook_conv (the conv's input and output)."""

    conv_weight: Tensor
    hook_in: HookPoint
    hook_conv: HookPoint

    def _check_overlap(self, name: str, t: Tensor, s: Tensor, channels: Tensor | None) -> None:
        """Refuse a second knockout of this forward cutting an edge (on a channel) another one already cut:
        each SSM cut subtracts its edges' terms, so an edge cut twice would be removed twice."""
        notes = forward_notes()
        if notes is None:
            return
        earlier = notes.setdefault(("ssm cuts", id(self)), [])
        for t0, s0, c0 in earlier:
            shared_channels = c0 is None or channels is None or bool((c0 & channels.to(c0.device)).any())
            reached = (s0 & s).long().cumsum(-1) > 0  # a source of both at or before each position
            if shared_channels and t0.shape == t.shape and bool((t0 & t & reached).any()):
                j = int((t0 & t & reached).nonzero()[0, 1])
                raise ValueError(
                    f"knockout: {name.rsplit('.', 1)[0]} is cut by two active knockouts that share edges (target {j} "
                    f"among them) on shared channels; an SSM cut subtracts each edge's term, so a shared edge would be "
                    "removed twice. Merge them into one knockout (bool masks [batch pos] give per-row sets), or give "
                    "them disjoint positions or channels")
        earlier.append((t, s, channels))

    def _cut_pairs(self, name: str, masks: Masks, y: Tensor, channels: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """The cut of a whole sequence (no decoding state) at hook `name` reading y [batch pos ...]: its edges as
        (row, j, i) pairs (edge_cut.edge_pairs) and the cut heads' indices (None: all), after the overlap check;
        None when nothing is cut (no edge, or no channel)."""
        t, s = masks(y.shape[0], y.shape[1], y.device)
        self._check_overlap(name, t, s, channels)
        row, j, i = edge_pairs(t, s)
        if not len(row) or (channels is not None and not channels.any()):
            return None
        return row, j, i, None if channels is None else channels.to(y.device).nonzero()[:, 0]

    def _cut_step(self, step: DecodeState, name: str, masks: Masks, spec: tuple, channels: Tensor | None,
                  y: Tensor, scan_sources: SourceScan) -> Tensor | None:
        """The cut while decoding at hook `name` reading y (the masks over past and new positions, after the
        overlap check): y_j -= (the part of y_j from cut sources) at new targets j; h_cut (cut_record.py), that
        part of the state, carried in the state from the step before and advanced over the new positions'
        sources by `scan_sources(only_sources, h0)`: the mixer's recurrence on this step's inputs with the
        non-source positions' writes zeroed (bool [batch new]), from h0, returning (y_cut, h_cut) (the
        recurrence is linear in its writes and its state)."""
        offset, where = step.length, name.rsplit(".", 1)[0]
        t, s = masks(y.shape[0], offset + y.shape[1], y.device, open_end=True)
        self._check_overlap(name, t, s, channels)
        parent = resume_cut(step, self, where, spec, t, s, needs_h=True)
        h0 = None if parent is None else parent.h_cut
        t_new, s_new = t[:, offset:], s[:, offset:]
        if h0 is None and not s_new.any():  # no cut source read yet: nothing to carry, nothing to cut
            step.add_cut(self, CutRecord(spec, t, s, None, parent))
            return None
        y_cut, h_cut = scan_sources(s_new, h0)
        step.add_cut(self, CutRecord(spec, t, s, h_cut, parent))
        if not t_new.any() or (channels is not None and not channels.any()):
            return None
        keep_at = along(t_new, y_cut)
        if channels is not None:
            keep_at = keep_at * channels.to(y.device).reshape((-1,) + (1,) * (y.ndim - 3)).to(y_cut.dtype)
        return y - (y_cut * keep_at).to(y.dtype)

    def _conv_hooks(self, masks: Masks, conv_chan: Tensor | None, spec: tuple | None = None) -> CutHooks:
        """Hooks removing the conv taps (j <- i) from hook_conv (the mixer's hook_in is the conv's input) on
        the channels conv_chan (None: all); while decoding, taps from the past inputs in the state's window
        too. spec: the conv is the mixer's only cut, so it keeps its own record across steps (cut_record.py);
        otherwise the mixer's state cut (whose spec says cut_conv) keeps it."""
        seen: dict[str, Tensor] = {}

        def on_conv(conv: Tensor, hook: Any) -> Tensor | None:
            conv_in = seen.pop("in")
            step = stepping_state()
            if step is None:
                t, s = masks(conv.shape[0], conv.shape[1], conv.device)
            else:  # the window's past inputs are in the state: cut from them too
                if spec is not None:
                    t, s = masks(conv.shape[0], step.length + conv.shape[1], conv.device, open_end=True)
                    parent = resume_cut(step, self, hook.name.rsplit(".", 1)[0], spec, t, s, needs_h=False)
                    step.add_cut(self, CutRecord(spec, t, s, None, parent))
                conv_in, t, s = self._conv_window(step, masks, conv_in)
            if not (t.any() and s.any()) or (conv_chan is not None and not conv_chan.any()):
                return None
            delta = conv_cut(conv_in, self.conv_weight, t, s, conv_chan)  # read now: real when offloaded
            return conv - delta[:, delta.shape[1] - conv.shape[1]:]

        return [(self.hook_in, keeper(seen, "in")), (self.hook_conv, on_conv)]

    def _conv_window(self, step: DecodeState, masks: Masks, conv_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(the conv input with the previous width - 1 inputs in front, target, source over those
        positions): positions before the sequence's start are zeros and neither target nor source."""
        lead = self.conv_weight.shape[1] - 1
        offset, (batch, pos) = step.length, conv_in.shape[:2]
        past = step.conv_past(self)
        if past is None:
            past = conv_in.new_zeros(batch, lead, conv_in.shape[2])
        t, s = masks(batch, offset + pos, conv_in.device, open_end=True)
        missing = max(0, lead - offset)  # window slots before position 0
        pad = t.new_zeros(batch, missing)
        t, s = (torch.cat([pad, m[:, offset + missing - lead:]], dim=1) for m in (t, s))
        return torch.cat([past, conv_in], dim=1), t, s


class StateSpaceMixer(RecurrentCut):
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

    def mixing(self) -> Mixing:
        return Mixing(self.hook_kernel, self.hook_ssm_in, self.hook_y)

    def decay_norms(self) -> Tensor:
        A = self.A().double()
        return torch.exp(A).sum(-1) if A.ndim == 2 else torch.exp(A) * self.d_state

    def state_scan(self, u: Tensor, dt: Tensor, B: Tensor, C: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor]:
        """(y, h_last) of this mixer's recurrence on (u, dt, B, C) from h0 (None: zero), in the scan's dtype."""
        raise NotImplementedError

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        pairs = type(self).kernel_pairs
        spec = ("ssm", None if channels is None else tuple(channels.tolist()), cut_conv)

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            u, dt, B, C = (seen.pop(k) for k in ("u", "dt", "B", "C"))
            step = stepping_state()
            if step is not None:
                return self._cut_step(step, hook.name, masks, spec, channels, y,
                                      lambda only, h0: self.state_scan(u * along(only, u), dt, B, C, h0))
            t, s = masks(y.shape[0], y.shape[1], y.device)
            self._check_overlap(hook.name, t, s, channels)
            if not (t.any() and s.any()) or (channels is not None and not channels.any()):
                return None  # nothing to cut: the tensor itself goes on
            return y - kernel_cut(pairs, u, dt, B, C, self.A(), t, s, channels)  # A read now: real when offloaded

        on_y.needs_exact = True  # hooked.backends.exact_hook: y from the exact path (no fused kernel)

        hooks: CutHooks = [(self.hook_ssm_in, keeper(seen, "u")), (self.hook_dt, keeper(seen, "dt")),
                           (self.hook_B, keeper(seen, "B")), (self.hook_C, keeper(seen, "C")), (self.hook_y, on_y)]
        if not cut_conv:
            return hooks
        return self._conv_hooks(masks, conv_channels(channels, self.conv_weight.shape[0], self.d_inner)) + hooks

    def kernel_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if any(p.has_hooks for p in (self.hook_A_bar, self.hook_B_bar, self.hook_kernel)):
            return [(self.hook_kernel, slicer(index, on_slice, axis))]  # the kernel others asked for, edits included
        seen: dict[str, Tensor] = {}
        fn = type(self).kernel_rows if axis == "rows" else type(self).kernel_cols

        def on_C(C: Tensor, hook: Any) -> None:
            if stepping_state() is not None:
                raise StateRefused(f"{hook.name.rsplit('.', 1)[0]}: kernel slices describe the whole sequence from a "
                                   "zero state and cannot be taken while decoding with a state; run the whole "
                                   "sequence (generate with use_past_kv_cache=False)")
            A = self.A()
            dt, B, C = (t.to(A.dtype) for t in (seen.pop("dt"), seen.pop("B"), C))
            on_slice(fn(dt, A, B, C, index(dt.shape[1], dt.device)))

        return [(self.hook_dt, keeper(seen, "dt")), (self.hook_B, keeper(seen, "B")), (self.hook_C, on_C)]


class ExpertMixture:
    """Base class of the mixtures of experts (moe.py): `n_experts`, `shared` (the always-on MLP or
    None) and the hooks hook_chosen, hook_routing_weights, hook_expert_out, hook_shared_out."""

    n_experts: int
    hook_chosen: HookPoint
    hook_routing_weights: HookPoint
    hook_expert_out: HookPoint

    def write_reads(self) -> tuple[HookPoint, ...]:
        """The hooks each expert's write is computed from (`unit_writes`' arguments, in order)."""
        return (self.hook_chosen, self.hook_routing_weights, self.hook_expert_out)

    def unit_writes(self, chosen: Tensor, weights: Tensor, expert_out: Tensor) -> Tensor:
        """Each expert's write [.. pos n_experts d_model]: its routing weight times its output, summed over
        the slots that chose it (the shared MLP left out)."""
        onehot = torch.nn.functional.one_hot(chosen, self.n_experts).to(expert_out.dtype)  # [.. pos k E]
        return torch.einsum("...ke,...k,...kd->...ed", onehot, weights.to(expert_out.dtype), expert_out)


def token_mixers(module: torch.nn.Module) -> list[tuple[str, TokenMixer]]:
    """(relative name, mixer) of every TokenMixer inside `module` (a block), in registration order,
    which the blocks keep equal to forward order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, TokenMixer) and name]
