"""The gated delta rule as attention: the whole kernel, chosen rows and columns, chosen entries, knockout.

Glossary (as delta_rule.py): batch b, pos l, n_heads h (value heads), d_k c; rows q_pos = targets j,
columns k_pos = sources i; row r / col n: chosen targets / sources; pair k: one (batch, target, source).

With S0 = 0 the output is linear in v with one scalar weight per (target, source) pair, shared by every
value channel (the recurrence acts on each column of S alike):
    o_j = sum_{i <= j} A[j, i] v_i,   A[j, i] = beta_i q_j^T P(j <- i) k_i,
    P(j <- i) = M_j M_{j-1} ... M_{i+1}  (I for i = j),  M_t = (I - beta_t k_t k_t^T) Diag(alpha_t).
Convention (DESIGN.md section 4, as hook_pattern and the SSM kernels): A[b, h, j, i], row = target j (the
position that reads), column = source i (the position whose value is read), zero for i > j; the self
edge A[j, j] = beta_j q_j^T k_j. An initial state S0 adds S_{-1}'s read, P(j <- -1)^T q_j, which is not
in the kernel (as the D skip is not in the SSM kernel).

Every function uses the WY factors of delta_rule.ChunkFactors, chunk by chunk, so each entry is exact
(products of alphas and triangular solves, no logarithms):
    same chunk        A[j, i] = A_c[j, i]
    i before j's chunk  A[j, i] = Q_in_j^T P_{z-1} ... P_{c+1} K_out_i   (j in chunk z, i in chunk c)
The whole kernel carries every source's K_out forwards through the chunk transitions P (a [d_k, pos]
matrix), columns carry only the chosen sources, rows carry the chosen targets' Q_in backwards through
P^T: memory linear in pos for rows and columns, and no pos x pos matrix is built for them.
"""

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from hooked.ops.big_buffer import big_zeros
from hooked.ops.delta_rule import CHUNK, ChunkFactors, _check, chunk_inputs
from hooked.ops.ssd import _check_positions


def _inputs(q: Tensor, k: Tensor, beta: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Checks (with v's shape taken from beta) and the [batch n_heads pos ...] layout."""
    _check(q, k, beta[..., None], beta, alpha)
    return chunk_inputs(q, k, beta, alpha, beta.shape[2])


def _chunks(seq_len: int, chunk_size: int) -> list[slice]:
    return [slice(s, min(s + chunk_size, seq_len)) for s in range(0, seq_len, chunk_size)]


def delta_rule_kernel(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """The whole kernel A (module docstring): o = A v equals delta_rule_sequential with S0 = 0.

    Cost O(batch * n_heads * pos^2 * d_k), memory the kernel plus O(batch * n_heads * d_k * pos)
    (every source's key carried to the current chunk) plus one chunk's factors. Without autograd the
    kernel is written into zeroed memory (big_zeros), nothing above the diagonal is written.

    Args:
        q, k, beta, alpha: as delta_rule_sequential. chunk_size: positions per chunk (speed only).
    Returns:
        kernel: [b, h, j, i], row = target j, column = source i, zero for i > j.
    """
    q, k, beta, alpha = _inputs(q, k, beta, alpha)
    (batch, n_heads, seq_len), d_k = beta.shape, k.shape[-1]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, beta, alpha))
    shape = (batch, n_heads, seq_len, seq_len)
    if grad:
        rows = []
    else:
        out = big_zeros(shape, dtype=k.dtype, device=k.device)
    H = k.new_zeros(batch, n_heads, d_k, 0)  # [b h c i]: P(start of chunk <- i) beta_i k_i for earlier sources
    for pos in _chunks(seq_len, chunk_size):
        f = ChunkFactors(q[:, :, pos], k[:, :, pos], beta[:, :, pos], alpha[:, :, pos])
        block = torch.cat([f.Q_in @ H, f.A_c], dim=-1)  # [b h p stop]
        if grad:
            rows.append(torch.cat([block, block.new_zeros(*block.shape[:3], seq_len - pos.stop)], dim=-1))
        else:
            out[:, :, pos, : pos.stop] = block
        H = torch.cat([f.carry(H), f.K_out.mT], dim=-1)
    return torch.cat(rows, dim=2) if grad else out


def delta_rule_kernel_cols(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    cols: Int[Tensor, "col"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch n_heads q_pos col"]:
    """delta_rule_kernel(...)[:, :, :, cols] without the pos x pos matrix: where each source is read.

    Each chosen source's key is carried forwards from its chunk's end. Cost O(batch * n_heads *
    pos * (cols + chunk) * d_k), memory O(batch * n_heads * pos * cols) (the answer) plus one chunk.

    Args:
        q, k, beta, alpha: as delta_rule_sequential. cols: source positions in [0, pos), any order,
            repeats ok.
    Returns:
        kernel_cols: [b, h, j, n] = kernel[b, h, j, cols[n]], zero for j < cols[n].
    """
    q, k, beta, alpha = _inputs(q, k, beta, alpha)
    (batch, n_heads, seq_len), d_k = beta.shape, k.shape[-1]
    _check_positions(cols, seq_len, "cols")
    H = k.new_zeros(batch, n_heads, d_k, len(cols))  # chosen sources' keys; zero until their chunk
    blocks = []
    for pos in _chunks(seq_len, chunk_size):
        f = ChunkFactors(q[:, :, pos], k[:, :, pos], beta[:, :, pos], alpha[:, :, pos])
        here = ((cols >= pos.start) & (cols < pos.stop)).nonzero()[:, 0]
        local = cols[here] - pos.start
        block = f.Q_in @ H  # sources before the chunk (zero columns for later ones)
        block = block.index_copy(-1, here, f.A_c[..., local])
        blocks.append(block)
        H = f.carry(H).index_copy(-1, here, f.K_out.mT[..., local])
    return torch.cat(blocks, dim=2) if blocks else k.new_zeros(batch, n_heads, 0, len(cols))


def delta_rule_kernel_rows(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    rows: Int[Tensor, "row"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch n_heads row k_pos"]:
    """delta_rule_kernel(...)[:, :, rows, :] without the pos x pos matrix: what each target reads.

    The chunks are visited backwards; each chosen target's query enters at its own chunk as Q_in
    and is carried to earlier chunks through P^T. Cost and memory as delta_rule_kernel_cols.

    Args:
        q, k, beta, alpha: as delta_rule_sequential. rows: target positions in [0, pos), any order,
            repeats ok.
    Returns:
        kernel_rows: [b, h, r, i] = kernel[b, h, rows[r], i], zero for i > rows[r].
    """
    q, k, beta, alpha = _inputs(q, k, beta, alpha)
    (batch, n_heads, seq_len), d_k = beta.shape, k.shape[-1]
    _check_positions(rows, seq_len, "rows")
    R = k.new_zeros(batch, n_heads, d_k, len(rows))  # chosen targets' queries; zero until their chunk
    blocks = []
    for pos in reversed(_chunks(seq_len, chunk_size)):
        f = ChunkFactors(q[:, :, pos], k[:, :, pos], beta[:, :, pos], alpha[:, :, pos])
        here = ((rows >= pos.start) & (rows < pos.stop)).nonzero()[:, 0]
        local = rows[here] - pos.start
        block = R.mT @ f.K_out.mT  # [b h r p]: targets after the chunk (zero rows for earlier ones)
        block = block.index_copy(2, here, f.A_c[:, :, local])
        blocks.append(block)
        R = f.carry_back(R).index_copy(-1, here, f.Q_in.mT[..., local])
    return torch.cat(blocks[::-1], dim=-1) if blocks else k.new_zeros(batch, n_heads, len(rows), 0)


def delta_rule_kernel_pairs(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    batch_idx: Int[Tensor, "pair"],
    target: Int[Tensor, "pair"],
    source: Int[Tensor, "pair"],
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "pair n_heads"]:
    """delta_rule_kernel(...)[batch_idx, :, target, source] without the pos x pos matrix.

    The rows of the distinct targets (delta_rule_kernel_rows), read at the pairs: memory
    O(batch * n_heads * distinct targets * pos). Entries with source > target are 0.

    Args:
        q, k, beta, alpha: as delta_rule_sequential. batch_idx, target, source: one entry per pair.
    Returns:
        entries: [pair, n_heads].
    """
    seq_len = beta.shape[1]
    _check_positions(source, seq_len, "source")
    rows, which = torch.unique(target, return_inverse=True)
    kernel_rows = delta_rule_kernel_rows(q, k, beta, alpha, rows, chunk_size=chunk_size)  # [b h r l]
    return rearrange(kernel_rows, "b h r l -> b r l h")[batch_idx, which, source]


def delta_rule_knockout(
    o: Float[Tensor, "batch pos n_heads d_v"],
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    batch_idx: Int[Tensor, "pair"],
    target: Int[Tensor, "pair"],
    source: Int[Tensor, "pair"],
    heads: Int[Tensor, "head"] | None = None,
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch pos n_heads d_v"]:
    """o with the kernel edges (target j <- source i) removed: o_j - A[j, i] v_i for each pair.

    Row = target, column = source (module docstring). Each pair is one edge of one batch row, cut on
    every head (or the listed heads); a pair with source > target is no edge and changes nothing; a
    self edge (i == j) removes v_j's own write. Repeated pairs are cut once per repeat. Exact for
    S0 = 0 and any S0 (the state's read is not a kernel term). Nothing of size pos x pos is built.

    Args:
        o: the delta rule's output (hook_y) for these inputs. q, k, v, beta, alpha: as
            delta_rule_sequential. batch_idx, target, source: the edges. heads: value heads to cut
            (None: all).
    Returns:
        o minus the cut terms (a new tensor).
    """
    entries = delta_rule_kernel_pairs(q, k, beta, alpha, batch_idx, target, source, chunk_size=chunk_size)
    if heads is not None:
        keep = torch.zeros(entries.shape[1], dtype=torch.bool, device=entries.device)
        keep[heads] = True
        entries = entries * keep
    cut = entries[..., None] * v[batch_idx, source]  # [k h v]
    return o.index_put((batch_idx, target), -cut, accumulate=True)
