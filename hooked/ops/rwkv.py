"""RWKV-4's WKV recurrence (Peng et al. 2023, "time mixing") and its kernel, as pure tensor functions.

Glossary (shape word in annotations; HF RwkvSelfAttention names in brackets; paper symbols)
    batch, pos     b, t; kernel rows q_pos = target t, columns k_pos = source i
    att_width      c, the channels [attention_hidden_size]; each its own recurrence
    w              the per-channel log decay, w = -exp(time_decay) < 0
    u              the bonus of the current token [time_first]
    k, v           keys and values [batch pos att_width]; k = -inf: a position that writes nothing
                   (padding, a cut source)
    a, b           the state after reading position t (true scale; "num", "den"):
                       a_t = e^w a_{t-1} + e^{k_t} v_t,   b_t = e^w b_{t-1} + e^{k_t}    (a_{-1} = b_{-1} = 0)
    wkv            y_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t}); 0 where nothing was written
    scaled state   (a', b', m) with a = a' e^m, b = b' e^m: HF's max tracking, m the largest exponent seen, so
                   that no e^k is ever formed (the scan); `true_states` turns it into (a, b)
    log_den        log(b_{t-1} + e^{u + k_t}), the log of y_t's denominator
    kernel         K[t, i] = e^{s[t, i] - log_den_t}, s[t, i] = (t-1-i) w + k_i (i < t), u + k_t (i = t);
                   y_t = sum_i K[t, i] v_i, and each row sums to 1: K is a softmax over i of s[t, i]

`wkv_sequential` (true scale, one position at a time) is the oracle the tests hold `wkv_scan` to; the kernel
functions build rows or columns from (w, u, k, log_den) without the pos x pos matrix.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

NO_EXPONENT = -1e38  # m of an empty state (HF's starting max_state): exp(k - m) of any real key is 0


def wkv_sequential(
    w: Float[Tensor, "att_width"],
    u: Float[Tensor, "att_width"],
    k: Float[Tensor, "batch pos att_width"],
    v: Float[Tensor, "batch pos att_width"],
    h0: Float[Tensor, "batch att_width 2"] | None = None,
) -> tuple[Float[Tensor, "batch pos att_width"], Float[Tensor, "batch pos att_width 2"]]:
    """(y, states (a, b) after each position) in true scale, one position at a time (the oracle)."""
    a, b = (k.new_zeros(k.shape[0], k.shape[2]),) * 2 if h0 is None else h0.unbind(-1)
    ys, states = [], []
    for t in range(k.shape[1]):
        bonus = torch.exp(u + k[:, t])
        ys.append((a + bonus * v[:, t]) / (b + bonus))
        a = torch.exp(w) * a + torch.exp(k[:, t]) * v[:, t]
        b = torch.exp(w) * b + torch.exp(k[:, t])
        states.append(torch.stack([a, b], -1))
    return torch.stack(ys, 1), torch.stack(states, 1)


def empty_state(k: Float[Tensor, "batch pos att_width"]) -> Float[Tensor, "batch att_width 3"]:
    """The scaled state (a', b', m) of nothing read."""
    state = k.new_zeros(k.shape[0], k.shape[2], 3)
    state[..., 2] = NO_EXPONENT
    return state


def wkv_scan(
    w: Float[Tensor, "att_width"],
    u: Float[Tensor, "att_width"],
    k: Float[Tensor, "batch pos att_width"],
    v: Float[Tensor, "batch pos att_width"],
    h0: Float[Tensor, "batch att_width 3"] | None = None,
) -> tuple[Float[Tensor, "batch pos att_width"], Float[Tensor, "batch pos att_width 3"], Float[Tensor, "batch pos att_width"]]:
    """(y, scaled states (a', b', m) after each position, log_den) by HF's max tracking (its CPU loop, the
    CUDA kernel's arithmetic): every exponent is taken relative to the largest one, so no e^k overflows.
    h0: the scaled state before the first position (None: empty). y is 0 where nothing was written."""
    num, den, m = (empty_state(k) if h0 is None else h0).unbind(-1)
    ys, states, log_dens = [], [], []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        p = torch.maximum(m, u + kt)  # y_t: the old state and the bonus term
        e1, e2 = torch.exp(m - p), torch.exp(u + kt - p)
        top, bottom = e1 * num + e2 * vt, e1 * den + e2
        ys.append(top / torch.where(bottom == 0, 1.0, bottom))
        log_dens.append(p + torch.log(bottom))
        p = torch.maximum(m + w, kt)  # the state after t
        e1, e2 = torch.exp(m + w - p), torch.exp(kt - p)
        num, den, m = e1 * num + e2 * vt, e1 * den + e2, p
        states.append(torch.stack([num, den, m], -1))
    return torch.stack(ys, 1), torch.stack(states, 1), torch.stack(log_dens, 1)


def true_states(scaled: Float[Tensor, "*lead 3"]) -> Float[Tensor, "*lead 2"]:
    """(a, b) = (a' e^m, b' e^m) from a scaled state (inf past the dtype's range: float32 holds e^88)."""
    return scaled[..., :2] * torch.exp(scaled[..., 2:])


def scaled_state(h: Float[Tensor, "batch att_width 2"]) -> Float[Tensor, "batch att_width 3"]:
    """A true-scale state (a, b) as a scaled one (m = 0)."""
    return torch.cat([h, torch.zeros_like(h[..., :1])], -1)


def wkv_read(
    u: Float[Tensor, "att_width"],
    k: Float[Tensor, "batch pos att_width"],
    v: Float[Tensor, "batch pos att_width"],
    h_prev: Float[Tensor, "batch pos att_width 2"],
) -> Float[Tensor, "batch pos att_width"]:
    """y_t = (a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t}) from given true-scale states h_prev[t] = h_{t-1}
    (after a state edit); 0 where the denominator is 0."""
    bonus = torch.exp(u + k)
    top, bottom = h_prev[..., 0] + bonus * v, h_prev[..., 1] + bonus
    return top / torch.where(bottom == 0, 1.0, bottom)


def _scores(w: Tensor, u: Tensor, k: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """s[b, c, rows, cols] (module glossary), -inf above the diagonal."""
    gap = (rows[:, None] - 1 - cols[None, :]).to(k.dtype)  # t - 1 - i
    k_cols = k[:, cols].transpose(1, 2)[:, :, None, :]  # [b c 1 col]
    s = gap * w[:, None, None] + k_cols
    on_diag = rows[:, None] == cols[None, :]
    s = torch.where(on_diag, u[:, None, None] + k_cols, s)
    return s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))


def wkv_kernel_slice(
    w: Float[Tensor, "att_width"],
    u: Float[Tensor, "att_width"],
    k: Float[Tensor, "batch pos att_width"],
    log_den: Float[Tensor, "batch pos att_width"],
    rows: Int[Tensor, "row"] | None = None,
    cols: Int[Tensor, "col"] | None = None,
) -> Float[Tensor, "batch att_width row col"]:
    """kernel[:, :, rows][..., cols] (None: every position) from the keys and log_den, built for those rows
    and columns only: rows x pos for kernel rows, pos x cols for columns, never pos x pos unless asked."""
    seq_len = k.shape[1]
    every = torch.arange(seq_len, device=k.device)
    rows = every if rows is None else rows.to(k.device).long()
    cols = every if cols is None else cols.to(k.device).long()
    for name, idx in (("rows", rows), ("cols", cols)):
        if idx.numel() and (idx.min() < 0 or idx.max() >= seq_len):
            raise ValueError(f"kernel {name} must lie in [0, {seq_len}), got {idx.tolist()[:10]}")
    s = _scores(w, u, k, rows, cols)
    log_den = log_den[:, rows].transpose(1, 2)[..., None]  # [b c row 1]; -inf: a row that reads nothing
    return torch.exp(s - log_den).masked_fill(log_den == float("-inf"), 0.0)
