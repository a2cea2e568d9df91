"""The gated delta rule's invariants in float64 (within 1e-12 of the reference's scale).

Chunked (WY) == sequential (outputs, final state, every state) across chunk boundaries and for extreme
decays and betas (alpha 0, near 0, near 1, 1; KDA channels mixing them; beta 0, 1, 2; edited alphas
that are negative or above 1); the kernel == its definition (explicit products of the transitions) ==
the rule run on identity values, and A v == o; rows, columns and pairs == slices of the kernel, never
a pos x pos tensor; knockout == zeroing dense kernel entries == rerunning with the sources' values
removed; a state edit == a brute-force recurrence that adds the edit, and a set state (entries fixed
to a value) == a brute-force recurrence that replaces them; autograd through the chunked
form == through the loop; grouped q/k heads == repeated heads; bad inputs refused.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from einops import einsum
from jaxtyping import TypeCheckError
from test_ops_ssm import LargestTensor

from hooked.ops import (
    delta_rule_carry,
    delta_rule_chunked,
    delta_rule_kernel,
    delta_rule_kernel_cols,
    delta_rule_kernel_pairs,
    delta_rule_kernel_rows,
    delta_rule_knockout,
    delta_rule_sequential,
    l2norm,
)

TOL = 1e-12
LENGTHS = [1, 2, 15, 16, 17, 33, 64, 100]
CHUNKS = [1, 7, 16, 64]

# alpha from u ~ U(0, 1) per [batch pos n_heads (d_k)]
DECAYS = {
    "random": lambda u: torch.exp(-3 * u),
    "one": lambda u: torch.ones_like(u),
    "near_one": lambda u: 1 - 1e-9 * u,
    "zero": lambda u: torch.zeros_like(u),
    "near_zero": lambda u: 1e-30 * u,
    "underflow": lambda u: 0.05 + 0.01 * u,  # the product over 300 positions underflows
    "edited": lambda u: 2.4 * u - 1.2,  # negative and > 1: what an edit to hook_alpha may write
}
BETAS = {
    "random": lambda u: u,
    "zero": lambda u: torch.zeros_like(u),
    "one": lambda u: torch.ones_like(u),
    "two": lambda u: 2 * torch.ones_like(u),  # OLMo-hybrid's largest (allow_neg_eigval)
}


@functools.cache
def inputs(seq_len: int, decay: str = "random", beta: str = "random", kda: bool = False, batch: int = 2,
           n_k_heads: int = 2, n_heads: int = 4, d_k: int = 5, d_v: int = 3, seed: int = 0) -> dict:
    """q, k normalised as the families do (q also scaled), v, beta, alpha and a random S0."""
    g = torch.Generator().manual_seed(seed * 1000 + seq_len)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    if kda:
        n_k_heads = n_heads  # KDA has one q/k head per value head
    q = l2norm(randn(batch, seq_len, n_k_heads, d_k)) * d_k**-0.5
    k = l2norm(randn(batch, seq_len, n_k_heads, d_k))
    alpha_shape = (batch, seq_len, n_heads, d_k) if kda else (batch, seq_len, n_heads)
    alpha = DECAYS[decay](rand(*alpha_shape))
    if kda and decay == "random":  # per-channel mixing: some channels forget at once, some never
        alpha[..., 0], alpha[..., 1] = 0.0, 1.0
    return dict(q=q, k=k, v=randn(batch, seq_len, n_heads, d_v), beta=BETAS[beta](rand(batch, seq_len, n_heads)),
                alpha=alpha, S0=randn(batch, n_heads, d_k, d_v))


def close(actual, expected, what=""):
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOL * scale, msg=lambda m: f"{what}: {m}")


def rule_args(inp):
    return inp["q"], inp["k"], inp["v"], inp["beta"], inp["alpha"]


def kernel_args(inp):
    return inp["q"], inp["k"], inp["beta"], inp["alpha"]


# ---------------------------------------------------------------- chunked == sequential
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_chunked_equals_sequential(seq_len, chunk, kda):
    inp = inputs(seq_len, kda=kda)
    o, S, states = delta_rule_sequential(*rule_args(inp), inp["S0"], return_states=True)
    o_c, S_c, states_c = delta_rule_chunked(*rule_args(inp), inp["S0"], chunk_size=chunk, return_states=True)
    close(o_c, o, "o")
    close(S_c, S, "final state")
    close(states_c, states, "states")
    close(states[:, -1], S, "last of the states")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("beta", list(BETAS))
@pytest.mark.parametrize("decay", list(DECAYS))
def test_chunked_equals_sequential_extremes(decay, beta, kda):
    seq_len = 33 if decay == "edited" else 300  # edited decays above 1 grow: keep them short
    inp = inputs(seq_len, decay, beta, kda)
    o, S, states = delta_rule_sequential(*rule_args(inp), inp["S0"], return_states=True)
    assert torch.isfinite(o).all()
    o_c, S_c, states_c = delta_rule_chunked(*rule_args(inp), inp["S0"], chunk_size=16, return_states=True)
    close(o_c, o, "o")
    close(S_c, S, "final state")
    close(states_c, states, "states")
    close(delta_rule_kernel(*kernel_args(inp), chunk_size=16), kernel_from_identity(inp), "kernel")


def test_empty_sequence():
    inp = inputs(3)
    args = [t[:, :0] for t in rule_args(inp)]
    for fn in (delta_rule_sequential, delta_rule_chunked):
        o, S = fn(*args, inp["S0"])
        assert o.shape == (2, 0, 4, 3)
        close(S, inp["S0"])


def test_grouped_heads_equal_repeated_heads():
    """Value head h reads q/k head h // (n_heads // n_k_heads), as HF's repeat_interleave."""
    inp = inputs(17)
    q, k, v, beta, alpha = rule_args(inp)
    rep = [t.repeat_interleave(2, dim=2) for t in (q, k)]
    close(delta_rule_chunked(q, k, v, beta, alpha)[0], delta_rule_sequential(*rep, v, beta, alpha)[0])
    close(delta_rule_kernel(q, k, beta, alpha), delta_rule_kernel(*rep, beta, alpha))


def test_autograd_chunked_equals_loop():
    inp = inputs(40, kda=True)
    grads = []
    for fn in (delta_rule_sequential, lambda *a: delta_rule_chunked(*a, chunk_size=16)):
        leaves = [t.clone().requires_grad_() for t in (*rule_args(inp), inp["S0"])]
        o, S = fn(*leaves)
        loss = (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() + S.square().sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for what, a, b in zip(("q", "k", "v", "beta", "alpha", "S0"), *grads):
        close(a, b, f"d/d{what}")


# ---------------------------------------------------------------- the kernel
def kernel_by_definition(inp):
    """A[j, i] = beta_i q_j^T M_j ... M_{i+1} k_i with the transitions M_t written out as matrices."""
    q, k, _, beta, alpha = rule_args(inp)
    batch, seq_len, n_heads = beta.shape
    q, k = (t.repeat_interleave(n_heads // t.shape[2], dim=2) for t in (q, k))
    d_k = k.shape[-1]
    a = alpha if alpha.ndim == 4 else alpha[..., None].expand(-1, -1, -1, d_k)
    eye = torch.eye(d_k, dtype=k.dtype)
    M = (eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]) @ torch.diag_embed(a)  # [b t h c c]
    A = k.new_zeros(batch, n_heads, seq_len, seq_len)
    for j in range(seq_len):
        P = eye.expand(batch, n_heads, d_k, d_k)  # P(j <- i), from i = j down
        for i in range(j, -1, -1):
            A[:, :, j, i] = beta[:, i] * einsum(q[:, j], P, k[:, i], "b h c, b h c e, b h e -> b h")
            P = P @ M[:, i]
    return A


def kernel_from_identity(inp):
    """The rule run with v_i = e_i (one value channel per source): o_j = A[j, :]."""
    seq_len, n_heads = inp["beta"].shape[1:]
    eye = torch.eye(seq_len, dtype=torch.float64).expand(inp["v"].shape[0], n_heads, seq_len, seq_len)
    o, _ = delta_rule_sequential(inp["q"], inp["k"], eye.permute(0, 2, 1, 3), inp["beta"], inp["alpha"])
    return o.permute(0, 2, 1, 3)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("seq_len", [1, 9, 17])
def test_kernel_equals_definition(seq_len, kda):
    inp = inputs(seq_len, kda=kda)
    A = delta_rule_kernel(*kernel_args(inp), chunk_size=4)
    close(A, kernel_by_definition(inp), "kernel vs definition")
    assert (A.triu(1) == 0).all()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_kernel_reconstructs_output(seq_len, chunk, kda):
    inp = inputs(seq_len, kda=kda)
    A = delta_rule_kernel(*kernel_args(inp), chunk_size=chunk)
    o, _ = delta_rule_sequential(*rule_args(inp))
    close(einsum(A, inp["v"], "b h j i, b i h v -> b j h v"), o, "A v")
    close(A, kernel_from_identity(inp), "kernel vs identity values")


def test_kernel_with_autograd_equals_without():
    inp = inputs(40, kda=True)
    plain = delta_rule_kernel(*kernel_args(inp), chunk_size=16)
    leaves = [t.clone().requires_grad_() for t in kernel_args(inp)]
    A = delta_rule_kernel(*leaves, chunk_size=16)
    close(A.detach(), plain)
    (grad_q,) = torch.autograd.grad(A[:, :, -1].sum(), leaves[:1])
    assert grad_q.abs().sum() > 0


POSITIONS = torch.tensor([32, 0, 9, 9, 16, 15, 31])  # unsorted, repeated, around the chunk length 16


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_rows_and_cols_are_slices(chunk, kda):
    inp = inputs(33, kda=kda)
    A = delta_rule_kernel(*kernel_args(inp))
    close(delta_rule_kernel_rows(*kernel_args(inp), POSITIONS, chunk_size=chunk), A[:, :, POSITIONS], "rows")
    close(delta_rule_kernel_cols(*kernel_args(inp), POSITIONS, chunk_size=chunk), A[..., POSITIONS], "cols")
    empty = torch.tensor([], dtype=torch.long)
    assert delta_rule_kernel_rows(*kernel_args(inp), empty).shape == (2, 4, 0, 33)
    assert delta_rule_kernel_cols(*kernel_args(inp), empty).shape == (2, 4, 33, 0)


def random_pairs(batch: int, seq_len: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, batch, (n,), generator=g), torch.randint(0, seq_len, (n,), generator=g),
            torch.randint(0, seq_len, (n,), generator=g))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_pairs_are_entries(kda):
    inp = inputs(33, kda=kda)
    batch_idx, target, source = random_pairs(2, 33, 50)
    A = delta_rule_kernel(*kernel_args(inp))
    entries = delta_rule_kernel_pairs(*kernel_args(inp), batch_idx, target, source, chunk_size=16)
    close(entries, A[batch_idx, :, target, source], "pairs")
    assert (entries[source > target] == 0).all()


@pytest.mark.parametrize("name", ["rows", "cols", "pairs", "knockout"])
def test_slices_never_build_pos_by_pos(name):
    """At pos 2048, 8 rows, columns or edges of 2 heads stay far below one pos x pos tensor."""
    seq_len = 2048
    inp = inputs(seq_len, batch=1, n_k_heads=1, n_heads=2, d_k=4, d_v=2)
    inp = {key: t.float() for key, t in inp.items()}
    idx = torch.arange(seq_len - 8, seq_len)
    zeros = torch.zeros_like(idx)
    with LargestTensor() as probe:
        if name == "rows":
            delta_rule_kernel_rows(*kernel_args(inp), idx)
        elif name == "cols":
            delta_rule_kernel_cols(*kernel_args(inp), idx)
        elif name == "pairs":
            delta_rule_kernel_pairs(*kernel_args(inp), zeros, idx.flip(0), idx)
        else:
            delta_rule_knockout(inp["v"], *rule_args(inp), zeros, idx.flip(0), idx)
    assert probe.numel < seq_len * seq_len // 16


def test_largest_tensor_sees_the_whole_kernel():
    inp = inputs(128, batch=1, n_k_heads=1, n_heads=1)
    with LargestTensor() as probe:
        delta_rule_kernel(*kernel_args(inp))
    assert probe.numel >= 128 * 128


@pytest.mark.parametrize("fn", [delta_rule_kernel_rows, delta_rule_kernel_cols])
def test_positions_out_of_range_are_refused(fn):
    inp = inputs(5)
    for bad in ([5], [-1]):
        with pytest.raises(IndexError, match="must lie in"):
            fn(*kernel_args(inp), torch.tensor(bad))


def test_mismatched_inputs_are_refused():
    q, k, v, beta, alpha = rule_args(inputs(5))
    shape_errors = (ValueError, TypeCheckError)  # under pytest jaxtyping names the axis first
    with pytest.raises(shape_errors, match="d_k|same shape"):
        delta_rule_chunked(q, k[..., :-1], v, beta, alpha)
    with pytest.raises(shape_errors, match="pos|beta"):
        delta_rule_sequential(q, k, v, beta[:, :-1], alpha)
    with pytest.raises(ValueError, match="per-channel alpha"):
        delta_rule_chunked(q, k, v, beta, alpha[..., None].expand(-1, -1, -1, 3))
    with pytest.raises(ValueError, match="multiple"):
        delta_rule_chunked(q, k, v[:, :, :3], beta[:, :, :3], alpha[:, :, :3])


# ---------------------------------------------------------------- knockout
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("heads", [None, [1, 3]])
def test_knockout_equals_zeroing_dense_entries(heads, kda):
    inp = inputs(33, kda=kda)
    batch_idx, target, source = random_pairs(2, 33, 60, seed=1)
    keep = torch.ones(2, 4, 33, 33, dtype=torch.float64)
    for b, j, i in set(zip(batch_idx.tolist(), target.tolist(), source.tolist())):
        keep[b, heads if heads is not None else slice(None), j, i] = 0
    unique = torch.tensor(sorted(set(zip(batch_idx.tolist(), target.tolist(), source.tolist())))).T
    A = delta_rule_kernel(*kernel_args(inp))
    o, _ = delta_rule_sequential(*rule_args(inp), inp["S0"])  # the state's read is no kernel term: kept
    state_read = o - einsum(A, inp["v"], "b h j i, b i h v -> b j h v")
    cut = delta_rule_knockout(o, *rule_args(inp), *unique, None if heads is None else torch.tensor(heads))
    close(cut, state_read + einsum(A * keep, inp["v"], "b h j i, b i h v -> b j h v"), "knockout")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_knockout_equals_rerun_without_the_sources(kda):
    """Cutting every edge into target j from the sources I == o_j of a run whose v_I are zero."""
    inp = inputs(40, kda=kda)
    target, sources = 37, [0, 5, 16, 17, 36, 37]  # across chunks, the self edge included
    o, _ = delta_rule_sequential(*rule_args(inp))
    v_removed = inp["v"].clone()
    v_removed[:, sources] = 0
    o_removed, _ = delta_rule_sequential(inp["q"], inp["k"], v_removed, inp["beta"], inp["alpha"])
    batch_idx = torch.tensor([0, 1]).repeat_interleave(len(sources))
    source = torch.tensor(sources).repeat(2)
    cut = delta_rule_knockout(o, *rule_args(inp), batch_idx, torch.full_like(source, target), source, chunk_size=16)
    close(cut[:, target], o_removed[:, target], "cut target")
    close(cut[:, :target], o[:, :target], "other targets")
    close(cut[:, target + 1 :], o[:, target + 1 :], "other targets")


def test_knockout_of_no_edge_changes_nothing():
    inp = inputs(9)
    o, _ = delta_rule_sequential(*rule_args(inp))
    cut = delta_rule_knockout(o, *rule_args(inp), torch.tensor([0]), torch.tensor([2]), torch.tensor([5]))
    assert torch.equal(cut, o)  # source after target: not an edge


# ---------------------------------------------------------------- state edits
def run_with_edits(inp, dS, fixed=None):
    """Brute force: the recurrence, adding dS_t to the state right after position t is read; where
    `fixed` is True the state is set to dS_t instead."""
    q, k, v, beta, alpha = rule_args(inp)
    n_heads = beta.shape[2]
    q, k = (t.repeat_interleave(n_heads // t.shape[2], dim=2) for t in (q, k))
    a = alpha[..., None] if alpha.ndim == 4 else alpha[..., None, None]
    S, outs, states = inp["S0"], [], []
    for t in range(v.shape[1]):
        S = a[:, t] * S
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - einsum(S, k[:, t], "b h c v, b h c -> b h v")))[:, :, None]
        S = S + dS[:, t] if fixed is None else torch.where(fixed[:, t], dS[:, t], S)
        states.append(S)
        outs.append(einsum(S, q[:, t], "b h c v, b h c -> b h v"))
    return torch.stack(outs, dim=1), S, torch.stack(states, dim=1)


def carried(inp, dS, fixed=None, chunk_size=16):
    """(change of every output, of the last state, of every state) from delta_rule_carry."""
    D = delta_rule_carry(inp["q"], inp["k"], inp["beta"], inp["alpha"], dS, fixed, chunk_size=chunk_size)
    q = inp["q"].repeat_interleave(inp["beta"].shape[2] // inp["q"].shape[2], dim=2)
    return einsum(D, q, "b l h c v, b l h c -> b l h v"), D[:, -1], D


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("edited", [[0], [20], [39], [5, 6, 30], list(range(40))])
def test_state_edit_equals_brute_force(edited, kda):
    inp = inputs(40, kda=kda)
    g = torch.Generator().manual_seed(3)
    dS = torch.zeros(2, 40, 4, 5, 3, dtype=torch.float64)
    dS[:, edited] = torch.randn(2, len(edited), 4, 5, 3, generator=g, dtype=torch.float64)
    o, S = delta_rule_chunked(*rule_args(inp), inp["S0"], chunk_size=16)
    do, dS_last, _ = carried(inp, dS)
    o_ref, S_ref, _ = run_with_edits(inp, dS)
    close(o + do, o_ref, "edited outputs")
    close(S + dS_last, S_ref, "edited final state")
    first = min(edited)
    assert (do[:, :first] == 0).all()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("where", ["one", "two", "all", "entries"])
def test_set_states_equal_brute_force(where, kda):
    """Entries set to values (the meaning of a hook_h edit): every state == the recurrence that replaces them."""
    inp = inputs(40, kda=kda)
    g = torch.Generator().manual_seed(6)
    values = torch.randn(2, 40, 4, 5, 3, generator=g, dtype=torch.float64)
    fixed = torch.zeros(2, 40, 4, 5, 3, dtype=torch.bool)
    if where == "one":
        fixed[:, 17] = True
    elif where == "two":
        fixed[:, [5, 22]] = True
    elif where == "all":
        fixed[:] = True
    else:  # some entries of some heads at a few positions: the set entries feed the continued ones beside them
        fixed[0, 9, 1, :2] = True
        fixed[1, 9, 3, :, 1] = True
        fixed[:, 30, 2, 4] = True
    _, _, states = delta_rule_sequential(*rule_args(inp), inp["S0"], return_states=True)
    o, _ = delta_rule_sequential(*rule_args(inp), inp["S0"])
    do, _, D = carried(inp, torch.where(fixed, values - states, 0.0), fixed)
    o_ref, _, states_ref = run_with_edits(inp, values, fixed)
    close(states + D, states_ref, "every state")
    close(o + do, o_ref, "outputs")
    close((states + D)[fixed], values[fixed], "the set entries")


def test_state_edit_equals_continuing_from_the_edited_state():
    """One edit at t: the outputs after t == the rule restarted at t + 1 from the edited S_t."""
    inp = inputs(40)
    t = 22
    _, _, states = delta_rule_sequential(*rule_args(inp), inp["S0"], return_states=True)
    edit = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    dS = torch.zeros_like(states)
    dS[:, t] = edit
    o, _ = delta_rule_sequential(*rule_args(inp), inp["S0"])
    do, _, _ = carried(inp, dS, chunk_size=64)
    after = [x[:, t + 1 :] for x in rule_args(inp)]
    o_after, _ = delta_rule_sequential(*after, states[:, t] + edit)
    close((o + do)[:, t + 1 :], o_after, "after the edit")
    q_t = inp["q"][:, t].repeat_interleave(2, dim=1)
    close((o + do)[:, t], einsum(states[:, t] + edit, q_t, "b h c v, b h c -> b h v"), "at the edit")
    close((o + do)[:, :t], o[:, :t], "before the edit")


def test_no_edit_changes_nothing():
    inp = inputs(9)
    do, dS, _ = carried(inp, torch.zeros(2, 9, 4, 5, 3, dtype=torch.float64))
    assert not do.any() and not dS.any()


def test_a_zero_edit_that_carries_a_gradient_gets_the_total_derivative():
    """e = 0 requiring grad (attribution patching): d o_j / d e_i is the transition from i to j, read by q_j."""
    inp = inputs(12)
    e = torch.zeros(2, 12, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    do, _, _ = carried(inp, e, chunk_size=4)
    do[:, 9].sum().backward()
    bump = torch.zeros_like(e)
    bump[:, 3] = 1.0
    dS_bumped = carried(inp, bump.detach())[0][:, 9].sum()  # the same edit by value: linear in e
    close((e.grad * bump).sum(), dS_bumped, "gradient through later states")


def test_underflowing_decay_stays_finite():
    """Products of alphas that underflow give zeros (as the loop), never NaN from log or division."""
    inp = inputs(300, "underflow", kda=True)
    A = delta_rule_kernel(*kernel_args(inp), chunk_size=64)
    assert torch.isfinite(A).all()
    assert A[:, :, -1, 0].abs().max() == 0
    o, _ = delta_rule_chunked(*rule_args(inp), chunk_size=64)
    assert torch.isfinite(o).all()
    assert F.l1_loss(o, delta_rule_sequential(*rule_args(inp))[0]) < TOL
