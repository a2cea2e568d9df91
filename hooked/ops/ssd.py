"""Mamba-2 state space duality (SSD): sequential oracle, chunked algorithm, kernel.

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch     b
    pos       l        T   sequence position; kernel rows q_pos = target j, columns k_pos = source i
                           (l / s: target / source position inside a chunk in ssd_chunked)
    n_heads   h        H   SSM heads; head h reads group h // (n_heads // n_groups)
    d_head    p        P   channels per head
    n_groups  g        G   groups sharing one B and one C
    d_state   n        N   state size
    chunk     c            chunk index in ssd_chunked (z: target chunk of step 3)
    pair      k            one (batch_idx, target, source) entry of a *_kernel_pairs call

Recurrence, per head (A is a scalar per head, dt already softplus'ed; the D skip is NOT here):
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t         h: [d_head d_state]
    y_t = h_t . C_t                                                 (sum over d_state)
As attention (DESIGN.md section 4), kernel[b, h, j, i] =
    (C_j . B_i) * exp(sum_{t=i+1..j} dt_t * A) * dt_i,   zero for i > j,   y_j = sum_i kernel[j, i] x_i.
"""

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from jaxtyping import Float, Int
from torch import Tensor


def segsum_naive(x: Float[Tensor, "*batch T"]) -> Float[Tensor, "*batch T T"]:
    """Segment sums by differences of one cumsum (the math; loses precision for long T).

    Returns:
        out[..., j, i] = sum_{t=i+1..j} x[..., t] for i <= j, -inf above the diagonal.
    """
    T = x.shape[-1]
    x_cumsum = torch.cumsum(x, dim=-1)
    out = x_cumsum[..., :, None] - x_cumsum[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~causal, -torch.inf)


def segsum(x: Float[Tensor, "*batch T"]) -> Float[Tensor, "*batch T T"]:
    """Stable segment sums: every entry is its own sum, no difference of large cumsums.

    Returns:
        out[..., j, i] = sum_{t=i+1..j} x[..., t] for i <= j, -inf above the diagonal
        (so exp(segsum(dt * A)) is the causal decay matrix). Costs O(T^2) memory.
    """
    T = x.shape[-1]
    x = repeat(x, "... t -> ... t i", i=T)  # [..., t, i] = x_t
    strictly_below = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)
    x = x.masked_fill(~strictly_below, 0)  # keep x_t only for t > i
    out = torch.cumsum(x, dim=-2)  # sum over i < t <= j
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~causal, -torch.inf)


def _linear_recurrence(A_bar: Tensor, X: Tensor, h: Tensor | None) -> Tensor:
    """states[:, t] = A_bar[:, t] * states[:, t-1] + X[:, t] (states[:, -1] = h), axis 1 = pos.

    A_bar broadcasts against X. Without autograd the states are written in place into one
    buffer (the fastest exact loop on CPU); with autograd a list of states is stacked.
    """
    seq_len = X.shape[1]
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (A_bar, X, h)
    )
    if grad:
        states = []
        for t in range(seq_len):
            h = X[:, t] if h is None else A_bar[:, t] * h + X[:, t]
            states.append(h)
        return torch.stack(states, dim=1)
    states = X.clone()  # overwritten in place, position by position
    A_bar_t, h_t = A_bar.unbind(1), states.unbind(1)  # views, made once
    if h is not None:
        h_t[0].addcmul_(A_bar_t[0], h)
    for t in range(1, seq_len):
        h_t[t].addcmul_(A_bar_t[t], h_t[t - 1])
    return states


def linear_scan_heads(
    A_bar: Float[Tensor, "batch pos n_heads"],
    X: Float[Tensor, "batch pos n_heads d_head d_state"],
    h0: Float[Tensor, "batch n_heads d_head d_state"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_head d_state"]:
    """Scan h_t = A_bar_t * h_{t-1} + X_t with one scalar decay per head.

    Use it on discrete or edited quantities (X = dt * x (outer) B), or to carry a state edit
    forward: an edit delta scanned with h0 = None gives the change of every later state.

    Args:
        A_bar: exp(dt * A), per position and head.
        X: the input added to the state at each position.
        h0: state before position 0 (zeros when None).
    Returns:
        states: h_t for every position t.
    """
    return _linear_recurrence(A_bar[..., None, None], X, h0)


def _heads_from_groups(
    BC: Float[Tensor, "batch pos n_groups d_state"], n_heads: int
) -> Float[Tensor, "batch pos n_heads d_state"]:
    """Repeat each group's B (or C) for its heads: head h reads group h // (n_heads // n_groups)."""
    n_groups = BC.shape[2]
    return repeat(BC, "b l g n -> b l (g r) n", r=n_heads // n_groups)


def ssd_sequential(
    x: Float[Tensor, "batch pos n_heads d_head"],
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    h0: Float[Tensor, "batch n_heads d_head d_state"] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Float[Tensor, "batch n_heads d_head d_state"]]:
    """The recurrence as a plain loop over positions: the test oracle.

    Args:
        x: SSM input per head. dt: step sizes (softplus'ed). A: negative decay rate per head.
        B, C: input and output projections per group. h0: initial state (zeros when None).
    Returns:
        y: C_t . h_t (no D skip), and h_last: the state after the last position.
    """
    batch, seq_len, n_heads, d_head = x.shape
    B, C = _heads_from_groups(B, n_heads), _heads_from_groups(C, n_heads)
    h = x.new_zeros(batch, n_heads, d_head, B.shape[-1]) if h0 is None else h0
    ys = []
    for t in range(seq_len):
        A_bar = torch.exp(dt[:, t] * A)  # [b h]
        B_bar_x = einsum(dt[:, t, :, None] * x[:, t], B[:, t], "b h p, b h n -> b h p n")
        h = A_bar[:, :, None, None] * h + B_bar_x
        ys.append(einsum(h, C[:, t], "b h p n, b h n -> b h p"))
    return torch.stack(ys, dim=1), h


def ssd_chunked(
    x: Float[Tensor, "batch pos n_heads d_head"],
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    chunk_size: int,
    h0: Float[Tensor, "batch n_heads d_head d_state"] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Float[Tensor, "batch n_heads d_head d_state"]]:
    """The SSD algorithm: quadratic inside chunks, a recurrence between them.

    Same result as ssd_sequential. Any length: padded inside to a multiple of chunk_size with
    dt = 0 (decay 1, no input), so the final state is unchanged by the padding; y is cropped.
    Numerics follow HF Mamba2Mixer.torch_forward (stable segsum inside chunks, cumsum
    differences for the chunk-end decays), in the dtype of the inputs.

    Args:
        as ssd_sequential; chunk_size: positions per chunk (HF's config.chunk_size).
    Returns:
        y (no D skip) and h_last, the state after the last real position.
    """
    batch, seq_len, n_heads, d_head = x.shape
    B, C = _heads_from_groups(B, n_heads), _heads_from_groups(C, n_heads)
    pad = (-seq_len) % chunk_size
    x = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # dt_i x_i: the Euler step
    A_dt = F.pad(dt * A, (0, 0, 0, pad))
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (B, C))
    x = rearrange(x, "b (c l) h p -> b c l h p", l=chunk_size)
    B, C = (rearrange(t, "b (c l) h n -> b c l h n", l=chunk_size) for t in (B, C))
    A_dt = rearrange(A_dt, "b (c l) h -> b h c l", l=chunk_size)
    A_cumsum = torch.cumsum(A_dt, dim=-1)  # [b h c l], log-decay from the chunk start

    # 1. Diagonal blocks: outputs from inputs of the same chunk (the kernel, chunk by chunk).
    decay = torch.exp(segsum(A_dt))  # [b h c l s]
    y_diag = einsum(C, B, decay, x, "b c l h n, b c s h n, b h c l s, b c s h p -> b c l h p")

    # 2. Intra-chunk states: each chunk's own inputs decayed to its last position.
    decay_to_end = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [b h c l]
    states = einsum(B, decay_to_end, x, "b c l h n, b h c l, b c l h p -> b c h p n")

    # 3. Inter-chunk recurrence: the state entering each chunk (and the final state).
    if h0 is None:
        h0 = x.new_zeros(batch, n_heads, d_head, B.shape[-1])
    states = torch.cat([h0[:, None].to(states.dtype), states], dim=1)  # [b c+1 h p n]
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[..., -1], (1, 0))))  # [b h z c], z: target
    states = einsum(decay_chunk, states, "b h z c, b c h p n -> b z h p n")
    states, h_last = states[:, :-1], states[:, -1]

    # 4. State -> output: the state entering each chunk, decayed to each position and read by C.
    decay_from_start = torch.exp(A_cumsum)  # [b h c l]
    y_off = einsum(C, states, decay_from_start, "b c l h n, b c h p n, b h c l -> b c l h p")

    y = rearrange(y_diag + y_off, "b c l h p -> b (c l) h p")
    return y[:, :seq_len], h_last


def ssd_states(
    x: Float[Tensor, "batch pos n_heads d_head"],
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"] | None = None,
    h0: Float[Tensor, "batch n_heads d_head d_state"] | None = None,
) -> Float[Tensor, "batch pos n_heads d_head d_state"]:
    """Every state h_t (for hook_h): linear_scan_heads(exp(dt*A), dt * x (outer) B, h0).

    Args:
        x, dt, A, B, h0: as ssd_sequential. C: accepted and ignored (states do not depend on
            it), so a call written like ssd_chunked's works.
    Returns:
        states: h_t after reading each position t.
    """
    B_bar_x = einsum(
        dt[..., None] * x, _heads_from_groups(B, x.shape[2]), "b l h p, b l h n -> b l h p n"
    )
    return linear_scan_heads(torch.exp(dt * A), B_bar_x, h0)


def mamba2_kernel(
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
    """The SSM as attention: kernel[b, h, j, i] = (C_j . B_i) exp(sum_{t=i+1..j} dt_t A) dt_i.

    Zero for i > j; y_j = sum_i kernel[:, :, j, i] * x_i equals the scan (no D skip).
    Costs O(batch * n_heads * pos^2) memory.

    Args:
        dt, A, B, C: as ssd_sequential.
    Returns:
        kernel: [b, h, j, i], row = target j, column = source i.
    """
    n_heads = dt.shape[-1]
    CB = einsum(C, B, "b j g n, b i g n -> b g j i")
    CB = repeat(CB, "b g j i -> b (g r) j i", r=n_heads // B.shape[2])
    decay = torch.exp(segsum(rearrange(dt * A, "b l h -> b h l")))  # zero above the diagonal
    return CB * decay * rearrange(dt, "b i h -> b h 1 i")


def mamba2_kernel_pairs(
    dt: Float[Tensor, "batch pos n_heads"],
    A: Float[Tensor, "n_heads"],
    B: Float[Tensor, "batch pos n_groups d_state"],
    C: Float[Tensor, "batch pos n_groups d_state"],
    batch_idx: Int[Tensor, "pair"],
    target: Int[Tensor, "pair"],
    source: Int[Tensor, "pair"],
) -> Float[Tensor, "pair n_heads"]:
    """mamba2_kernel(dt, A, B, C)[batch_idx, :, target, source] without the pos x pos matrix.

    Closed form exp(S_target - S_source) with S = cumsum(dt * A) over positions, summed in
    float64 so the difference keeps the input dtype's precision. Indices must lie in
    [0, pos); entries with source > target are 0. Memory O(pair * (n_heads + n_groups * d_state)).

    Args:
        dt, A, B, C: as ssd_sequential. batch_idx, target, source: one kernel entry per pair.
    Returns:
        entries: [pair, n_heads], every head's kernel at each (batch_idx, target, source).
    """
    n_heads, n_groups = dt.shape[-1], B.shape[2]
    S = torch.cumsum((dt * A).double(), dim=1)  # [b l h]
    causal = (source <= target)[:, None]
    gap = (S[batch_idx, target] - S[batch_idx, source]).to(dt.dtype)  # <= 0 where causal
    gap = gap.masked_fill(~causal, 0)  # masked before exp: never exp of a positive gap
    CB = einsum(C[batch_idx, target], B[batch_idx, source], "k g n, k g n -> k g")
    CB = repeat(CB, "k g -> k (g r)", r=n_heads // n_groups)
    entries = CB * torch.exp(gap) * dt[batch_idx, source]
    return entries.masked_fill(~causal, 0)



def _check_positions(positions: Int[Tensor, "k"], seq_len: int, what: str) -> None:
    """Refuse positions outside [0, seq_len), naming them (one host read of their extremes)."""
    if len(positions):
        lo, hi = torch.aminmax(positions)
        lo, hi = torch.stack([lo, hi]).tolist()
        if lo < 0 or hi >= seq_len:
            raise IndexError(f"{what} must lie in [0, {seq_len}) (the sequence length); got {positions.tolist()}")


def _positions_on_host(positions: Int[Tensor, "k"], seq_len: int, what: str) -> list[int]:
    """The positions as Python ints (the one host read), refused outside [0, seq_len) as _check_positions does."""
    values = positions.tolist()
    if any(v < 0 or v >= seq_len for v in values):
        raise IndexError(f"{what} must lie in [0, {seq_len}) (the sequence length); got {values}")
    return values
