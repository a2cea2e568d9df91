"""xLSTM's mLSTM layer: a matrix memory per head with exponential input gates, every state hookable.

Glossary (shape word, einops letter, symbol; hooked/ops/mlstm.py has the recurrence and its stabiliser)
    batch      b
    pos        l     t    position; kernel rows q_pos = target j, columns k_pos = source i
    d_model    m          residual width
    n_heads    h          heads: each has its own memory, normaliser and gates (the mixer's units)
    d_qk       c          a head's query / key width: the memory's rows
    d_v        v          a head's value width: the memory's columns
    qk_dim, v_dim         n_heads * d_qk, n_heads * d_v (HF's qk_dim, v_dim)
    h                     the memory C_t [d_qk d_v] per head (hook_h), never called x; n_t its normaliser

Mixer (HF xLSTMLayer, weight_mode "single"; cap = gate_soft_cap, softcap(z) = cap tanh(z / cap)):
    q, k, v = q_proj(x), k_proj(x), v_proj(x) per head        q read times d_qk^-1/2
    i_t = softcap(igate_proj(x)),  log f_t = log sigmoid(softcap(fgate_proj(x)))   one per head
    C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T,  n_t = f_t n_{t-1} + exp(i_t) k_t
    y_t = C_t^T q_t / N_t,  N_t = max(|n_t . q_t|, 1) + eps exp(m_t)     (m_t: ops/mlstm.py)
    out = out_proj(sigmoid(ogate_proj(x)) * head_norm(y))   head_norm: a LayerNorm per head over d_v
The recurrence runs in float32 (float64 for a float64 model) in HF's chunkwise form, stabilised as HF's.
While decoding the state (DecodeState's h) is HF's stabilised (C~, n~, m) packed per head [d_qk d_v+2]
(ops.mlstm.pack_state), so a transplant of a head's state moves its memory, normaliser and stabiliser together.

Hooks under blocks.{l}.mixer., in forward order:
    hook_q, hook_k [b l h d_qk] (before the d_qk^-1/2), hook_v [b l h d_v], hook_gate [b l v_dim]
    (ogate_proj(x), before the sigmoid), hook_i [b l h] (the log input gate i_t; -inf at padding: a padded
    position writes nothing), hook_log_f [b l h] (log f_t; 0 at padding: nothing forgotten),
    hook_h [b l h d_qk d_v] (lazy: C_t), hook_n [b l h d_qk] (lazy: n_t), hook_denom [b l h] (N_t),
    hook_kernel [b h q_pos k_pos] (lazy), hook_y [b l h d_v], hook_gated [b l v_dim] (out_proj's input),
    hook_head_out [b l h d_model] (lazy).
hook_h and hook_n hold the memories without HF's stabiliser (C_t, n_t, not exp(-m_t) C_t): a state patched
from another prompt carries that prompt's memory at its own scale. While the gates are soft-capped (every
released config) they stay within float32's range.

Kernel: y_j = sum_i K[h, j, i] v_i from a zero state, K[j, i] = exp(F_j - F_i + i_i) (q_j . k_i) / N_j
(F_t = sum_{r <= t} log f_r): the kernel is normalised, N_j taken as the forward computed it. An edge
(j <- i) is the term K[j, i] v_i; knockout removes it from hook_y with N_j HELD (not recomputed without the
cut term), so a knockout equals zeroing the kernel's entries; q, k, v, the gates and N are read from the
same forward (ops.mlstm_knockout: no pos x pos tensor). While decoding the cut sources' part of C rides
along (cut_record.py). No conv: cut_conv has nothing more to cut. decay_norms: d_qk * sigmoid(softcap(b_f)),
the forget gate at a zero input (fgate_proj's bias) summed over the memory's rows.

Edits propagate: q, k, v and the gates are what the recurrence reads; a state returned by a hook of hook_h
(hook_n) is SET there and the recurrence continues from it (hooked/state_edit.py; the decay f_t is one
scalar per head, so ops/set_scan.py carries it), y read as C^T q / N from the states as set (N from n as
set); an edited N rescales y_t by N_t / N'_t; an edited kernel adds (K' - K) v to y; an edited head_out
is summed into the output. With no lazy hook active the forward is the chunkwise form alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook
from hooked.models.base import Context
from hooked.models.decode_state import StateRefused, stepping_state
from hooked.models.head_writes import written_by_units
from hooked.models.protocol import CutHooks, Heads, Masks, Mixing, RecurrentCut, TokenMixer, along, keeper, slicer
from hooked.ops.mlstm import (mlstm_chunked, mlstm_decays, mlstm_kernel, mlstm_kernel_cols, mlstm_kernel_rows,
                              mlstm_knockout, mlstm_states, pack_state, unpack_state)
from hooked.ops.set_scan import set_scan
from hooked.state_edit import through_state_hook
from hooked.weights import MixerWeights


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap) (None: x as it is), HF's gate and logit soft cap."""
    return x if cap is None else cap * torch.tanh(x / cap)


@dataclass(frozen=True)
class MLSTMSpec:
    d_model: int
    n_heads: int
    d_qk: int  # per head
    d_v: int  # per head
    gate_soft_cap: float | None = 15.0
    eps: float = 1e-6  # in N (HF's eps)
    norm_eps: float = 1e-6  # the head norm's
    chunk_size: int = 64  # positions per chunk of the chunkwise form

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    @property
    def qk_dim(self) -> int:
        return self.n_heads * self.d_qk

    @property
    def v_dim(self) -> int:
        return self.n_heads * self.d_v


class MLSTMMixer(RecurrentCut, TokenMixer, MixerWeights, nn.Module):
    """The mLSTM layer of an `MLSTMSpec` (module docstring). Its units are the heads."""

    unit_tag = "M"

    def __init__(self, spec: MLSTMSpec) -> None:
        super().__init__()
        self.spec = spec
        self.n_heads, self.d_head = spec.n_heads, spec.d_v  # d_head: a unit's width at hook_gated
        self.q_proj = nn.Linear(spec.d_model, spec.qk_dim, bias=False)
        self.k_proj = nn.Linear(spec.d_model, spec.qk_dim, bias=False)
        self.v_proj = nn.Linear(spec.d_model, spec.v_dim, bias=False)
        self.ogate_proj = nn.Linear(spec.d_model, spec.v_dim, bias=False)
        self.igate_proj = nn.Linear(spec.d_model, spec.n_heads)
        self.fgate_proj = nn.Linear(spec.d_model, spec.n_heads)
        self.norm_weight = nn.Parameter(torch.ones(spec.v_dim))  # the head norm's gain (HF multihead_norm)
        self.out_proj = nn.Linear(spec.v_dim, spec.d_model, bias=False)
        self.dims = {"n_heads": spec.n_heads, "d_qk": spec.d_qk, "d_v": spec.d_v, "v_dim": spec.v_dim}

        self.hook_q = HookPoint("batch pos n_heads d_qk", element="wide")
        self.hook_k = HookPoint("batch pos n_heads d_qk", element="wide")
        self.hook_v = HookPoint("batch pos n_heads d_v", element="wide")
        self.hook_gate = HookPoint("batch pos v_dim")  # ogate_proj(x), before the sigmoid
        self.hook_i = HookPoint("batch pos n_heads", element="wide")  # log input gate, -inf at padding
        self.hook_log_f = HookPoint("batch pos n_heads", element="wide")  # log forget gate, 0 at padding
        self.hook_h = HookPoint("batch pos n_heads d_qk d_v", lazy=True, element="wide")  # C_t, lazy
        self.hook_n = HookPoint("batch pos n_heads d_qk", lazy=True, element="wide")  # n_t, lazy
        self.hook_denom = HookPoint("batch pos n_heads", element="wide")  # N_t
        self.hook_kernel = HookPoint("batch n_heads q_pos k_pos", lazy=True, element="wide")  # K, lazy
        self.hook_y = HookPoint("batch pos n_heads d_v", element="wide")  # C_t^T q_t / N_t
        self.hook_gated = HookPoint("batch pos v_dim")  # sigmoid(gate) * head_norm(y): out_proj's input
        self.hook_head_out = HookPoint("batch pos n_heads d_model", lazy=True)  # each head's write, lazy

    # ------------------------------------------------------------------------------------ protocol
    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj, self.ogate_proj, self.igate_proj, self.fgate_proj]

    def output_bias(self) -> Tensor | None:
        return None

    def heads(self) -> Heads:
        """The heads (d_v channels each), cut at hook_gated (before out_proj; the head norm is per head)."""
        return Heads(self.n_heads, self.spec.d_v, self.hook_gated, "ssm", self.hook_head_out)

    def mixing(self) -> Mixing:
        """y_j = sum_i K[h, j, i] v_i from a zero state: the kernel mixes hook_v into hook_y."""
        return Mixing(self.hook_kernel, self.hook_v, self.hook_y)

    def A(self) -> Float[Tensor, "n_heads"]:
        """The log forget gate at a zero input, log sigmoid(softcap(fgate_proj's bias)), at least float32."""
        b = self.fgate_proj.bias.to(torch.promote_types(self.fgate_proj.bias.dtype, torch.float32))
        return F.logsigmoid(soft_cap(b, self.spec.gate_soft_cap))

    def decay_norms(self) -> Float[Tensor, "n_heads"]:
        return torch.exp(self.A().double()) * self.spec.d_qk

    def cut_edges(self, masks: Masks, channels: Tensor | None = None, *, attention: str = "scores",
                  cut_conv: bool = False) -> CutHooks:
        seen: dict[str, Tensor] = {}
        spec = ("ssm", None if channels is None else tuple(channels.tolist()), cut_conv)

        def on_y(y: Tensor, hook: Any) -> Tensor | None:
            q, k, v, log_i, log_f, denom = (seen.pop(n) for n in ("q", "k", "v", "i", "f", "denom"))
            q = q * self.spec.d_qk**-0.5
            step = stepping_state()
            if step is not None:  # C is linear in (v, C0): the cut sources' part runs on from h_cut, N held

                def scan_sources(only: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor]:
                    start = (q.new_zeros(*k.shape[:1], *k.shape[2:], v.shape[-1]) if h0 is None else h0,
                             q.new_zeros(k.shape[0], *k.shape[2:]), q.new_zeros(k.shape[0], k.shape[2]))
                    p = mlstm_chunked(q, k, v * along(only, v), log_i, log_f, start, self.spec.chunk_size)
                    C, _, m = p.state  # stabilised from m0 = 0: C_cut = exp(m) C~
                    return p.num * torch.exp(p.m - torch.log(denom))[..., None], C * torch.exp(m)[..., None, None]
                return self._cut_step(step, hook.name, masks, spec, channels, y, scan_sources)
            pairs = self._cut_pairs(hook.name, masks, y, channels)
            if pairs is None:
                return None  # nothing to cut: the tensor itself goes on
            row, j, i, heads = pairs
            return y - mlstm_knockout(q, k, v, log_i, log_f, denom, row, j, i, heads).to(y.dtype)

        return [(self.hook_q, keeper(seen, "q")), (self.hook_k, keeper(seen, "k")), (self.hook_v, keeper(seen, "v")),
                (self.hook_i, keeper(seen, "i")), (self.hook_log_f, keeper(seen, "f")),
                (self.hook_denom, keeper(seen, "denom")), (self.hook_y, on_y)]

    def kernel_slices(self, index: Callable[[int, torch.device], Tensor], on_slice: Callable[[Tensor], None],
                      axis: str = "rows") -> CutHooks:
        """Hooks calling on_slice(K[:, :, rows, :]) or on_slice(K[..., cols]) of this forward (q, k, the gates and
        N as read), without the pos x pos kernel; from hook_kernel itself when something already listens there."""
        if axis not in ("rows", "cols"):
            raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
        if self.hook_kernel.has_hooks:
            return [(self.hook_kernel, slicer(index, on_slice, axis))]
        seen: dict[str, Tensor] = {}
        fn = mlstm_kernel_rows if axis == "rows" else mlstm_kernel_cols

        def on_denom(denom: Tensor, hook: Any) -> None:
            if stepping_state() is not None:
                raise StateRefused(f"{hook.name.rsplit('.', 1)[0]}: kernel slices describe the whole sequence from a "
                                   "zero state and cannot be taken while decoding with a state; run the whole "
                                   "sequence (generate with use_past_kv_cache=False)")
            q, k, log_i, log_f = (seen.pop(n) for n in ("q", "k", "i", "f"))
            on_slice(fn(q * self.spec.d_qk**-0.5, k, log_i, log_f, denom, index(denom.shape[1], denom.device)))

        return [(self.hook_q, keeper(seen, "q")), (self.hook_k, keeper(seen, "k")), (self.hook_i, keeper(seen, "i")),
                (self.hook_log_f, keeper(seen, "f")), (self.hook_denom, on_denom)]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        spec, rule_dtype = self.spec, torch.promote_types(x.dtype, torch.float32)
        q = self.hook_q(rearrange(self.q_proj(x).to(rule_dtype), "b l (h c) -> b l h c", h=spec.n_heads))
        k = self.hook_k(rearrange(self.k_proj(x).to(rule_dtype), "b l (h c) -> b l h c", h=spec.n_heads))
        v = self.hook_v(rearrange(self.v_proj(x).to(rule_dtype), "b l (h v) -> b l h v", h=spec.n_heads))
        gate = self.hook_gate(self.ogate_proj(x))
        log_i = soft_cap(self.igate_proj(x), spec.gate_soft_cap).to(rule_dtype)
        log_f = F.logsigmoid(soft_cap(self.fgate_proj(x), spec.gate_soft_cap).to(rule_dtype))
        if ctx.attention_mask is not None:  # padding is an identity step: nothing written, nothing forgotten
            pad = ~ctx.attention_mask.bool()[..., None]
            log_i, log_f = log_i.masked_fill(pad, -torch.inf), log_f.masked_fill(pad, 0.0)
        log_i, log_f = self.hook_i(log_i), self.hook_log_f(log_f)
        q_read = q * spec.d_qk**-0.5
        packed = None if ctx.state is None else ctx.state.ssm_state(self)
        start = None if packed is None else unpack_state(packed.to(rule_dtype))
        parts = mlstm_chunked(q_read, k, v, log_i, log_f, start, spec.chunk_size)
        y, denom = parts.read(spec.eps)
        if ctx.state is not None:  # decoding: the next step continues from HF's stabilised state
            ctx.state.refuse_lazy(self, [self.hook_h, self.hook_n, self.hook_kernel])
            ctx.state.set_ssm_state(self, pack_state(parts.state))
        else:
            y, denom = self._states(q_read, k, v, log_i, log_f, parts.m, y, denom)
        denom, denom_was = through_hook(self.hook_denom, denom)
        if denom_was is not None:  # y_t = num_t / N'_t
            y = y * (denom_was / denom)[..., None]
        if self.hook_kernel.is_active and ctx.state is None:
            kernel_fn = lambda: mlstm_kernel(q_read, k, log_i, log_f, denom)  # noqa: E731
            kernel, kernel_was = through_hook(self.hook_kernel, kernel_fn(), kernel_fn)
            if kernel_was is not None:  # y_j += sum_i (K' - K)[j, i] v_i
                y = y + einsum(kernel - kernel_was, v, "b h j i, b i h v -> b j h v")
        y = self.hook_y(y)
        gated = self.hook_gated(torch.sigmoid(gate) * self._head_norm(y).to(x.dtype))
        return written_by_units(self.out_proj, gated, self.hook_head_out, self.head_writes)

    def _states(self, q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, m: Tensor, y: Tensor,
                denom: Tensor) -> tuple[Tensor, Tensor]:
        """(y, N) through the lazy state hooks hook_h and hook_n: read from the states as set and continued."""
        if not (self.hook_h.is_active or self.hook_n.is_active):
            return y, denom
        decay = mlstm_decays(log_f)
        if self.hook_n.is_active:
            ones = v.new_ones(*v.shape[:-1], 1)
            n_fn = lambda: mlstm_states(k, ones, log_i, log_f)[..., 0]  # noqa: E731
            edit = through_state_hook(self.hook_n, n_fn(), n_fn, lambda e, fixed: set_scan(decay[..., 0], e, fixed))
            if edit.clean is not None:  # N_t = max(|n_t . q_t|, 1) + eps exp(m_t) from the states as set
                at = slice(edit.first, None)
                n_q = einsum(edit.h[:, at], q[:, at], "b l h c, b l h c -> b l h").abs()
                new = torch.clamp_min(n_q, 1.0) + self.spec.eps * torch.exp(m[:, at])
                y = torch.cat([y[:, :edit.first], y[:, at] * (denom[:, at] / new)[..., None]], dim=1)
                denom = torch.cat([denom[:, :edit.first], new], dim=1)
        if self.hook_h.is_active:
            C_fn = lambda: mlstm_states(k, v, log_i, log_f)  # noqa: E731
            edit = through_state_hook(self.hook_h, C_fn(), C_fn, lambda e, fixed: set_scan(decay, e, fixed))
            if edit.clean is not None:  # y_t = C_t^T q_t / N_t on the edited (set and continued) states
                y = edit.read_into(y, lambda h, at: einsum(h, q[:, at], "b l h c v, b l h c -> b l h v")
                                   / denom[:, at, :, None])
        return y, denom

    def _head_norm(self, y: Float[Tensor, "batch pos n_heads d_v"]) -> Float[Tensor, "batch pos v_dim"]:
        """HF's multihead_norm: a LayerNorm of each head over d_v (at least float32), then the gain."""
        y32 = y.to(torch.promote_types(y.dtype, torch.float32))
        normed = (y32 - y32.mean(-1, keepdim=True)) * torch.rsqrt(y32.var(-1, keepdim=True, unbiased=False)
                                                                   + self.spec.norm_eps)
        return rearrange(normed, "b l h v -> b l (h v)") * self.norm_weight.to(normed.dtype)

    def head_writes(self, gated: Float[Tensor, "*batch pos v_dim"]) -> Float[Tensor, "*batch pos n_heads d_model"]:
        """Each head's write to the residual (what hook_head_out holds; out_proj has no bias)."""
        W_out = rearrange(self.out_proj.weight, "m (h v) -> h v m", v=self.spec.d_v)
        per_head = rearrange(gated, "... l (h v) -> ... l h v", v=self.spec.d_v)
        return einsum(per_head, W_out, "... l h v, h v m -> ... l h m")

    def extra_repr(self) -> str:
        s = self.spec
        return f"n_heads={s.n_heads}, d_qk={s.d_qk}, d_v={s.d_v}, chunk_size={s.chunk_size}, gate_soft_cap={s.gate_soft_cap}"
