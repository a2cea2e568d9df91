"""Mamba-1 selective scan: fast scan, sequential oracle, linear scan, kernel (SSM as attention).

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch     b
    pos       l     L   sequence position; kernel rows q_pos = target j, columns k_pos = source i
    d_inner   d     D   channel (a Mamba-1 "head")
    d_state   n     N   state size per channel
    pair      k         one (batch_idx, target, source) entry of mamba1_kernel_pairs

Recurrence, per channel d and state n (dt already softplus'ed, A negative; no D skip here):
    A_bar_t = exp(dt_t * A)          B_bar_t = dt_t * B_t
    h_t = A_bar_t * h_{t-1} + B_bar_t * u_t              h: [d_inner d_state]
    y_t = sum_n C_t[n] * h_t[:, n]
B_bar is the Euler step dt * B that HF and mamba-ssm use, not the zero-order hold
(exp(dt A) - 1) / A * B of the paper. As attention (DESIGN.md section 4):
    kernel[b, d, j, i] = sum_n C_j[n] * prod_{t=i+1..j} A_bar_t[d, n] * B_bar_i[d, n],  zero for i > j,
and y_j = sum_i kernel[:, :, j, i] * u_i.
"""

import torch
from einops import einsum, rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.selective_kernel import _discrete_chunked
from hooked.ops.ssd import _linear_recurrence, segsum


def selective_scan_sequential(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """The recurrence as a plain loop over positions: the test oracle.

    Args:
        u: SSM input. dt: step sizes (softplus'ed). A: negative decay rates.
        B, C: input and output projections. h0: initial state (zeros when None).
    Returns:
        y: C_t . h_t (no D skip), and h_last: the state after the last position.
    """
    batch, seq_len, d_inner = u.shape
    h = u.new_zeros(batch, d_inner, A.shape[1]) if h0 is None else h0
    ys = []
    for t in range(seq_len):
        A_bar = torch.exp(dt[:, t, :, None] * A)  # [b d n]
        B_bar = dt[:, t, :, None] * B[:, t, None, :]  # [b d n]
        h = A_bar * h + B_bar * u[:, t, :, None]
        ys.append(einsum(h, C[:, t], "b d n, b n -> b d"))
    return torch.stack(ys, dim=1), h


def selective_scan(
    u: Float[Tensor, "batch pos d_inner"],
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
    *,
    chunk_size: int = 8,
) -> tuple[Float[Tensor, "batch pos d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """Same result as selective_scan_sequential, faster, never holding a [b l d n] tensor.

    Per chunk of chunk_size positions: A_bar and B_bar*u in two vectorised ops, then the
    recurrence in place (one fused multiply-add per position, see _linear_recurrence), then y
    in one contraction. Peak memory O(batch * chunk_size * d_inner * d_state). Exact: the same
    products and sums as the loop (no exp(-cumsum) rescaling, which overflows).

    Args:
        as selective_scan_sequential; chunk_size: positions per vectorised block.
    Returns:
        y (no D skip) and h_last, the state after the last position.
    """
    batch, seq_len, d_inner = u.shape
    h = u.new_zeros(batch, d_inner, A.shape[1]) if h0 is None else h0
    ys = []
    for start in range(0, seq_len, chunk_size):
        pos = slice(start, start + chunk_size)
        A_bar = torch.exp(dt[:, pos, :, None] * A)  # [b l d n], l <= chunk_size
        B_bar_u = (dt[:, pos] * u[:, pos])[..., None] * B[:, pos, None, :]  # [b l d n]
        states = _linear_recurrence(A_bar, B_bar_u, h)
        h = states[:, -1]
        ys.append(einsum(states, C[:, pos], "b l d n, b l n -> b l d"))
    return torch.cat(ys, dim=1), h


def linear_scan(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    X: Float[Tensor, "batch pos d_inner d_state"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
) -> Float[Tensor, "batch pos d_inner d_state"]:
    """Scan h_t = A_bar_t * h_{t-1} + X_t and return every state.

    Use it on discrete or edited quantities (X = B_bar * u gives hook_h), or to carry a state
    edit forward: an edit delta scanned with h0 = None gives the change of every later state
    (the recurrence is linear in h).

    Args:
        A_bar: decay per position (exp(dt * A), or an edited one).
        X: input added to the state at each position.
        h0: state before position 0 (zeros when None).
    Returns:
        states: h_t for every position t.
    """
    return _linear_recurrence(A_bar, X, h0)


def mamba1_kernel(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """The SSM as attention, per channel (module docstring), from dt, A, B, C.

    prod_{t=i+1..j} A_bar_t = exp(A * sum_{t=i+1..j} dt_t), the sums from the stable segsum.
    Above the diagonal the sum is set to 0 before exp (A * -inf would be +inf, and inf * 0 nan),
    then the entries are zeroed. Memory: 3 x batch * d_inner * pos^2 at peak.

    Args:
        dt, A, B, C: as selective_scan.
    Returns:
        kernel: [b, d, j, i], row = target j, column = source i; y_j = sum_i kernel[:, :, j, i] u_i.
    """
    seq_len = dt.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=dt.device).tril()
    dt_sums = segsum(rearrange(dt, "b l d -> b d l")).masked_fill(~causal, 0)  # [b d j i]
    kernel = torch.zeros_like(dt_sums)
    for n in range(A.shape[1]):  # one d_state at a time, in place: peak 3 x the kernel's size
        CB = einsum(C[..., n], B[..., n], "b j, b i -> b j i")
        decay = (A[:, n, None, None] * dt_sums).exp_()
        kernel.addcmul_(CB[:, None], decay)
        del decay
    del dt_sums
    kernel.mul_(rearrange(dt, "b i d -> b d 1 i"))  # B_bar_i = dt_i * B_i
    return kernel.masked_fill_(~causal, 0)


def mamba1_kernel_discrete(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    B_bar: Float[Tensor, "batch pos d_inner d_state"],
    C: Float[Tensor, "batch pos d_state"],
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """The kernel from discrete (possibly edited) A_bar, B_bar: same as mamba1_kernel.

    When 0 < A_bar <= 1 everywhere (every unedited A_bar, and edits that keep it a decay), the
    chunked factorisation of selective_kernel.py, at the cost of a matmul. Otherwise the exact
    slow path: prod_{t=i+1..j} A_bar_t = exp(segsum(log|A_bar|)) * (-1)^(number of negative
    factors), so any A_bar works: zeros give log 0 = -inf and a zero product, negatives flip the
    sign. Memory O(batch * d_inner * pos^2), built one d_state at a time.

    Args:
        A_bar: decay per position (hook_A_bar). B_bar: dt * B (hook_B_bar). C: output projection.
    Returns:
        kernel: as mamba1_kernel.
    """
    if bool(((A_bar > 0) & (A_bar <= 1)).all()):
        return _discrete_chunked(A_bar, B_bar, C)  # checked here: one host read, not two
    seq_len = A_bar.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=A_bar.device).tril()
    log_abs = rearrange(torch.log(A_bar.abs()), "b l d n -> b d n l")
    negative = rearrange((A_bar < 0).to(A_bar.dtype), "b l d n -> b d n l")
    kernel = A_bar.new_zeros(A_bar.shape[0], A_bar.shape[2], seq_len, seq_len)
    for n in range(A_bar.shape[-1]):
        magnitude = torch.exp(segsum(log_abs[:, :, n]))  # [b d j i], zero above the diagonal
        flips = segsum(negative[:, :, n]).masked_fill(~causal, 0)
        sign = 1 - 2 * torch.remainder(flips, 2)
        B_bar_n = rearrange(B_bar[..., n], "b i d -> b d 1 i")
        kernel += C[:, None, :, n, None] * magnitude * sign * B_bar_n
    return kernel


def mamba1_kernel_pairs(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    batch_idx: Int[Tensor, "pair"],
    target: Int[Tensor, "pair"],
    source: Int[Tensor, "pair"],
    chunk: int | None = None,
) -> Float[Tensor, "pair d_inner"]:
    """mamba1_kernel(dt, A, B, C)[batch_idx, :, target, source] without the pos x pos matrix.

    Closed form sum_n C_j[n] exp(A[:, n] (S_j - S_i)) dt_i B_i[n] with S = cumsum(dt) over
    positions, summed in float64 so the difference keeps the input dtype's precision. Indices
    must lie in [0, pos); entries with source > target are 0. Pairs are processed `chunk` at a
    time (default: about 2^22 elements of [chunk d_inner d_state]), so peak memory is bounded.

    Args:
        dt, A, B, C: as selective_scan. batch_idx, target, source: one kernel entry per pair.
        chunk: pairs per block (None: the default above).
    Returns:
        entries: [pair, d_inner], the kernel of every channel at each (batch_idx, target, source).
    """
    d_inner, d_state = A.shape
    chunk = chunk or max(1, 2**22 // (d_inner * d_state))
    S = torch.cumsum(dt.double(), dim=1)  # [b l d]
    entries = []
    for start in range(0, len(target), chunk):
        # the chunk's pairs: batch row, target j, source i
        row, j, i = (idx[start : start + chunk] for idx in (batch_idx, target, source))
        causal = (i <= j)[:, None]
        gap = (S[row, j] - S[row, i]).to(dt.dtype)  # [k d], >= 0 where causal
        gap = gap.masked_fill(~causal, 0)  # masked before exp: A * (negative gap) could overflow
        decay = torch.exp(einsum(gap, A, "k d, d n -> k d n"))
        CB = C[row, j] * B[row, i]  # [k n]
        entry = einsum(decay, CB, "k d n, k n -> k d") * dt[row, i]
        entries.append(entry.masked_fill(~causal, 0))
    if not entries:
        return dt.new_zeros(0, d_inner)
    return torch.cat(entries)
