"""The mLSTM (xLSTM's matrix-memory cell, Beck et al. 2024): exponential input gate, sigmoid forget gate,
a normaliser state and the stabiliser m, per head.

Glossary (shape word, einops letter, symbol)
    batch      b
    pos        l     t    position; kernel rows q_pos = target j, columns k_pos = source i
    n_heads    h          heads: each has its own memory, normaliser and gates
    d_qk       c          the memory's rows (query / key channels)
    d_v        v          the memory's columns (value channels)
    q                     the query as read: q_proj(x) * d_qk^-1/2 (the functions here take it scaled)
    log_i      i_t        the log input gate (the soft-capped preactivation): the gate is exp(i_t)
    log_f                 the log forget gate log sigmoid(f_t); F_t = sum_{r <= t} log_f_r
    C          C_t        the memory [d_qk d_v]: C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T
    n          n_t        the normaliser [d_qk]:  n_t = f_t n_{t-1} + exp(i_t) k_t  (C with v = 1)
    m          m_t        the stabiliser, the log of the largest weight of the sum C_t:
                          m_t = max(log_f_t + m_{t-1}, i_t) = F_t + max(m0, max_{s <= t} (i_s - F_s))
    denom      N_t        max(|n_t . q_t|, 1) + eps exp(m_t)
    y          y_t        C_t^T q_t / N_t  (HF's h, before the head norm)

The memories C, n above carry no stabiliser (the paper's C_t, n_t; what hook_h and hook_n hold). HF's
recurrence and its cache keep the stabilised C~ = exp(-m) C, n~ = exp(-m) n beside m, and divide by
max(|n~ . q|, exp(-m)) + eps: the same y (multiply numerator and denominator by exp(m)). `state` below is
HF's triple (C~ [b h c v], n~ [b h c], m [b h]); a zero state has m = 0.

As attention, from a zero state (DESIGN.md section 4: zero for i > j), the normaliser at j held:
    y_j = sum_{i <= j} K[j, i] v_i,   K[h, j, i] = exp(F_j - F_i + i_i) (q_j . k_i) / N_j
The un-normalised kernel is K[j, i] N_j; N_j's |n_j . q_j| is that row's sum. m enters only through the
eps term of N (and the stabilised arithmetic); it is a function of the gates (and of m0).

`mlstm_sequential` is HF's step loop (the oracle); `mlstm_chunked` is the chunkwise form: inside a chunk the
stabilised kernel times [v | 1], between chunks the stabilised state (HF's mlstm_chunkwise kernels). Padding
is an identity step: i = -inf (nothing written) and log_f = 0 (nothing forgotten).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.pair_cut import pair_cut
from hooked.ops.ssd import _check_positions, _linear_recurrence

State = tuple[Tensor, Tensor, Tensor]  # HF's (C~ [b h c v], n~ [b h c], m [b h])


class Parts(NamedTuple):
    """What y is made of, stabilised by m_t: num = exp(-m_t) C_t^T q_t, qn = exp(-m_t) n_t . q_t."""

    num: Float[Tensor, "batch pos n_heads d_v"]
    qn: Float[Tensor, "batch pos n_heads"]
    m: Float[Tensor, "batch pos n_heads"]
    state: State  # after the last position

    def read(self, eps: float) -> tuple[Tensor, Tensor]:
        """(y, N): y = num / (max(|qn|, exp(-m)) + eps), N = exp(m) (max(|qn|, exp(-m)) + eps)."""
        denom = torch.maximum(self.qn.abs(), torch.exp(-self.m)) + eps
        return self.num / denom[..., None], torch.exp(self.m) * denom


def pack_state(state: State) -> Float[Tensor, "batch n_heads d_qk d_v_plus_2"]:
    """HF's triple as one tensor per head (a DecodeState's h, heads on axis 1): columns [C~ | n~ | m]."""
    C, n, m = state
    return torch.cat([C, n[..., None], m[..., None, None].expand(*n.shape, 1)], dim=-1)


def unpack_state(packed: Float[Tensor, "batch n_heads d_qk d_v_plus_2"]) -> State:
    return packed[..., :-2], packed[..., -2], packed[..., 0, -1]


def zero_state(q: Tensor, v: Tensor) -> State:
    b, _, h, c = q.shape
    return (q.new_zeros(b, h, c, v.shape[-1]), q.new_zeros(b, h, c), q.new_zeros(b, h))


def mlstm_sequential(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    state: State | None = None,
    eps: float = 1e-6,
) -> tuple[Float[Tensor, "batch pos n_heads d_v"], State]:
    """HF's recurrent step, one position at a time, stabilised (the oracle). Returns (y, state after)."""
    C, n, m = zero_state(q, v) if state is None else state
    ys = []
    for t in range(q.shape[1]):
        m_new = torch.maximum(log_f[:, t] + m, log_i[:, t])
        f_act, i_act = torch.exp(log_f[:, t] + m - m_new), torch.exp(log_i[:, t] - m_new)
        C = f_act[..., None, None] * C + i_act[..., None, None] * einsum(k[:, t], v[:, t], "b h c, b h v -> b h c v")
        n = f_act[..., None] * n + i_act[..., None] * k[:, t]
        num = einsum(C, q[:, t], "b h c v, b h c -> b h v")
        denom = torch.maximum(einsum(n, q[:, t], "b h c, b h c -> b h").abs(), torch.exp(-m_new)) + eps
        ys.append(num / denom[..., None])
        m = m_new
    return torch.stack(ys, dim=1), (C, n, m)


def mlstm_chunked(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    state: State | None = None,
    chunk_size: int = 64,
) -> Parts:
    """The stabilised numerator, q . n~ and m at every position, chunk by chunk, and the state after."""
    C, n, m0 = zero_state(q, v) if state is None else state
    nums, qns, ms = [], [], []
    for start in range(0, q.shape[1], chunk_size):
        qc, kc, vc, ic, fc = (x[:, start:start + chunk_size] for x in (q, k, v, log_i, log_f))
        size = qc.shape[1]
        b = fc.cumsum(1)  # [b l h]: log of the forget gates' product from the chunk start
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        # 1. log weight of source s at target j inside the chunk, and of the state entering it
        log_d = (b[:, :, None] - b[:, None, :] + ic[:, None, :]).masked_fill(~causal[None, :, :, None], -torch.inf)
        log_enter = b + m0[:, None]  # [b j h]
        m = torch.maximum(log_enter, log_d.amax(2))  # [b j h]: the stabiliser
        # 2. the stabilised kernel inside the chunk, and the state's part, on [v | 1]
        d = torch.exp(log_d - m[:, :, None]) * einsum(qc, kc, "b j h c, b s h c -> b j s h")
        enter = torch.exp(log_enter - m)  # [b j h]
        nums.append(einsum(d, vc, "b j s h, b s h v -> b j h v")
                    + enter[..., None] * einsum(qc, C, "b j h c, b h c v -> b j h v"))
        qns.append(d.sum(2) + enter * einsum(qc, n, "b j h c, b h c -> b j h"))
        ms.append(m)
        # 3. the state leaving the chunk, stabilised by the last position's m
        m_last = m[:, -1]
        w = torch.exp(b[:, -1:] - b + ic - m_last[:, None])  # [b s h]
        carry = torch.exp(b[:, -1] + m0 - m_last)  # [b h]
        C = carry[..., None, None] * C + einsum(kc * w[..., None], vc, "b s h c, b s h v -> b h c v")
        n = carry[..., None] * n + (kc * w[..., None]).sum(1)
        m0 = m_last
    if not nums:
        return Parts(v.new_zeros(v.shape), q.new_zeros(q.shape[:3]), q.new_zeros(q.shape[:3]), (C, n, m0))
    return Parts(torch.cat(nums, 1), torch.cat(qns, 1), torch.cat(ms, 1), (C, n, m0))


def mlstm_states(
    k: Float[Tensor, "batch pos n_heads d_qk"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    h0: Float[Tensor, "batch n_heads d_qk d_v"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_qk d_v"]:
    """Every memory C_t (no stabiliser; hook_h): C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T from h0 (None: zero).
    With v = ones [.. 1] it is the normaliser n_t (hook_n) as [.. d_qk 1]."""
    writes = einsum(k * torch.exp(log_i)[..., None], v, "b l h c, b l h v -> b l h c v")
    return _linear_recurrence(mlstm_decays(log_f), writes, h0)


def mlstm_decays(log_f: Float[Tensor, "batch pos n_heads"]) -> Float[Tensor, "batch pos n_heads 1 1"]:
    """The forget gate f_t = exp(log_f_t), broadcast against the memories (set_scan's decay)."""
    return torch.exp(log_f)[..., None, None]


def _kernel_slice(q: Tensor, k: Tensor, log_i: Tensor, log_f: Tensor, denom: Tensor, rows: Tensor,
                  cols: Tensor) -> Tensor:
    """K[:, :, rows][..., cols] [b h row col]: exp(F_j - F_i + i_i - log N_j) (q_j . k_i), zero where i > j."""
    F = log_f.cumsum(1)  # [b l h]
    w = F[:, rows, None] - F[:, None, cols] + log_i[:, None, cols] - torch.log(denom)[:, rows, None]  # [b r s h]
    w = w.masked_fill((cols[None, :] > rows[:, None])[None, :, :, None], -torch.inf)
    return torch.exp(w.permute(0, 3, 1, 2)) * einsum(q[:, rows], k[:, cols], "b r h c, b s h c -> b h r s")


def mlstm_kernel(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    denom: Float[Tensor, "batch pos n_heads"],
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """K[b, h, j, i] = exp(F_j - F_i + i_i) (q_j . k_i) / N_j, zero for i > j (from a zero state)."""
    every = torch.arange(q.shape[1], device=q.device)
    return mlstm_kernel_rows(q, k, log_i, log_f, denom, every)


def mlstm_kernel_rows(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    denom: Float[Tensor, "batch pos n_heads"],
    rows: Int[Tensor, "row"],
) -> Float[Tensor, "batch n_heads row k_pos"]:
    """mlstm_kernel(...)[:, :, rows, :] without the pos x pos matrix."""
    _check_positions(rows, q.shape[1], "rows")
    return _kernel_slice(q, k, log_i, log_f, denom, rows, torch.arange(q.shape[1], device=q.device))


def mlstm_kernel_cols(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    denom: Float[Tensor, "batch pos n_heads"],
    cols: Int[Tensor, "col"],
) -> Float[Tensor, "batch n_heads q_pos col"]:
    """mlstm_kernel(...)[..., cols] without the pos x pos matrix."""
    _check_positions(cols, q.shape[1], "cols")
    return _kernel_slice(q, k, log_i, log_f, denom, torch.arange(q.shape[1], device=q.device), cols)


def mlstm_knockout(
    q: Float[Tensor, "batch pos n_heads d_qk"],
    k: Float[Tensor, "batch pos n_heads d_qk"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    log_i: Float[Tensor, "batch pos n_heads"],
    log_f: Float[Tensor, "batch pos n_heads"],
    denom: Float[Tensor, "batch pos n_heads"],
    row: Int[Tensor, "pair"],
    j: Int[Tensor, "pair"],
    i: Int[Tensor, "pair"],
    heads: Int[Tensor, "head"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_v"]:
    """sum over the cut pairs (row, j <- i) of K[row, h, j, i] v[row, i] at (row, j), on `heads` (None: all):
    what y loses when those edges are cut, N_j held (pair_cut.py). No pos x pos tensor."""
    F = log_f.cumsum(1)
    log_denom = torch.log(denom)

    def entries(r: Tensor, jj: Tensor, ii: Tensor) -> Tensor:  # [pair h]: exp(F_j - F_i + i_i) (q_j . k_i) / N_j
        w = torch.exp(F[r, jj] - F[r, ii] + log_i[r, ii] - log_denom[r, jj])
        return (q[r, jj] * k[r, ii]).sum(-1) * w

    return pair_cut(entries, v, row, j, i, heads, width=max(q.shape[3], v.shape[3]))
