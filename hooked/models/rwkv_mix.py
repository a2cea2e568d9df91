"""RWKV-4's two sublayers: time mixing (the WKV recurrence, a mixer on the protocol) and channel mixing.

Glossary (shape word in annotations; HF RwkvSelfAttention / RwkvFeedForward names in brackets; paper symbols)
    att_width   c, the time mixing's channels [attention_hidden_size]; each one unit with its own recurrence
    num_den     the state's two entries per channel: a (numerator) and b (denominator), hook_h [.. att_width 2]
    shift       x_{t-1}, the token shift [time_shift]: the sublayer's input one position back, 0 before the first
                token (while decoding: the last input of the step before, kept in the state's conv window)
    mix         x * mu + shift * (1 - mu) per feature [time_mix_key / _value / _receptance]
    k, v, r     key(mix_k), value(mix_v), sigmoid(receptance(mix_r))                 hook_k, hook_v, hook_r
    w, u        -exp(time_decay), time_first: the decay and the current token's bonus (ops/rwkv.py)
    h           (a_t, b_t) after reading position t, in true scale:                  hook_h [.. att_width num_den]
                a_t = e^w a_{t-1} + e^{k_t} v_t,  b_t = e^w b_{t-1} + e^{k_t}
    y           wkv_t = (a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t})            hook_y
    kernel      K[c, t, i] = e^{s[t,i]} / (b_{t-1} + e^{u+k_t}): y = K . v, each row sums to 1 (ops/rwkv.py)
    gated       r * y, the output projection's input [output]                         hook_gated
Channel mixing (kind "mlp"): out = sigmoid(receptance(mix_r)) * down_proj(relu(up_proj(mix_k))^2) (HF's key and
value are up_proj and down_proj), hooks hook_shift, hook_pre [.. d_mlp] (up_proj(mix_k)), hook_post (relu(pre)^2),
hook_receptance [.. d_model] (after the sigmoid; the `output_gate` of each neuron's write).

Numerics: the forward runs HF's max-tracking scan (no e^k is formed); hook_h shows the states in true scale
(e^88 overflows float32: keys that large give inf there, use float64). A state returned by a hook of hook_h
is SET (hooked/state_edit.py) and the recurrence continues from it (set_scan with the decay e^w on a and b);
y after it is read from the states as set. An edited kernel adds (K' - K) v to y (linear, no renormalising).

Knockout of an edge (t <- i) removes the term e^{s[t,i]} from y_t's numerator AND denominator: zeroing those
kernel entries and renormalising the row over what is left (attention's "scores" cut; a row with every term
cut gives 0). It runs the recurrence with the cut sources' keys at -inf (they write nothing) and takes y
from it at the targets: exact and stable, no kernel entry built. Two knockouts sharing a target on shared
channels are refused (one renormalisation per row). cut_conv also removes the token shift (t <- t-1) from
targets whose previous position is a source (the shift feeds every channel, so only when every channel is
cut). The channel mixing's own shift is not a cut edge (it is the block's MLP). While decoding, each cut
carries the state of its kept recurrence (the one without its sources) in its record's h_cut (None: no
source read yet, the kept state is the state itself). Padding: the inputs are zeroed and padded keys are
-inf, so a left-padded row equals the prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.cut_record import CutRecord, resume_cut
from hooked.models.decode_state import StateRefused, forward_notes, stepping_state
from hooked.models.head_writes import written_by_units
from hooked.models.protocol import CutHooks, Heads, Index, Masks, Mixing, RecurrentCut, TokenMixer, slicer
from hooked.ops.rwkv import scaled_state, true_states, wkv_kernel_slice, wkv_read, wkv_scan
from hooked.ops.set_scan import set_scan
from hooked.state_edit import through_state_hook
from hooked.weights import MLPWeights

FOLD_LN = ("fold_ln: RWKV's token shift mixes the norm's output at two positions and reads 0 (not the norm's bias) "
           "before the first token, so the norm cannot move into the linear maps exactly")


def _masked(x: Tensor, ctx: Context) -> Tensor:
    return x if ctx.attention_mask is None else x * ctx.attention_mask[..., None].to(x.dtype)


def _shift(module: nn.Module, x: Tensor, ctx: Context) -> Tensor:
    """x one position back: 0 before the first token, the previous step's last input while decoding."""
    if ctx.state is None:
        return F.pad(x, (0, 0, 1, 0))[:, :-1]
    return ctx.state.conv_window(module, x, 2)[:, :-1]


def _mix(x: Tensor, shift: Tensor, mu: Tensor) -> Tensor:
    return x * mu + shift * (1 - mu)


class TimeMix(RecurrentCut, TokenMixer, nn.Module):
    """RWKV-4 time mixing: token shift -> k, v, r -> WKV -> output(r * wkv). Units: the att_width channels."""

    unit_tag = "M"

    def __init__(self, d_model: int, att_width: int) -> None:
        super().__init__()
        self.time_decay = nn.Parameter(torch.zeros(att_width))  # w = -exp(time_decay)
        self.time_first = nn.Parameter(torch.zeros(att_width))  # u
        self.time_mix_key = nn.Parameter(torch.full((1, 1, d_model), 0.5))
        self.time_mix_value = nn.Parameter(torch.full((1, 1, d_model), 0.5))
        self.time_mix_receptance = nn.Parameter(torch.full((1, 1, d_model), 0.5))
        self.key = nn.Linear(d_model, att_width, bias=False)
        self.value = nn.Linear(d_model, att_width, bias=False)
        self.receptance = nn.Linear(d_model, att_width, bias=False)
        self.output = nn.Linear(att_width, d_model, bias=False)
        self.n_heads, self.d_head = att_width, 1  # a channel is a unit
        self.dims = {"att_width": att_width, "num_den": 2}

        self.hook_shift = HookPoint("batch pos d_model")  # x_{t-1}
        self.hook_k = HookPoint("batch pos att_width")
        self.hook_v = HookPoint("batch pos att_width")  # the kernel's value
        self.hook_r = HookPoint("batch pos att_width")  # sigmoid(receptance)
        self.hook_h = HookPoint("batch pos att_width num_den", element="wide")  # (a, b), true scale
        self.hook_kernel = HookPoint("batch att_width q_pos k_pos", lazy=True, element="wide")  # lazy
        self.hook_y = HookPoint("batch pos att_width", element="wide")  # wkv
        self.hook_gated = HookPoint("batch pos att_width")  # r * wkv, output's input
        self.hook_head_out = HookPoint("batch pos att_width d_model", lazy=True)  # lazy

    # ------------------------------------------------------------------------------------ protocol
    def input_linears(self) -> list[nn.Module]:
        raise ValueError(FOLD_LN)

    def output_bias(self) -> Tensor | None:
        return None

    def heads(self) -> Heads:
        return Heads(self.n_heads, 1, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """y_t = sum_i K[c, t, i] v_i: the kernel mixes hook_v into hook_y; a cut renormalises its rows."""
        return Mixing(self.hook_kernel, self.hook_v, self.hook_y, renormalised=True)

    def A(self) -> Float[Tensor, "att_width"]:
        """w = -exp(time_decay), at least float32: a and b decay by e^w per position."""
        return -torch.exp(self.time_decay.to(torch.promote_types(self.time_decay.dtype, torch.float32)))

    def decay_norms(self) -> Float[Tensor, "att_width"]:
        """The decay per channel, e^w."""
        return torch.exp(self.A().double())

    def head_writes(self, gated: Float[Tensor, "*batch pos att_width"]) -> Float[Tensor, "*batch pos att_width d_model"]:
        return gated[..., None] * self.output.weight.T

    def _seen(self) -> tuple[Any, ...]:
        """(w, u, k with -inf at padding, v, h0, log_den) of the forward running now (left by `_wkv`)."""
        return forward_notes()[("rwkv", id(self))]

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        spec = ("rwkv", None if channels is None else tuple(channels.tolist()), cut_conv)

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            w, u, k, v, h0, _ = self._seen()
            where, step = hook.name.rsplit(".", 1)[0], stepping_state()
            if step is None:
                offset, parent = 0, None
                t, s = masks(y.shape[0], y.shape[1], y.device)
            else:
                offset = step.length
                t, s = masks(y.shape[0], offset + y.shape[1], y.device, open_end=True)
            self._check_targets(where, t, s, channels)
            h_keep = h0
            if step is not None:
                parent = resume_cut(step, self, where, spec, t, s, needs_h=True)
                if parent is not None and parent.h_cut is not None:
                    h_keep = parent.h_cut
                elif not s[:, offset:].any():  # no source read yet: the kept recurrence is the recurrence
                    step.add_cut(self, CutRecord(spec, t, s, None, parent))
                    return None
            elif not (t.any() and s.any()):
                return None  # nothing to cut: the tensor itself goes on
            t_new, s_new = t[:, offset:], s[:, offset:]
            y_keep, states, _ = wkv_scan(w, u, k.masked_fill(s_new[..., None], float("-inf")), v, h_keep)
            if step is not None:
                step.add_cut(self, CutRecord(spec, t, s, states[:, -1], parent))
            pick = t_new[..., None] if channels is None else t_new[..., None] & channels.to(y.device)
            return torch.where(pick, y_keep.to(y.dtype), y)

        hooks: CutHooks = [(self.hook_y, on_y)]
        if cut_conv and (channels is None or bool(channels.all())):
            hooks.insert(0, (self.hook_shift, self._shift_cut(masks)))
        return hooks

    def _shift_cut(self, masks: Masks) -> Callable[[Tensor, Any], Tensor | None]:
        def on_shift(shift: Tensor, hook: Any) -> Tensor | None:
            step = stepping_state()
            offset = 0 if step is None else step.length
            t, s = masks(shift.shape[0], offset + shift.shape[1], shift.device,
                         **({} if step is None else {"open_end": True}))
            cut = (t & F.pad(s, (1, 0))[:, :-1])[:, offset:]  # target j whose j - 1 is a source
            return shift.masked_fill(cut[..., None], 0.0) if cut.any() else None
        return on_shift

    def _check_targets(self, where: str, t: Tensor, s: Tensor, channels: Tensor | None) -> None:
        """Refuse a second knockout of this forward with a target (on a shared channel) another one cuts: each
        takes y there from its own kept recurrence, so the second would undo the first's renormalisation."""
        notes = forward_notes()
        earlier = notes.setdefault(("rwkv cuts", id(self)), [])
        for t0, c0 in earlier:
            shared = c0 is None or channels is None or bool((c0 & channels.to(c0.device)).any())
            if shared and t0.shape == t.shape and bool((t0 & t).any()):
                j = int((t0 & t).nonzero()[0, 1])
                raise ValueError(
                    f"knockout: {where} is cut by two active knockouts that share a target ({j} among them) on shared "
                    "channels; an RWKV cut renormalises each target's row over the sources it keeps, so the two would "
                    "not compose. Merge them into one knockout (bool masks [batch pos] give per-row sets), or give "
                    "them disjoint targets or channels")
        earlier.append((t, channels))

    def kernel_slices(self, index: Index, on_slice: Callable[[Tensor], None], axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice with rows or columns of this forward's kernel from its keys and log_den,
        without the pos x pos matrix; from hook_kernel itself when something already listens there."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, slicer(index, on_slice, axis))]

        def on_y(y: Tensor, hook: Any) -> None:
            if stepping_state() is not None:
                raise StateRefused(f"{hook.name.rsplit('.', 1)[0]}: kernel slices describe the whole sequence from a "
                                   "zero state and cannot be taken while decoding with a state; run the whole "
                                   "sequence (generate with use_past_kv_cache=False)")
            w, u, k, _, _, log_den = self._seen()
            idx = index(k.shape[1], k.device)
            on_slice(wkv_kernel_slice(w, u, k, log_den, **{axis: idx}))

        return [(self.hook_y, on_y)]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        x = _masked(x, ctx)
        shift = self.hook_shift(_shift(self, x, ctx))
        k = self.hook_k(self.key(_mix(x, shift, self.time_mix_key)))
        v = self.hook_v(self.value(_mix(x, shift, self.time_mix_value)))
        r = self.hook_r(torch.sigmoid(self.receptance(_mix(x, shift, self.time_mix_receptance))))
        y = self.hook_y(self._wkv(k, v, ctx))
        gated = self.hook_gated(r * y.to(x.dtype))
        return written_by_units(self.output, gated, self.hook_head_out, self.head_writes)

    def _wkv(self, k: Float[Tensor, "batch pos att_width"], v: Float[Tensor, "batch pos att_width"],
             ctx: Context) -> Float[Tensor, "batch pos att_width"]:
        """wkv from the state the previous positions left (none: empty), through hook_h and hook_kernel."""
        w = self.A()
        dtype = w.dtype if k.dtype != torch.float64 else torch.float64
        w, u, v = w.to(dtype), self.time_first.to(dtype), v.to(dtype)
        k = k.to(dtype) if ctx.attention_mask is None else k.to(dtype).masked_fill(~ctx.attention_mask[..., None],
                                                                                float("-inf"))
        h0 = None if ctx.state is None else ctx.state.ssm_state(self)  # scaled (a', b', m)
        y, scaled, log_den = wkv_scan(w, u, k, v, h0)
        notes = forward_notes() if self.hook_y.is_active else None  # (a plain forward reads no context: compiles)
        if notes is not None:  # for this forward's knockout and kernel slices, both hooks on hook_y
            notes[("rwkv", id(self))] = (w, u, k, v, h0, log_den)
        last = scaled[:, -1]
        if self.hook_h.is_active:
            decay = torch.exp(w).expand(k.shape)[..., None]
            edit = through_state_hook(self.hook_h, true_states(scaled),
                                      lambda: true_states(wkv_scan(w, u, k, v, h0)[1]),
                                      lambda e, fixed: set_scan(decay, e, fixed))
            if edit.clean is not None:  # y from the states as set and continued
                start = k.new_zeros(k.shape[0], 1, k.shape[2], 2) if h0 is None else true_states(h0)[:, None]
                prev = torch.cat([start, edit.h[:, :-1]], dim=1)
                y = edit.read_into(y, lambda h, at: wkv_read(u, k[:, at], v[:, at], prev[:, at]))
                last = scaled_state(edit.h[:, -1])
        if ctx.state is not None:
            ctx.state.refuse_lazy(self, [self.hook_kernel])
            ctx.state.set_ssm_state(self, last)
        if self.hook_kernel.is_active:
            build = lambda: wkv_kernel_slice(w, u, k, log_den)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, build(), build)
            if kernel_was is not None:  # y_t += sum_i (K' - K)[t, i] v_i
                y = y + einsum(kernel - kernel_was, v, "b c t i, b i c -> b t c")
        return y

    def extra_repr(self) -> str:
        return f"att_width={self.n_heads}"


class ChannelMix(MLPWeights, nn.Module):
    """RWKV-4 channel mixing: token shift -> sigmoid(receptance(mix_r)) * down_proj(relu(up_proj(mix_k))^2) (HF's
    key is up_proj, its value down_proj: TransformerLens's W_in and W_out)."""

    def __init__(self, d_model: int, d_mlp: int) -> None:
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.full((1, 1, d_model), 0.5))
        self.time_mix_receptance = nn.Parameter(torch.full((1, 1, d_model), 0.5))
        self.up_proj = nn.Linear(d_model, d_mlp, bias=False)  # HF key
        self.receptance = nn.Linear(d_model, d_model, bias=False)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=False)  # HF value
        self.dims = {"d_mlp": d_mlp}
        self.hook_shift = HookPoint("batch pos d_model")  # x_{t-1}
        self.hook_pre = HookPoint("batch pos d_mlp")  # key(mix_k)
        self.hook_post = HookPoint("batch pos d_mlp")  # relu(pre)^2
        self.hook_receptance = HookPoint("batch pos d_model")  # sigmoid(receptance(mix_r))

    def input_linears(self) -> list[nn.Module]:
        raise ValueError(FOLD_LN)

    def output_bias(self) -> Tensor | None:
        return None

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        x = _masked(x, ctx)
        shift = self.hook_shift(_shift(self, x, ctx))
        pre = self.hook_pre(self.up_proj(_mix(x, shift, self.time_mix_key)))
        post = self.hook_post(torch.square(torch.relu(pre)))
        receptance = self.hook_receptance(torch.sigmoid(self.receptance(_mix(x, shift, self.time_mix_receptance))))
        return receptance * self.down_proj(post)

    @property
    def output_gate(self) -> HookPoint:
        """The hook whose activation multiplies the output feature by feature (each neuron's write: post_n *
        W_out[n] * receptance; hooked/cache_resid.py)."""
        return self.hook_receptance
