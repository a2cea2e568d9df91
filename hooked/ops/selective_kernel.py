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
chunk, V_j = C_j * decay(j <- start of the chunk after c) is carried per target and one matmul
    kernel[:, :, j, chunk c] = V_j @ (decay(end of c <- i) * B_bar_i)    (rank d_state)
gives the rows' entries for the whole chunk; then V_j *= decay over chunk c. Sources in j's own
chunk take products of A_bar down the chunk, as the scan does (exact, no logarithms). Segment sums
of a = dt * A are taken on dt (d_state times smaller) and multiplied by A.
Cost of the whole kernel: a [pos, d_state] x [d_state, pos] matmul per channel, plus
d_inner x pos x d_state x Q multiplications for the own chunks; no exp of a pos x pos tensor.
Without autograd the whole kernel is written once into its zeroed output (_full_by_chunks: the
same factors, split at the start of the targets' chunk); with autograd it is assembled out of
place (_rows_by_chunks for every row), for the same numbers.
"""

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.big_buffer import big_zeros
from hooked.ops.ssd import _positions_on_host

CHUNK_ROWS = 64  # chunk length for a few rows or columns (fewer Python steps)
GROUP_BYTES = 2**21  # a band of rows for this many bytes of channels per matmul (fastest measured on CPU)


def _full_chunk(seq_len: int) -> int:
    """Chunk length of the whole kernel: about sqrt(pos), a power of two in [8, 64] (16 at pos
    256, 32 at 1024: fastest measured on CPU at d_inner 1536), balancing the own chunks'
    d_inner * d_state * pos * Q products against the carried decays' d_inner * d_state * pos^2 / Q."""
    return min(64, max(8, 2 ** round(math.log2(max(seq_len, 1)) / 2)))


def _reverse_cumsum(x: Float[Tensor, "batch p *rest"]) -> Float[Tensor, "batch p *rest"]:
    """out[:, i] = sum_{t >= i} x[:, t] along axis 1, each entry its own sum (no difference of cumsums)."""
    return x.flip(1).cumsum(1).flip(1)


def _own_chunk(
    A_bar: Float[Tensor, "batch p d_inner d_state"],
    B_c: Float[Tensor, "batch p _d d_state"],
    C_rows: Float[Tensor, "batch row d_state"],
    wanted: list[int],
) -> tuple[Float[Tensor, "batch d_inner row p"], Float[Tensor, "batch row d_inner d_state"]]:
    """Targets j = wanted (sorted positions inside one chunk, Python ints: the loop below is steered
    on the host without reading the device) reading the sources of that chunk.

    Returns the entries sum_n C_j[n] prod_{t=i+1..j} A_bar_t B_c[i] (zero for i > j), and
    W_j = prod_{t=0..j} A_bar_t, the decay from the chunk's start. The products run down the
    chunk as the scan does, one state per source: R_j[i] = A_bar_j R_{j-1}[i] for i < j,
    R_j[j] = B_c[j] (exact; d_inner * d_state * j multiplications at step j, in a buffer that
    stays in cache), read by C_j at each chosen j.
    """
    batch, p, d_inner, d_state = A_bar.shape
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (A_bar, B_c, C_rows))
    entries = C_rows.new_zeros(batch, d_inner, len(wanted), p)
    W = A_bar.new_empty(batch, len(wanted), d_inner, d_state)
    W_j = A_bar.new_ones(batch, d_inner, d_state)  # prod_{t=0..j} A_bar_t
    # [b i d n]; only rows i <= j are read (for autograd, the rest are zeros carried along)
    R_j = A_bar.new_zeros(batch, p, d_inner, d_state) if grad else A_bar.new_empty(batch, p, d_inner, d_state)
    k = 0  # next wanted row
    for j in range(wanted[-1] + 1):
        W_j = W_j * A_bar[:, j]
        if grad:  # out of place, for autograd
            R_j = torch.cat([R_j[:, :j] * A_bar[:, j, None], B_c[:, j, None].expand(-1, -1, d_inner, -1),
                             R_j[:, j + 1 :]], dim=1)
        else:  # only sources i <= j are non-zero: a contiguous prefix
            R_j[:, :j].mul_(A_bar[:, j, None])
            R_j[:, j] = B_c[:, j]
        if k < len(wanted) and wanted[k] == j:
            read = rearrange(R_j[:, : j + 1], "b i d n -> b (i d) n") @ C_rows[:, k, :, None]  # [b (i d) 1]
            while k < len(wanted) and wanted[k] == j:  # repeated rows
                entries[:, :, k, : j + 1] = rearrange(read, "b (i d) 1 -> b d i", d=d_inner)
                W[:, k] = W_j
                k += 1
    return entries, W


def _rows_by_chunks(
    steps: Float[Tensor, "batch pos d_inner k"],
    A: Float[Tensor, "d_inner d_state"],
    B_bar: Callable[[slice], Float[Tensor, "batch p _d d_state"]],
    C: Float[Tensor, "batch pos d_state"],
    rows: Int[Tensor, "row"],
    wanted: list[int],
    chunk: int,
) -> Float[Tensor, "batch d_inner row k_pos"]:
    """sum_n C_j[n] exp(sum_{t=i+1..j} steps_t * A) B_bar_i for targets j = rows (sorted ascending).

    `wanted` holds the same positions as Python ints, so that the chunks are chosen without a host
    read per chunk (one for the whole call, by whoever made `wanted`, or none).

    steps is dt with k = 1 (then every segment sum is taken on dt, d_state times cheaper, and
    multiplied by A), or log(A_bar) with k = d_state and A = 1. B_bar(s) gives B_bar_t for the
    positions of slice s (its d_inner axis may be 1: it broadcasts), so no [batch pos d_inner
    d_state] tensor is built beyond one chunk.
    """
    batch, seq_len, d_inner, _ = steps.shape
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (steps, A, C, B_bar(slice(0, 1))))
    shape = (batch, d_inner, len(rows), seq_len)
    # every entry is written once below; without autograd into zeros, so sources after a row's chunk are not
    out = C.new_empty(shape) if grad else big_zeros(shape, dtype=C.dtype, device=C.device)
    if len(rows) == 0:
        return out
    chunk_of = [j // chunk for j in wanted]
    first = len(rows)  # rows[first:] are active: targets in chunks after the current one
    # V[:, :, first:] = C_j * decay(j <- start of chunk c+1), the left factor of every matmul.
    # Without autograd it is updated in place (a fresh tensor of its size per chunk costs page
    # faults comparable to the math)
    V = C.new_empty(batch, d_inner, 0 if grad else len(rows), A.shape[1])  # [b d r n]
    flat = None if grad else C.new_empty(batch * d_inner * len(rows) * chunk)  # one [b d r p] block
    for c in range(chunk_of[-1], -1, -1):
        pos = slice(c * chunk, min((c + 1) * chunk, seq_len))
        steps_c, B_c = steps[:, pos], B_bar(pos)  # [b p d k], [b p d n]
        if first < len(rows):  # 1. sources in chunk c, targets in later chunks: one matmul
            to_end = _reverse_cumsum(steps_c)  # [b p d k] sum_{t=i..end of chunk c}
            chunk_decay = torch.exp(to_end[:, 0] * A)[:, :, None]  # [b d 1 n] decay over the whole chunk
            to_end = F.pad(to_end[:, 1:], (0, 0, 0, 0, 0, 1))  # sum_{t=i+1..end of chunk c}
            right = rearrange(torch.exp(to_end * A) * B_c, "b p d n -> b d n p")  # decay(end of c <- i) B_bar_i
            if grad:
                out[:, :, first:, pos] = V @ right
                V = V * chunk_decay
            else:  # into a reused contiguous buffer (a strided out= makes bmm loop over d_inner)
                block = flat[: V[:, :, first:].numel() // V.shape[-1] * right.shape[-1]]
                block = block.view(batch, d_inner, len(rows) - first, right.shape[-1])
                out[:, :, first:, pos] = torch.matmul(V[:, :, first:], right, out=block)
                V[:, :, first:] *= chunk_decay
        lo, hi = bisect_left(chunk_of, c), bisect_right(chunk_of, c)
        if lo < hi:  # 2. targets in chunk c: the sources of their own chunk, then nothing
            C_here = C[:, rows[lo:hi]]  # [b r n]
            entries, W_here = _own_chunk(torch.exp(steps_c * A), B_c, C_here, [j - c * chunk for j in wanted[lo:hi]])
            out[:, :, lo:hi, pos] = entries
            if grad:
                out[:, :, lo:hi, pos.stop :] = 0  # sources after the chunk
            V_here = rearrange(W_here * C_here[:, :, None], "b r d n -> b d r n")
            if grad:
                V = torch.cat([V_here, V], dim=2)
            else:
                V[:, :, lo:hi] = V_here
            first = lo
    return out


def _full_by_chunks(
    steps: Float[Tensor, "batch pos d_inner k"],
    A: Float[Tensor, "d_inner d_state"],
    B_bar: Callable[[slice], Float[Tensor, "batch p _d d_state"]],
    C: Float[Tensor, "batch pos d_state"],
    chunk: int,
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """The whole kernel without autograd, written once into a zeroed output (big_zeros).

    Same entries as _rows_by_chunks for every row, split at the start s of the targets' chunk z:
    decay(j <- i) = decay(j <- s) * decay(s <- i) for a source i < s, every factor <= 1. The
    right factors R[:, :, :, i] = decay(s <- i) B_bar_i are carried forwards, multiplied by the
    decay over each chunk (d_inner * d_state * pos^2 / (2 Q) multiplications), and one matmul
    per group of channels writes a band of rows, (C_j decay(j <- s)) @ R[..., :s], into a small
    contiguous block, then into the kernel (a strided out= makes bmm loop over channels, slower
    than the copy). Nothing above the diagonal is written: big_zeros' memory is zeroed by the OS,
    on huge pages where they pay (ops/big_buffer.py: page faults can cost as much as the math).
    """
    batch, seq_len, d_inner, _ = steps.shape
    d_state = A.shape[1]
    out = big_zeros((batch, d_inner, seq_len, seq_len), dtype=C.dtype, device=C.device)
    R = C.new_empty(batch, d_inner, d_state, seq_len)  # [b d n i] decay(start of chunk z <- i) B_bar_i
    group = max(1, GROUP_BYTES // (C.element_size() * batch * chunk * seq_len))  # channels per matmul
    block = C.new_empty(batch * min(group, d_inner) * chunk * seq_len)
    for start in range(0, seq_len, chunk):
        pos = slice(start, min(start + chunk, seq_len))
        steps_z, B_z, C_z = steps[:, pos], B_bar(pos), C[:, pos]  # [b p d k], [b p d n], [b p n]
        p = pos.stop - start
        entries, W = _own_chunk(torch.exp(steps_z * A), B_z, C_z, list(range(p)))
        out[:, :, pos, pos] = entries  # [b d p p], zero above the diagonal
        if start:  # sources before the chunk: (C_j decay(j <- start)) @ (decay(start <- i) B_bar_i)
            left = rearrange(W * C_z[:, :, None], "b p d n -> b d p n")
            for g in range(0, d_inner, group):
                ch = slice(g, min(g + group, d_inner))
                band = block[: batch * (ch.stop - g) * p * start].view(batch, ch.stop - g, p, start)
                out[:, ch, pos, :start] = torch.matmul(left[:, ch], R[:, ch, :, :start], out=band)
            R[..., :start] *= rearrange(W[:, -1], "b d n -> b d n 1")  # decay over chunk z
        to_end = F.pad(_reverse_cumsum(steps_z)[:, 1:], (0, 0, 0, 0, 0, 1))  # sum_{t=i+1..end of chunk z}
        R[..., pos] = rearrange(torch.exp(to_end * A) * B_z, "b p d n -> b d n p")
    return out


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _sorted_rows(
    rows: Int[Tensor, "row"], seq_len: int, what: str
) -> tuple[Int[Tensor, "row"], Int[Tensor, "row"] | None, list[int]]:
    """(rows sorted ascending, the permutation that sorts them or None when they are sorted already,
    the sorted positions as Python ints); positions must lie in [0, seq_len). One host read."""
    values = _positions_on_host(rows, seq_len, what)
    wanted = sorted(values)
    if values == wanted:
        return rows, None, wanted
    order = torch.argsort(rows, stable=True)
    return rows[order], order, wanted


def _unsort(out: Tensor, order: Tensor | None, dim: int) -> Tensor:
    """Undo _sorted_rows along dim: result.select(dim, order[k]) = out.select(dim, k)."""
    if order is None:
        return out
    result = torch.empty_like(out)
    result.index_copy_(dim, order.to(out.device), out)
    return result


def mamba1_kernel_chunked(
    dt: Float[Tensor, "batch pos d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    *,
    chunk_size: int | None = None,
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """Same result as selective_scan.mamba1_kernel, factorised at chunk boundaries (module docstring).

    Stable for any length and decay: every exponential is of a non-positive sum. Memory: the
    kernel plus O(batch * d_inner * d_state * (pos + chunk_size^2)). Without autograd the kernel
    is written into big_zeros memory (huge pages where they pay), with no temporary of its size;
    with autograd on, it is built out of place (slower, same numbers).

    Args:
        dt, A, B, C: as selective_scan. chunk_size: positions per chunk (speed only; None: about
            sqrt(pos)).
    Returns:
        kernel: [b, d, j, i], row = target j, column = source i; y_j = sum_i kernel[:, :, j, i] u_i.
    """
    seq_len = dt.shape[1]
    rows = torch.arange(seq_len, device=dt.device)
    chunk_size = chunk_size or _full_chunk(seq_len)
    B_bar = lambda s: dt[:, s, :, None] * B[:, s, None, :]  # noqa: E731
    if _needs_grad(dt, A, B, C):
        return _rows_by_chunks(dt[..., None], A, B_bar, C, rows, list(range(seq_len)), chunk_size)
    return _full_by_chunks(dt[..., None], A, B_bar, C, chunk_size)


def mamba1_kernel_discrete_chunked(
    A_bar: Float[Tensor, "batch pos d_inner d_state"],
    B_bar: Float[Tensor, "batch pos d_inner d_state"],
    C: Float[Tensor, "batch pos d_state"],
    *,
    chunk_size: int | None = None,
) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """mamba1_kernel_discrete for 0 < A_bar <= 1 (every unedited A_bar): log(A_bar) <= 0 factorises.

    Zeros, negatives or A_bar > 1 are refused (mamba1_kernel_discrete keeps its exact slow path
    for them): log 0 and signs do not factorise, and factors > 1 could overflow.
    """
    if not bool(((A_bar > 0) & (A_bar <= 1)).all()):
        raise ValueError("mamba1_kernel_discrete_chunked needs 0 < A_bar <= 1 everywhere; "
                         "use mamba1_kernel_discrete for zeros, negatives or growth")
    return _discrete_chunked(A_bar, B_bar, C, chunk_size)


def _discrete_chunked(A_bar: Float[Tensor, "batch pos d_inner d_state"],
                      B_bar: Float[Tensor, "batch pos d_inner d_state"], C: Float[Tensor, "batch pos d_state"],
                      chunk_size: int | None = None) -> Float[Tensor, "batch d_inner q_pos k_pos"]:
    """mamba1_kernel_discrete_chunked after its check (a caller that checked already reads the device once)."""
    seq_len = A_bar.shape[1]
    rows = torch.arange(seq_len, device=A_bar.device)
    ones = A_bar.new_ones(A_bar.shape[2:])
    chunk_size = chunk_size or _full_chunk(seq_len)
    if _needs_grad(A_bar, B_bar, C):
        return _rows_by_chunks(torch.log(A_bar), ones, lambda s: B_bar[:, s], C, rows, list(range(seq_len)), chunk_size)
    return _full_by_chunks(torch.log(A_bar), ones, lambda s: B_bar[:, s], C, chunk_size)


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
    sorted_rows, order, wanted = _sorted_rows(rows, dt.shape[1], "rows")
    out = _rows_by_chunks(dt[..., None], A, lambda s: dt[:, s, :, None] * B[:, s, None, :], C, sorted_rows,
                          wanted, chunk_size)
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
    sorted_cols, order, wanted = _sorted_rows(cols, seq_len, "cols")
    dt_rev = F.pad(dt.flip(1)[:, :-1], (0, 0, 1, 0))  # dt''_s = dt_{L-s}; s = 0 is never summed
    B_rev, C_rev = B.flip(1), C.flip(1)
    out = _rows_by_chunks(dt_rev[..., None], A, lambda s: C_rev[:, s, None, :], B_rev,
                          (seq_len - 1 - sorted_cols).flip(0), [seq_len - 1 - i for i in reversed(wanted)], chunk_size)
    out = rearrange(out.flip(2, 3), "b d c j -> b d j c")  # back to forward time, sorted cols ascending
    out = out * rearrange(dt[:, sorted_cols], "b c d -> b d 1 c")  # B_bar_i = dt_i * B_i
    return _unsort(out, order, dim=3)
