"""Mamba-2 kernel (the SSM as attention) at the cost of writing it: whole, chosen rows, chosen columns.

Glossary (as ssd.py): batch b, pos l (rows q_pos = target j, columns k_pos = source i), n_heads h,
n_groups g, d_state n; row r / col c: chosen targets / sources; chunk z: positions [z Q, (z+1) Q).

kernel[b, h, j, i] = (C_j . B_i) * exp(sum_{t=i+1..j} a_t) * dt_i with a = dt * A <= 0 per head
(zero for i > j). mamba2_kernel (ssd.py) builds exp(segsum) for the whole pos x pos matrix, a strided
cumsum over pos^2 entries and several pos^2 temporaries. Here, for the targets j of chunk z and a
source i before the chunk, the decay splits at the chunk's start,
    exp(sum_{t=i+1..j} a_t) = exp(sum_{t=zQ..j} a_t) * exp(sum_{t=i+1..zQ-1} a_t),
a rank-1 outer product of factors <= 1 (each sum is its own cumsum; nothing is exp(+S)); sources
inside the chunk take the stable segment sums. Each block of rows is written once, into the kernel.
The kernel from discrete (possibly edited) A_bar and B_bar takes the same blocks with
log(A_bar) as the log-decay when 0 < A_bar <= 1, and an exact cumulative product otherwise.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.big_buffer import big_zeros
from hooked.ops.ssd import _check_positions, segsum

CHUNK = 64  # rows per block of mamba2_kernel_chunked (speed only)


def _by_row_blocks(
    a: Float[Tensor, "batch n_heads pos"],
    CB_rows: Callable[[slice], Float[Tensor, "batch n_heads row k"]],
    source_factor: Float[Tensor, "batch n_heads pos"] | None,
    chunk_size: int,
    grad: bool,
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """kernel[b, h, j, i] = CB[j, i] * exp(sum_{t=i+1..j} a_t) * source_factor_i for a <= 0, one
    block of chunk_size rows at a time (module docstring). CB_rows(rows) gives the rows' CB for
    the sources up to the block's end. Without autograd each block is multiplied straight into a
    zeroed output (big_zeros: nothing above the diagonal is written, no pos x pos temporary)."""
    batch, n_heads, seq_len = a.shape
    shape = (batch, n_heads, seq_len, seq_len)
    out = a.new_empty(shape) if grad else big_zeros(shape, dtype=a.dtype, device=a.device)
    for start in range(0, seq_len, chunk_size):
        rows = slice(start, min(start + chunk_size, seq_len))
        stop = rows.stop
        CB = CB_rows(rows)  # [b h r stop]
        decay = torch.empty_like(CB)  # [b h r stop]
        if start:  # sources before the chunk: exp(into j) x exp(out of i up to the chunk start)
            into = torch.exp(a[..., rows].cumsum(-1))  # sum_{t=start..j}
            out_of = torch.exp(F.pad(a[..., 1:start].flip(-1).cumsum(-1).flip(-1), (0, 1)))  # sum_{t=i+1..start-1}
            if source_factor is not None:
                out_of = out_of * source_factor[..., :start]
            decay[..., :start] = into[..., :, None] * out_of[..., None, :]
        decay[..., start:] = torch.exp(segsum(a[..., rows]))  # 0 above the diagonal
        if source_factor is not None:
            decay[..., start:] *= source_factor[..., None, rows]
        if grad:
            out[:, :, rows, :stop] = CB * decay
            out[:, :, rows, stop:] = 0
        else:  # straight into the kernel
            torch.mul(CB, decay, out=out[:, :, rows, :stop])
    return out


def mamba2_kernel_chunked(
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """Same result as ssd.mamba2_kernel, one block of chunk_size rows at a time (module docstring).

    Memory: the kernel plus O(batch * n_heads * chunk_size * pos) per block.

    Args:
        dt, A, B, C: as ssd_sequential. chunk_size: rows per block (speed only).
    Returns:
        kernel: [b, h, j, i], row = target j, column = source i.
    """
    heads_per_group = dt.shape[-1] // B.shape[2]

    def CB_rows(rows: slice) -> Tensor:
        CB = einsum(C[:, rows], B[:, : rows.stop], "b j g n, b i g n -> b g j i")  # [b g r stop]
        return repeat(CB, "b g j i -> b (g k) j i", k=heads_per_group)

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (dt, A, B, C))
    return _by_row_blocks(rearrange(dt * A, "b l h -> b h l"), CB_rows, rearrange(dt, "b l h -> b h l"),
                          chunk_size, grad)


def mamba2_kernel_discrete_chunked(
    A_bar: Float[Tensor, "batch pos n_heads"],
    B_bar: Float[Tensor, "batch pos n_heads d_state"],
    C: Float[Tensor, "batch pos n_heads d_state"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """mamba2_kernel_discrete for 0 < A_bar <= 1 (every unedited A_bar): log(A_bar) <= 0 is the
    log-decay of mamba2_kernel_chunked, (C_j . B_bar_i) its CB times dt_i.

    Zeros, negatives or A_bar > 1 are refused (mamba2_kernel_discrete keeps its exact slow path
    for them): log 0 and signs do not factorise, and factors > 1 could overflow.

    Args:
        A_bar: decay per position and head (hook_A_bar). B_bar: dt * B per head (hook_B_bar).
        C: each head's C. chunk_size: rows per block (speed only).
    Returns:
        kernel: [b, h, j, i] = (C_j . B_bar_i) prod_{t=i+1..j} A_bar_t, zero for i > j.
    """
    if not bool(((A_bar > 0) & (A_bar <= 1)).all()):
        raise ValueError("mamba2_kernel_discrete_chunked needs 0 < A_bar <= 1 everywhere; "
                         "use mamba2_kernel_discrete for zeros, negatives or growth")
    return _discrete_chunked(A_bar, B_bar, C, chunk_size)


def _discrete_chunked(A_bar: Float[Tensor, "batch pos n_heads"], B_bar: Float[Tensor, "batch pos n_heads d_state"],
                      C: Float[Tensor, "batch pos n_heads d_state"],
                      chunk_size: int = CHUNK) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """mamba2_kernel_discrete_chunked after its check (a caller that checked already reads the device once)."""

    def CB_rows(rows: slice) -> Tensor:
        return einsum(C[:, rows], B_bar[:, : rows.stop], "b j h n, b i h n -> b h j i")

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (A_bar, B_bar, C))
    return _by_row_blocks(rearrange(torch.log(A_bar), "b l h -> b h l"), CB_rows, None, chunk_size, grad)


def mamba2_kernel_discrete(
    A_bar: Float[Tensor, "batch pos n_heads"],
    B_bar: Float[Tensor, "batch pos n_heads d_state"],
    C: Float[Tensor, "batch pos n_heads d_state"],
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """The kernel from discrete (possibly edited) A_bar, B_bar: (C_j . B_bar_i) prod_{t=i+1..j} A_bar_t.

    When 0 < A_bar <= 1 everywhere (every unedited A_bar, and edits that keep it a decay),
    mamba2_kernel_discrete_chunked. Otherwise the exact slow path: the product is a cumulative
    product down each column (no logarithm: an edited A_bar may be 0, negative or above 1), with
    pos x pos temporaries.

    Args:
        A_bar: decay per position and head (hook_A_bar). B_bar: dt * B per head (hook_B_bar).
        C: each head's C.
    Returns:
        kernel: [b, h, j, i], row = target j, column = source i.
    """
    if bool(((A_bar > 0) & (A_bar <= 1)).all()):
        return _discrete_chunked(A_bar, B_bar, C)  # checked here: one host read, not two
    return _discrete_by_cumprod(A_bar, B_bar, C)


def _discrete_by_cumprod(
    A_bar: Float[Tensor, "batch pos n_heads"],
    B_bar: Float[Tensor, "batch pos n_heads d_state"],
    C: Float[Tensor, "batch pos n_heads d_state"],
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """mamba2_kernel_discrete's exact slow path, for any A_bar (the dense reference of the chunked one)."""
    seq_len = A_bar.shape[1]
    below = torch.ones(seq_len, seq_len, dtype=torch.bool, device=A_bar.device).tril(-1)
    steps = repeat(A_bar, "b j h -> b h j i", i=seq_len).masked_fill(~below, 1.0)  # [j, i] = A_bar_j for j > i
    decay = steps.cumprod(dim=-2).tril()  # prod over i < t <= j; zero above the diagonal
    return einsum(C, B_bar, "b j h n, b i h n -> b h j i") * decay


def mamba2_kernel_rows(
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    rows: Int[Tensor, "row"],
) -> Float[Tensor, "batch n_heads row k_pos"]:
    """mamba2_kernel(dt, A, B, C)[:, :, rows, :] without the pos x pos matrix.

    Each row's decays are its own stable segment sums, sum_{t=i+1..j} dt_t A as a cumsum
    backwards from j (no difference of cumsums, no exp of a positive number). Cost and memory
    O(batch * rows * pos * (n_heads + n_groups * d_state)), linear in pos.

    Args:
        dt, A, B, C: as ssd_sequential. rows: target positions in [0, pos), any order, repeats ok.
    Returns:
        kernel_rows: [b, h, r, i] = kernel[b, h, rows[r], i], zero for i > rows[r].
    """
    seq_len, n_heads = dt.shape[1:]
    _check_positions(rows, seq_len, "rows")
    upto_j = torch.arange(seq_len, device=dt.device) <= rows[:, None]  # [r t] t <= j (also: i <= j)
    steps = rearrange(dt * A, "b t h -> b h 1 t").masked_fill(~upto_j, 0)  # [b h r t]
    seg = F.pad(steps[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # [.., i] = sum_{t=i+1..j}
    decay = torch.exp(seg).masked_fill(~upto_j, 0)
    CB = einsum(C[:, rows], B, "b r g n, b i g n -> b g r i")
    CB = repeat(CB, "b g r i -> b (g k) r i", k=n_heads // B.shape[2])
    return CB * decay * rearrange(dt, "b i h -> b h 1 i")


def mamba2_kernel_cols(
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    cols: Int[Tensor, "col"],
) -> Float[Tensor, "batch n_heads q_pos col"]:
    """mamba2_kernel(dt, A, B, C)[:, :, :, cols] without the pos x pos matrix.

    Each column's decays are a cumsum forwards from its source i. Cost and memory as
    mamba2_kernel_rows.

    Args:
        dt, A, B, C: as ssd_sequential. cols: source positions in [0, pos), any order, repeats ok.
    Returns:
        kernel_cols: [b, h, j, c] = kernel[b, h, j, cols[c]], zero for j < cols[c].
    """
    seq_len, n_heads = dt.shape[1:]
    _check_positions(cols, seq_len, "cols")
    t = torch.arange(seq_len, device=dt.device)
    after_i = t[:, None] > cols  # [t c] t >= i+1
    seg = rearrange(dt * A, "b t h -> b h t 1").masked_fill(~after_i, 0).cumsum(2)  # [b h j c] sum_{t=i+1..j}
    decay = torch.exp(seg).masked_fill(t[:, None] < cols, 0)  # zero for j < i
    CB = einsum(C, B[:, cols], "b j g n, b c g n -> b g j c")
    CB = repeat(CB, "b g j c -> b (g k) j c", k=n_heads // B.shape[2])
    return CB * decay * rearrange(dt[:, cols], "b c h -> b h 1 c")

