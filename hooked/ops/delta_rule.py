"""The gated delta rule (Gated DeltaNet; KDA of Kimi Linear): sequential oracle, chunked WY form, one step.

Glossary (shape word in annotations, letter in einops patterns, paper symbol):
    batch      b
    pos        l     t   sequence position; j a target (the position that reads), i a source
    n_heads    h         value heads: each has its own state, beta and decay
    n_k_heads  g         query/key heads; value head h reads q/k head h // (n_heads // n_k_heads)
                         (HF's repeat_interleave: consecutive value heads share a key head)
    d_k        c         key/query channels: the rows of the state
    d_v        v         value channels: the columns of the state
    channel    a         the decay's channel axis: 1 (Gated DeltaNet, one decay per head) or d_k (KDA)
    chunk      Q         positions per chunk of the WY form; p, s: positions inside one chunk

Paper symbols (Yang, Kautz, Hatamizadeh 2024 "Gated Delta Networks"; Kimi Linear 2025 for KDA), per head:
    S_t        [d_k d_v]  the state after reading position t (hook_h); S_{-1} = S0, zeros by default
    q_t, k_t   [d_k]      query and key. The families L2-normalise both (l2norm below) and scale q by
                          d_k^-1/2 before the rule; these functions take q and k as they are read
    v_t        [d_v]      value
    beta_t     scalar     write strength: sigmoid(b_t) (OLMo-hybrid: 2 sigmoid(b_t), in [0, 2])
    alpha_t    scalar or [d_k]  the decay exp(g_t), g_t <= 0 HF's log-space gate
                          (g = -exp(A_log) softplus(a + dt_bias)); KDA: one per key channel
    M_t = (I - beta_t k_t k_t^T) Diag(alpha_t)            the transition (scalar alpha: alpha_t (I - ...))
    S_t = M_t S_{t-1} + beta_t k_t v_t^T                  the recurrence
    o_t = S_t^T q_t                                      the output (hook_y, before gate and norm)
    P(j <- i) = M_j M_{j-1} ... M_{i+1}                  the transition after i through j (I for i = j)
The decay acts on the old state before the delta correction reads it, as HF's torch paths do:
S <- Diag(alpha) S, then S <- S + k (beta (v - S^T k))^T. For a scalar decay the order does not matter;
for KDA it does: (I - beta k k^T) Diag(alpha), not Diag(alpha) (I - beta k k^T).

Chunked (WY / UT-transform) form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length"), one chunk of positions s..e entered with state S (delta_rule_kernel.py uses the
same factors for the kernel): with D[j, i] = prod_{t=i+1..j} alpha_t (per channel, 1 for i = j),
G_j = prod_{t=s..j} alpha_t the decay from the chunk's start through j, G_out_i = D[e, i] the decay from
i to the chunk's end, and (I + T)^-1 one triangular inverse per chunk,
    T[j, i]    = beta_j k_j^T Diag(D[j, i]) k_i   for i < j (strictly lower; I + T is unit lower triangular)
    QK[j, i]   = q_j^T Diag(D[j, i]) k_i          for i <= j
    A_c        = QK (I + T)^-1 Diag(beta)         the chunk's own block of the kernel
    Q_in_j     = G_j * q_j - sum_i A_c[j, i] G_i * k_i     the query that reads S (P(j <- s-1)^T q_j)
    K_out_i    = beta_i (I + T)^-T (G_out * k) [i]         source i's key at the chunk's end (P(e <- i) beta_i k_i)
    o_j        = S^T Q_in_j + sum_{i in chunk} A_c[j, i] v_i
    S_end      = P S + K_out^T V,  P = Diag(G_e) - K_out^T (G * K) = P(e <- s-1)
Every decay is a product of alphas (a cumulative product down a masked matrix, no logarithm, no division),
so alpha = 0, alpha = 1 and edited (negative, > 1) alphas are exact, and nothing overflows that the
products themselves would not.
"""

import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float
from torch import Tensor

CHUNK = 64  # positions per chunk (HF's chunk_size)


def l2norm(x: Float[Tensor, "... d"], eps: float = 1e-6) -> Float[Tensor, "... d"]:
    """x / sqrt(sum x^2 + eps), HF's l2norm for Qwen3-Next, Qwen3.5 and OLMo-hybrid (the FLA form).

    HF computes it in float32 inside its kernel; Kimi Linear's copy divides by the square root
    instead of multiplying by rsqrt (the same number to a rounding).
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _per_head(x: Float[Tensor, "batch pos n_k_heads d"], n_heads: int) -> Float[Tensor, "batch pos n_heads d"]:
    """Repeat each q/k head for its value heads: head h reads q/k head h // (n_heads // n_k_heads)."""
    n_k_heads = x.shape[2]
    if n_heads % n_k_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of the q/k heads ({n_k_heads})")
    return x if n_k_heads == n_heads else x.repeat_interleave(n_heads // n_k_heads, dim=2)


def _channels(alpha: Float[Tensor, "batch pos n_heads *channel"]) -> Float[Tensor, "batch pos n_heads a"]:
    """The decay with an explicit channel axis: size 1 for one decay per head (Gated DeltaNet)."""
    return alpha[..., None] if alpha.ndim == 3 else alpha


def _check(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor) -> None:
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if beta.shape != v.shape[:3] or alpha.shape[:3] != v.shape[:3]:
        raise ValueError(f"beta {tuple(beta.shape)} and alpha {tuple(alpha.shape)} must start with v's "
                         f"[batch pos n_heads] {tuple(v.shape[:3])}")
    if alpha.ndim == 4 and alpha.shape[3] != k.shape[3]:
        raise ValueError(f"a per-channel alpha has d_k = {k.shape[3]} channels, got {alpha.shape[3]}")


def delta_rule_step(
    S: Float[Tensor, "batch n_heads d_k d_v"],
    q: Float[Tensor, "batch n_heads d_k"],
    k: Float[Tensor, "batch n_heads d_k"],
    v: Float[Tensor, "batch n_heads d_v"],
    beta: Float[Tensor, "batch n_heads"],
    alpha: Float[Tensor, "batch n_heads *channel"],
) -> tuple[Float[Tensor, "batch n_heads d_v"], Float[Tensor, "batch n_heads d_k d_v"]]:
    """One position of the recurrence (q, k already per value head): S' = M S + beta k v^T, o = S'^T q.

    Returns:
        (o, S'): the output and the state after reading the position.
    """
    decayed = (alpha[..., None, None] if alpha.ndim == 2 else alpha[..., None]) * S  # Diag(alpha) S
    delta = beta[..., None] * (v - einsum(decayed, k, "b h c v, b h c -> b h v"))  # beta (v - S^T k)
    S = decayed + k[..., None] * delta[..., None, :]
    return einsum(S, q, "b h c v, b h c -> b h v"), S


def delta_rule_sequential(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    S0: Float[Tensor, "batch n_heads d_k d_v"] | None = None,
    *,
    return_states: bool = False,
) -> tuple[Tensor, ...]:
    """The recurrence as a plain loop over positions: the test oracle (exact for any alpha and beta).

    Args:
        q, k: queries and keys as read (already normalised and scaled), per q/k head.
        v: values per value head. beta: write strength. alpha: decay, [b l h] or per key channel
            [b l h d_k] (KDA). S0: the state before position 0 (zeros when None).
        return_states: also return S_t for every position (hook_h).
    Returns:
        (o [b l h d_v], S_last [b h d_k d_v]) and, with return_states, states [b l h d_k d_v].
    """
    _check(q, k, v, beta, alpha)
    batch, seq_len, n_heads, d_v = v.shape
    q, k = _per_head(q, n_heads), _per_head(k, n_heads)
    S = v.new_zeros(batch, n_heads, k.shape[-1], d_v) if S0 is None else S0
    outs, states = [], []
    for t in range(seq_len):
        o_t, S = delta_rule_step(S, q[:, t], k[:, t], v[:, t], beta[:, t], alpha[:, t])
        outs.append(o_t)
        if return_states:
            states.append(S)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    if not return_states:
        return o, S
    return o, S, (torch.stack(states, dim=1) if states else v.new_zeros(batch, 0, n_heads, k.shape[-1], d_v))


def _decayed_dot(
    x: Float[Tensor, "batch n_heads p d_k"],
    D: Float[Tensor, "batch n_heads p s a"],
    y: Float[Tensor, "batch n_heads s d_k"],
) -> Float[Tensor, "batch n_heads p s"]:
    """[j, i] = x_j^T Diag(D[j, i]) y_i (one matmul when the decay is one per head)."""
    if D.shape[-1] == 1:
        return (x @ y.mT) * D[..., 0]
    return einsum(x, D, y, "b h p c, b h p s c, b h s c -> b h p s")


class ChunkFactors:
    """The WY factors of one chunk (module docstring), layout [batch n_heads ...].

    D [b h Q Q a] segment decays, G [b h Q a] decay from the chunk's start, A_c [b h Q Q] the
    chunk's block of the kernel, Q_in [b h Q d_k], K_out [b h Q d_k], G_e [b h a] the decay over
    the whole chunk, GK = G * k [b h Q d_k], and inv = (I + T)^-1 [b h Q Q] (for the states).
    """

    def __init__(self, q: Tensor, k: Tensor, beta: Tensor, alpha: Tensor) -> None:
        # q, k [b g Q c] per q/k head (repeated here, one chunk at a time), beta [b h Q], alpha [b h Q a]
        n_heads, size = beta.shape[1], q.shape[2]
        if q.shape[1] != n_heads:
            q, k = (x.repeat_interleave(n_heads // x.shape[1], dim=1) for x in (q, k))
        below = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)  # [j i] j > i
        steps = torch.where(below[..., None], alpha[:, :, :, None, :], 1.0)  # [b h j i a]: alpha_j for j > i
        D = steps.cumprod(dim=2) * below.logical_or(torch.eye(size, dtype=torch.bool, device=q.device))[..., None]
        G = alpha.cumprod(dim=2)  # prod_{t=s..j}
        G_out = D[:, :, -1]  # [b h i a] prod_{t=i+1..e}
        eye = torch.eye(size, dtype=q.dtype, device=q.device)
        IT = _decayed_dot(k, D, k) * beta[..., None] * below + eye  # I + T
        # one solve for the inverse, then matmuls (cheaper than a solve per right-hand side on CPU)
        inv = torch.linalg.solve_triangular(IT, eye.expand_as(IT), upper=False, unitriangular=True)
        QK = _decayed_dot(q, D, k)  # lower triangular, diagonal included (D is 0 above it)
        A_c = (QK @ inv) * beta[:, :, None, :]  # QK (I + T)^-1 Diag(beta)
        self.GK = G * k
        self.Q_in = G * q - A_c @ self.GK
        self.K_out = beta[..., None] * (inv.mT @ (G_out * k))  # Diag(beta) (I + T)^-T (G_out * k)
        self.D, self.G, self.A_c, self.G_e, self.inv, self.k = D, G, A_c, G[:, :, -1], inv, k

    def carry(self, S: Float[Tensor, "batch n_heads d_k n"]) -> Float[Tensor, "batch n_heads d_k n"]:
        """P S = G_e * S - K_out^T (GK S): a state (or any columns) carried from the chunk's start to its end."""
        return self.G_e[..., None] * S - self.K_out.mT @ (self.GK @ S)

    def carry_back(self, R: Float[Tensor, "batch n_heads d_k n"]) -> Float[Tensor, "batch n_heads d_k n"]:
        """P^T R = G_e * R - GK^T (K_out R): query vectors carried from the chunk's end to its start."""
        return self.G_e[..., None] * R - self.GK.mT @ (self.K_out @ R)


def chunk_inputs(
    q: Tensor, k: Tensor, beta: Tensor, alpha: Tensor, n_heads: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every tensor in the [batch heads pos ...] layout of ChunkFactors; q and k keep their q/k heads
    (ChunkFactors repeats them per chunk, so no [pos n_heads d_k] copy is made)."""
    if n_heads % q.shape[2]:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of the q/k heads ({q.shape[2]})")
    q, k = (rearrange(x, "b l g c -> b g l c") for x in (q, k))
    return q, k, rearrange(beta, "b l h -> b h l"), rearrange(_channels(alpha), "b l h a -> b h l a")


def delta_rule_chunked(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    S0: Float[Tensor, "batch n_heads d_k d_v"] | None = None,
    *,
    chunk_size: int = CHUNK,
    return_states: bool = False,
) -> tuple[Tensor, ...]:
    """The chunked (WY) form: one triangular inverse and a few matmuls per chunk, the state carried between.

    Same result as delta_rule_sequential (module docstring), for any length (the last chunk is
    shorter; nothing is padded), in the dtype of the inputs.

    Args:
        as delta_rule_sequential; chunk_size: positions per chunk (speed only).
    Returns:
        (o, S_last) and, with return_states, every S_t [b l h d_k d_v] (O(chunk) work per state).
    """
    _check(q, k, v, beta, alpha)
    batch, seq_len, n_heads, d_v = v.shape
    q, k, beta_h, alpha_h = chunk_inputs(q, k, beta, alpha, n_heads)
    v = rearrange(v, "b l h v -> b h l v")
    S = v.new_zeros(batch, n_heads, k.shape[-1], d_v) if S0 is None else S0
    outs, states = [], []
    for start in range(0, seq_len, chunk_size):
        pos = slice(start, min(start + chunk_size, seq_len))
        f = ChunkFactors(q[:, :, pos], k[:, :, pos], beta_h[:, :, pos], alpha_h[:, :, pos])
        outs.append(f.Q_in @ S + f.A_c @ v[:, :, pos])
        if return_states:
            states.append(_chunk_states(f, beta_h[:, :, pos], v[:, :, pos], S))
        S = f.carry(S) + f.K_out.mT @ v[:, :, pos]
    o = torch.cat(outs, dim=2) if outs else v
    o = rearrange(o, "b h l v -> b l h v")
    if not return_states:
        return o, S
    return o, S, (torch.cat(states, dim=1) if states else v.new_zeros(batch, 0, n_heads, k.shape[-1], d_v))


def _chunk_states(
    f: ChunkFactors, beta: Tensor, v: Tensor, S: Tensor
) -> Float[Tensor, "batch p n_heads d_k d_v"]:
    """S_j for each position of the chunk: Diag(G_j) S + sum_{i <= j} Diag(D[j, i]) k_i w_i^T with the
    WY values W = (I + T)^-1 Diag(beta) (V - (G k) S) (the corrections the delta rule writes)."""
    W = f.inv @ (beta[..., None] * (v - f.GK @ S))
    if f.D.shape[-1] == 1:
        written = einsum(f.D[..., 0], f.k, W, "b h j i, b h i c, b h i v -> b h j c v")
    else:
        written = einsum(f.D, f.k, W, "b h j i c, b h i c, b h i v -> b h j c v")
    return rearrange(f.G[..., None] * S[:, :, None] + written, "b h j c v -> b j h c v")


def delta_rule_carry(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    dS: Float[Tensor, "batch pos n_heads d_k d_v"],
    fixed: Bool[Tensor, "batch pos n_heads *fixed"] | None = None,
    *,
    chunk_size: int = CHUNK,
) -> Float[Tensor, "batch pos n_heads d_k d_v"]:
    """How edits of the states S_t (hook_h) change every state: D_t = S'_t - S_t.

    The recurrence is affine in S, so D_t = M_t D_{t-1} + dS_t (D_{-1} = 0): an edit at t changes
    S_t and every later state exactly as if the rule had continued from the edited state. Entries in
    `fixed` (bool, as dS) are set, not continued: there D_t = dS_t, the edited value minus the
    original (hooked/state_edit.py). Between the positions with an edit or a fixed entry D runs
    through the chunked rule with v = 0; the output changes by D_t^T q_t.

    Args:
        q, k, beta, alpha: as delta_rule_sequential. dS: edited minus original state per position
            (zero where nothing was edited; a dS that requires grad is visited at every position, so
            that its gradient is the total derivative). fixed: the set entries, broadcast against dS (None: none).
    Returns:
        D: the change of every state [b l h d_k d_v].
    """
    batch, seq_len, n_heads, d_k, d_v = dS.shape
    visit = dS.detach().ne(0) if fixed is None else dS.detach().ne(0) | fixed
    if dS.requires_grad and torch.is_grad_enabled():
        visit = torch.ones_like(visit)
    visited = visit.flatten(2).any(dim=(0, 2)).nonzero()[:, 0].tolist()
    if not visited:
        return torch.zeros_like(dS)
    q, k = _per_head(q, n_heads), _per_head(k, n_heads)
    no_input = dS.new_zeros(batch, n_heads, d_v)
    D = dS.new_zeros(batch, n_heads, d_k, d_v)
    runs = [dS.new_zeros(batch, visited[0], n_heads, d_k, d_v)]
    for n, t in enumerate(visited):
        if n:  # one step of the recurrence into t (no input), then the edit
            D = delta_rule_step(D, q[:, t], k[:, t], no_input, beta[:, t], alpha[:, t])[1]
            if fixed is not None:
                D = D.masked_fill(fixed[:, t], 0.0)
        D = D + dS[:, t]
        runs.append(D[:, None])
        stop = visited[n + 1] if n + 1 < len(visited) else seq_len
        if stop > t + 1:  # nothing set in (t, stop): the rule with v = 0 from D
            run = slice(t + 1, stop)
            v0 = dS.new_zeros(batch, stop - t - 1, n_heads, d_v)
            _, D, states = delta_rule_chunked(q[:, run], k[:, run], v0, beta[:, run], alpha[:, run], D,
                                              chunk_size=chunk_size, return_states=True)
            runs.append(states)
    return torch.cat(runs, dim=1)
