"""Mamba-1 kernel (the SSM as attention), chunked and factorised: whole, chosen rows, chosen columns.

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch     b
    pos       l     L   sequence position; kernel rows q_pos = target j, columns k_pos = source i
    d_inner   d     D   channel (a Mamba-1 "head")
    d_state   n     N   state size per channel
    row       r         a chosen target position (mamba1_kernel_rows); col: a chosen source
    chunk     c         positions [c Q, (c+1) Q) for the chunk length Q; p: position inside it

The kernel (selective_scan.py; DESIGN.md section 4), with a_t = dt_t * A <= 0 the log-decay:
    kernel[b, d, j, i] = sum_n C_j[n] * exp(sum_{t=i+1..j} a_t[d, n]) * B_bar_i[d, n],  zero for i > j.
The dense reference (mamba1_kernel) takes d_inner x L^2 x d_state exponentials. Here, for a
target j in chunk z and a source i in an earlier chunk c, the decay splits at chunk boundaries
    decay(j <- i) = decay(j <- start of z) * decay(start of z <- end of c) * decay(end of c <- i),
every factor <= 1 (an exponential of a non-positive sum, never exp(+S)): each factor is at least
the product, so nothing underflows that the product itself would not. Going backwards chunk by
chunk, W_j = decay(j <- start of the chunk after c) is carried per target and one matmul
    kernel[:, :, j, chunk c] = (C_j * W_j) @ (decay(end of c <- i) * B_bar_i)    (rank d_state)
gives the rows' entries for the whole chunk; then W_j *= decay over chunk c. Sources in j's own
chunk take products of A_bar down the chunk, as the scan does (exact, no logarithms). Segment sums
of a = dt * A are taken on dt (d_state times smaller) and multiplied by A.
Cost of the whole kernel: a [pos, d_state] x [d_state, pos] matmul per channel, plus
d_inner x pos x d_state x Q multiplications for the own chunks; no exp of a pos x pos tensor.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.ssd import _check_positions, _linear_recurrence

CHUNK_FULL = 16  # chunk length of the whole kernel (fastest measured on CPU, d_inner 1536, pos 256)
CHUNK_ROWS = 64  # chunk length for a few rows or columns (fewer Python steps)


def _reverse_cumsum(x: Float[Tensor, "batch p *rest"]) -> Float[Tensor, "batch p *rest"]:
    """out[:, i] = sum_{t >= i} x[:, t] along axis 1, each entry its own sum (no difference of cumsums)."""
    return x.flip(1).cumsum(1).flip(1)


def _own_chunk(
    A_bar: Float[Tensor, "batch p d_inner d_state"],
    B_c: Float[Tensor, "batch p _d d_state"],
    C_rows: Float[Tensor, "batch row d_state"],
    local: Int[Tensor, "row"],
) -> tuple[Float[Tensor, "batch d_inner row p"], Float[Tensor, "batch row d_inner d_state"]]:
    """Targets j = local (sorted positions inside one chunk) reading the sources of that chunk.

    Returns the entries sum_n C_j[n] prod_{t=i+1..j} A_bar_t B_c[i] (zero for i > j), and
    W_j = prod_{t=0..j} A_bar_t, the decay from the chunk's start. The products run down the
    chunk as the scan does, R_j[i] = A_bar_j R_{j-1}[i] for i < j and R_j[j] = B_c[j] (exact;
    cost d_inner * d_state * p^2), in a [batch j d_inner i d_state] buffer that one matmul
    contracts with C.
    """
    batch, p, d_inner, d_state = A_bar.shape
    last = int(local[-1])
    A_bar_d = rearrange(A_bar, "b p d n -> b p d 1 n")
    if torch.is_grad_enabled() and (A_bar.requires_grad or B_c.requires_grad):  # the same, out of place
        X = A_bar.new_zeros(batch, last + 1, d_inner, p, d_state)
        X.diagonal(dim1=1, dim2=3).copy_(rearrange(B_c[:, : last + 1], "b j d n -> b d n j"))
        R = _linear_recurrence(A_bar_d[:, : last + 1], X, None)
    else:
        R = A_bar.new_empty(batch, last + 1, d_inner, p, d_state)  # [b j d i n]
        R[:, 0] = 0
        R[:, 0, :, 0] = B_c[:, 0]
        for j in range(1, last + 1):
            torch.mul(R[:, j - 1], A_bar_d[:, j], out=R[:, j])  # entries i > j-1 stay zero
            R[:, j, :, j] = B_c[:, j]
    if not torch.equal(local, torch.arange(last + 1, device=local.device)):
        R = R[:, local]  # [b r d i n]
    entries = rearrange(R, "b r d i n -> b r (d i) n") @ C_rows[..., None]  # [b r (d i) 1]
    W = torch.cumprod(A_bar[:, : last + 1], dim=1)[:, local]  # [b r d n]
    return rearrange(entries, "b r (d i) 1 -> b d r i", d=d_inner), W


def _rows_by_chunks(
    steps: Float[Tensor, "batch pos d_inner k"],
    A: Float[Tensor, "d_inner d_state"],
    B_bar: Callable[[slice], Float[Tensor, "batch p _d d_state"]],
    C: Float[Tensor, "batch pos d_state"],
    rows: Int[Tensor, "row"],
    chunk: int,
) -> Float[Tensor, "batch d_inner row k_pos"]:
    """sum_n C_j[n] exp(sum_{t=i+1..j} steps_t * A) B_bar_i for targets j = rows (sorted ascending).

    steps is dt with k = 1 (then every segment sum is taken on dt, d_state times cheaper, and
    multiplied by A), or log(A_bar) with k = d_state and A = 1. B_bar(s) gives B_bar_t for the
    positions of slice s (its d_inner axis may be 1: it broadcasts), so no [batch pos d_inner
    d_state] tensor is built beyond one chunk.
    """
    batch, seq_len, d_inner, _ = steps.shape
    out = C.new_empty(batch, d_inner, len(rows), seq_len)  # every entry is written once below
    if len(rows) == 0:
        return out
    chunk_of = rows // chunk
    first = len(rows)  # rows[first:] are active: targets in chunks after the current one
    W = C.new_empty(batch, d_inner, 0, A.shape[1])  # [b d r n] decay(j <- start of chunk c+1), rows[first:]
    for c in range(int(chunk_of[-1]), -1, -1):
        pos = slice(c * chunk, min((c + 1) * chunk, seq_len))
        steps_c, B_c = steps[:, pos], B_bar(pos)  # [b p d k], [b p d n]
        if first < len(rows):  # 1. sources in chunk c, targets in later chunks: one matmul
            to_end = _reverse_cumsum(steps_c)  # [b p d k] sum_{t=i..end of chunk c}
            chunk_decay = torch.exp(to_end[:, 0] * A)  # [b d n] decay over the whole chunk
            to_end = F.pad(to_end[:, 1:], (0, 0, 0, 0, 0, 1))  # sum_{t=i+1..end of chunk c}
            right = torch.exp(to_end * A) * B_c  # [b p d n] decay(end of c <- i) B_bar_i
            left = rearrange(C[:, rows[first:]], "b r n -> b 1 r n") * W  # [b d r n]
            out[:, :, first:, pos] = left @ rearrange(right, "b p d n -> b d n p")
            W = W * chunk_decay[:, :, None]
        here = (chunk_of == c).nonzero()
        if len(here):  # 2. targets in chunk c: the sources of their own chunk, then nothing
            lo, hi = int(here[0]), int(here[-1]) + 1
            entries, W_here = _own_chunk(torch.exp(steps_c * A), B_c, C[:, rows[lo:hi]], rows[lo:hi] - c * chunk)
            out[:, :, lo:hi, pos] = entries
            out[:, :, lo:hi, pos.stop :] = 0  # sources after the chunk
            W = torch.cat([rearrange(W_here, "b r d n -> b d r n"), W], dim=2)
            first = lo
    return out


def _sorted_rows(
    rows: Int[Tensor, "row"], seq_len: int, what: str
) -> tuple[Int[Tensor, "row"], Int[Tensor, "row"]]:
    """(rows sorted ascending, the permutation that sorts them); positions must lie in [0, seq_len)."""
    _check_positions(rows, seq_len, what)
    order = torch.argsort(rows, stable=True)
    return rows[order], order


def _unsort(out: Tensor, order: Tensor, dim: int) -> Tensor:
    """Undo _sorted_rows along dim: result.select(dim, order[k]) = out.select(dim, k)."""
    result = torch.empty_like(out)
    result.index_copy_(dim, order.to(out.device), out)
    return result


def mamba1_kernel_chunked(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    *,
    chunk_size: int = CHUNK_FULL,
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """Same result as selective_scan.mamba1_kernel, factorised at chunk boundaries (module docstring).

    Stable for any length and decay: every exponential is of a non-positive sum. Memory: the
    kernel plus O(batch * d_inner * d_state * (pos + chunk_size^2)). With autograd on, the own
    chunks' products are built out of place (slower, same numbers).

    Args:
        dt, A, B, C: as selective_scan. chunk_size: positions per chunk (speed only).
    Returns:
        kernel: [b, d, j, i], row = target j, column = source i; y_j = sum_i kernel[:, :, j, i] u_i.
    """
    seq_len = dt.shape[1]
    rows = torch.arange(seq_len, device=dt.device)
    return _rows_by_chunks(dt[..., None], A, lambda s: dt[:, s, :, None] * B[:, s, None, :], C, rows, chunk_size)


def mamba1_kernel_discrete_chunked(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    B_bar: Float[Tensor, "batch pos d_inner d_state"],
    C: Float[Tensor, "batch pos d_state"],
    *,
    chunk_size: int = CHUNK_FULL,
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """mamba1_kernel_discrete for 0 < A_bar <= 1 (every unedited A_bar): log(A_bar) <= 0 factorises.

    Zeros, negatives or A_bar > 1 are refused (mamba1_kernel_discrete keeps its exact slow path
    for them): log 0 and signs do not factorise, and factors > 1 could overflow.
    """
    if not bool(((A_bar > 0) & (A_bar <= 1)).all()):
        raise ValueError("mamba1_kernel_discrete_chunked needs 0 < A_bar <= 1 everywhere; "
                         "use mamba1_kernel_discrete for zeros, negatives or growth")
    rows = torch.arange(A_bar.shape[1], device=A_bar.device)
    ones = A_bar.new_ones(A_bar.shape[2:])
    return _rows_by_chunks(torch.log(A_bar), ones, lambda s: B_bar[:, s], C, rows, chunk_size)


def mamba1_kernel_rows(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    rows: Int[Tensor, "row"],
    *,
    chunk_size: int = CHUNK_ROWS,
) -> Float[Tensor, "batch d_inner row k_pos"]:
    """mamba1_kernel(dt, A, B, C)[:, :, rows, :] without the pos x pos matrix.

    What the chosen targets read from every source. Cost O(rows * pos * d_inner * d_state)
    multiply-adds, pos * d_inner * d_state exponentials, and d_inner * d_state * chunk_size^2
    for each chunk that holds a target; memory O(batch * d_inner * (rows * pos + d_state *
    chunk_size^2)), linear in pos.

    Args:
        dt, A, B, C: as selective_scan. rows: target positions in [0, pos), any order, repeats ok.
        chunk_size: positions per chunk (speed only).
    Returns:
        kernel_rows: [b, d, r, i] = kernel[b, d, rows[r], i], zero for i > rows[r].
    """
    sorted_rows, order = _sorted_rows(rows, dt.shape[1], "rows")
    out = _rows_by_chunks(dt[..., None], A, lambda s: dt[:, s, :, None] * B[:, s, None, :], C, sorted_rows,
                          chunk_size)
    return _unsort(out, order, dim=2)


def mamba1_kernel_cols(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    cols: Int[Tensor, "col"],
    *,
    chunk_size: int = CHUNK_ROWS,
) -> Float[Tensor, "batch d_inner q_pos col"]:
    """mamba1_kernel(dt, A, B, C)[:, :, :, cols] without the pos x pos matrix.

    Where the chosen sources are read. Columns are rows of the time-reversed kernel: with
    j' = L-1-j, i' = L-1-i, sum_{t=i+1..j} a_t = sum_{s=j'+1..i'} a''_s for a''_s = a_{L-s}, so
    kernel[j, i] = sum_n B_i[n] exp(...) C_j[n] dt_i is row i' of the kernel with dt'' (dt
    reversed and shifted by one), B and C swapped and reversed, times dt_i. Cost and memory as
    mamba1_kernel_rows.

    Args:
        dt, A, B, C: as selective_scan. cols: source positions in [0, pos), any order, repeats ok.
        chunk_size: positions per chunk (speed only).
    Returns:
        kernel_cols: [b, d, j, c] = kernel[b, d, j, cols[c]], zero for j < cols[c].
    """
    seq_len = dt.shape[1]
    sorted_cols, order = _sorted_rows(cols, seq_len, "cols")
    dt_rev = F.pad(dt.flip(1)[:, :-1], (0, 0, 1, 0))  # dt''_s = dt_{L-s}; s = 0 is never summed
    B_rev, C_rev = B.flip(1), C.flip(1)
    out = _rows_by_chunks(dt_rev[..., None], A, lambda s: C_rev[:, s, None, :], B_rev,
                          (seq_len - 1 - sorted_cols).flip(0), chunk_size)
    out = rearrange(out.flip(2, 3), "b d c j -> b d j c")  # back to forward time, sorted cols ascending
    out = out * rearrange(dt[:, sorted_cols], "b c d -> b d 1 c")  # B_bar_i = dt_i * B_i
    return _unsort(out, order, dim=3)
