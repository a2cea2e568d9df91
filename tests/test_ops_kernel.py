"""The SSM kernel at the cost of a matmul, and its rows and columns (float64 within 1e-10).

Mamba-1: factorised (mamba1_kernel_chunked) == dense (mamba1_kernel) == the sequential
recurrence, across chunk boundaries and for extreme decays; Mamba-2: chunked == dense == the scan; the discrete kernels' fast
path (0 < A_bar <= 1) and slow path (zeros, negatives) == the recurrence (Mamba-1 and Mamba-2); written in place
(no autograd, big_zeros) == the autograd path; rows and columns == slices
of the whole kernel for Mamba-1 and Mamba-2; rows and columns never build a pos x pos tensor.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from einops import einsum, repeat
from test_ops_ssm import LargestTensor, mamba2_inputs
from torch.overrides import TorchFunctionMode

from hooked.ops import big_buffer
from hooked.ops import (
    mamba1_kernel,
    mamba1_kernel_chunked,
    mamba1_kernel_cols,
    mamba1_kernel_discrete,
    mamba1_kernel_discrete_chunked,
    mamba1_kernel_rows,
    mamba2_kernel,
    mamba2_kernel_chunked,
    mamba2_kernel_cols,
    mamba2_kernel_discrete,
    mamba2_kernel_discrete_chunked,
    mamba2_kernel_rows,
    ssd_sequential,
)
from hooked.ops.ssd_kernel import _discrete_by_cumprod

EXACT = dict(atol=1e-10, rtol=1e-10)
LENGTHS = [1, 2, 15, 16, 17, 33, 64, 300]  # around the chunk lengths 1, 7, 16
CHUNKS = [1, 7, 16]

# per case: dt from z ~ N(0, 1) [batch pos d_inner], A from w ~ N(0, 1) [d_inner d_state];
# a = dt * A <= 0 is the log-decay of one step, A_bar = exp(a)
DECAYS = {
    "random": (lambda z: F.softplus(z - 1), lambda w: -torch.exp(w)),
    "near_one": (lambda z: 1e-7 * torch.sigmoid(z), lambda w: -torch.exp(w)),  # A_bar > 1 - 1e-6
    "near_zero": (lambda z: 30 + F.softplus(z), lambda w: -1 - torch.exp(w)),  # A_bar < 1e-13
    # a ~ -3 per step: by pos 300 the total decay (e^-900) underflows and exp(+S) would overflow
    "underflow": (lambda z: 3 + 0.1 * torch.tanh(z), lambda w: -1 - 0.1 * torch.sigmoid(w)),
    # a < -500 per step: exp(+S) overflows within two steps
    "dt_huge": (lambda z: 1e3 * (1 + torch.sigmoid(z)), lambda w: -0.5 - torch.exp(w)),
}


@functools.cache
def mamba1_case(case: str, seq_len: int, batch: int = 2, d_inner: int = 3, d_state: int = 4):
    g = torch.Generator().manual_seed(seq_len)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dt_of, A_of = DECAYS[case]
    dt, A = dt_of(randn(batch, seq_len, d_inner)), A_of(randn(d_inner, d_state))
    B, C = randn(batch, seq_len, d_state), randn(batch, seq_len, d_state)
    A_bar, B_bar = torch.exp(dt[..., None] * A), dt[..., None] * B[:, :, None, :]
    return dt, A, B, C, kernel_by_recurrence(A_bar, B_bar, C)


def kernel_by_recurrence(A_bar, B_bar, C):
    """The oracle: every source's state run forward as the scan runs it, read by each target's C."""
    batch, seq_len, d_inner, d_state = A_bar.shape
    H = A_bar.new_zeros(batch, d_inner, d_state, seq_len)  # H[..., i] = prod_{t=i+1..j} A_bar_t B_bar_i
    rows = []
    for j in range(seq_len):
        H = H * A_bar[:, j, :, :, None]
        H[..., j] = B_bar[:, j]
        rows.append(einsum(H, C[:, j], "b d n i, b n -> b d i"))
    return torch.stack(rows, dim=2)  # [b d j i]


# ---------------------------------------------------------------- the whole Mamba-1 kernel


@pytest.mark.parametrize("case", DECAYS)
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_factorised_equals_dense_equals_recurrence(case, seq_len):
    dt, A, B, C, oracle = mamba1_case(case, seq_len)
    dense = mamba1_kernel(dt, A, B, C)
    torch.testing.assert_close(dense, oracle, **EXACT)
    for chunk in CHUNKS:
        kernel = mamba1_kernel_chunked(dt, A, B, C, chunk_size=chunk)
        assert kernel.isfinite().all()
        torch.testing.assert_close(kernel, oracle, **EXACT)
        assert (kernel.triu(1) == 0).all()


def test_extreme_cases_are_extreme():
    """The cases are what they claim: sums of a beyond float64's exp range (-745 underflows)."""
    dt, A, *_ = mamba1_case("underflow", 300)
    assert (dt.sum(1)[..., None] * A).max() < -745  # exp(S) == 0 and exp(-S) == inf
    dt, A, *_ = mamba1_case("dt_huge", 17)
    assert (dt[:, :2].sum(1)[..., None] * A).max() < -745  # within two steps
    dt, A, *_ = mamba1_case("near_one", 17)
    assert torch.exp(dt[..., None] * A).min() > 1 - 1e-6
    dt, A, *_ = mamba1_case("near_zero", 17)
    assert torch.exp(dt[..., None] * A).max() < 1e-13


@pytest.mark.parametrize("seq_len", [1, 2, 15, 16, 17, 64, 300])
@pytest.mark.parametrize("dt_scale", [1.0, 1e-7, 1e3])  # plain, decays near 1, exp(+S) overflowing
def test_mamba2_chunked_equals_dense_equals_scan(seq_len, dt_scale):
    inp = mamba2_inputs(seq_len)
    x, dt, A, B, C = inp["x"], dt_scale * inp["dt"], inp["A"], inp["B"], inp["C"]
    dense = mamba2_kernel(dt, A, B, C)
    y_ref, _ = ssd_sequential(x, dt, A, B, C)
    torch.testing.assert_close(einsum(dense, x, "b h j i, b i h p -> b j h p"), y_ref, **EXACT)
    for chunk in CHUNKS:
        kernel = mamba2_kernel_chunked(dt, A, B, C, chunk_size=chunk)
        assert kernel.isfinite().all()
        torch.testing.assert_close(kernel, dense, **EXACT)


class KernelSized(TorchFunctionMode):
    """Records the storages of every tensor a torch function returns with at least `numel` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("mapped", [False, True])  # torch.zeros / a huge-page mapping (big_zeros)
@pytest.mark.parametrize("seq_len", [1, 16, 17, 33, 300])
def test_written_in_place_equals_autograd_path(seq_len, mapped, monkeypatch):
    """Without autograd the kernel is written into its output (big_zeros); with it, built out of
    place; same numbers, and no other tensor of a quarter of the kernel's size is made."""
    if mapped:
        if not big_buffer.thp_offered():
            pytest.skip("no transparent huge pages to advise here")
        monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
        monkeypatch.setattr(big_buffer, "HUGE_PAGES", True)
    dt, A, B, C, oracle = mamba1_case("random", seq_len)
    for chunk in CHUNKS:
        with KernelSized(oracle.numel() // 4) as probe:
            kernel = mamba1_kernel_chunked(dt, A, B, C, chunk_size=chunk)
        if seq_len >= 8 * max(CHUNKS):  # (shorter: a band of chunk rows is itself a quarter)
            assert probe.storages == {kernel.untyped_storage().data_ptr()}
        assert kernel.untyped_storage().resizable() is not mapped  # mapped when asked
        leaves = [t.clone().requires_grad_() for t in (dt, A, B, C)]
        with_grad = mamba1_kernel_chunked(*leaves, chunk_size=chunk)
        assert with_grad.requires_grad
        torch.testing.assert_close(kernel, with_grad.detach(), **EXACT)
        torch.testing.assert_close(kernel, oracle, **EXACT)


# ---------------------------------------------------------------- the discrete kernel (edited A_bar, B_bar)


@pytest.mark.parametrize("seq_len", [1, 17, 64])
def test_discrete_fast_path_for_decays_in_0_1(seq_len):
    """Edits that keep 0 < A_bar <= 1 (here: scaled, some exactly 1) take the factorisation."""
    dt, A, B, C, _ = mamba1_case("random", seq_len)
    g = torch.Generator().manual_seed(1)
    A_bar = torch.exp(dt[..., None] * A) * torch.rand(dt.shape + A.shape[1:], generator=g, dtype=A.dtype)
    A_bar[:, ::5, 0] = 1.0
    B_bar = torch.randn(A_bar.shape, generator=g, dtype=A.dtype)  # any sign
    oracle = kernel_by_recurrence(A_bar, B_bar, C)
    torch.testing.assert_close(mamba1_kernel_discrete_chunked(A_bar, B_bar, C, chunk_size=7), oracle, **EXACT)
    torch.testing.assert_close(mamba1_kernel_discrete(A_bar, B_bar, C), oracle, **EXACT)


@pytest.mark.parametrize("edit", ["zero", "negative", "growth"])
def test_discrete_slow_path_for_other_decays(edit):
    dt, A, B, C, _ = mamba1_case("random", 33)
    A_bar, B_bar = torch.exp(dt[..., None] * A), dt[..., None] * B[:, :, None, :]
    A_bar[:, 3::4, 1] = {"zero": 0.0, "negative": -0.7, "growth": 1.3}[edit]
    oracle = kernel_by_recurrence(A_bar, B_bar, C)
    torch.testing.assert_close(mamba1_kernel_discrete(A_bar, B_bar, C), oracle, **EXACT)
    with pytest.raises(ValueError, match="0 < A_bar <= 1"):
        mamba1_kernel_discrete_chunked(A_bar, B_bar, C)


# per case: A_bar [batch pos n_heads] from u ~ U(0, 1) and the unedited exp(dt A)
MAMBA2_DISCRETE = {
    "scaled": lambda u, a_bar: a_bar * u,  # an edit that keeps a decay
    "ones": lambda u, a_bar: torch.where(u < 0.3, torch.ones_like(u), a_bar),  # exactly 1 here and there
    "near_one": lambda u, a_bar: 1 - 1e-7 * u,
    "near_zero": lambda u, a_bar: 1e-14 * (0.5 + u),
    "underflow": lambda u, a_bar: torch.exp(-3 - 0.1 * u),  # e^-900 by pos 300: exp(+S) would overflow
}


def mamba2_discrete_case(case, seq_len):
    """(A_bar, B_bar, C) per head, B_bar any sign, and the recurrence's kernel."""
    inp = mamba2_inputs(seq_len, n_groups=1)
    heads = inp["dt"].shape[-1]
    C = inp["C"].expand(-1, -1, heads, -1)
    a_bar = torch.exp(inp["dt"] * inp["A"])
    A_bar = MAMBA2_DISCRETE[case](torch.rand(a_bar.shape, generator=torch.Generator().manual_seed(5),
                                             dtype=a_bar.dtype), a_bar)
    B_bar = inp["dt"][..., None] * inp["B"].expand(-1, -1, heads, -1) * torch.linspace(-1, 2, heads)[:, None]
    oracle = mamba2_kernel_by_recurrence(A_bar, B_bar, C)
    return A_bar, B_bar, C, oracle


def mamba2_kernel_by_recurrence(A_bar, B_bar, C):
    """Every source's state run forward as linear_scan_heads runs it, read by each target's C."""
    batch, seq_len, n_heads, d_state = B_bar.shape
    H = B_bar.new_zeros(batch, n_heads, d_state, seq_len)  # H[..., i] = prod_{t=i+1..j} A_bar_t B_bar_i
    rows = []
    for j in range(seq_len):
        H = H * A_bar[:, j, :, None, None]
        H[..., j] = B_bar[:, j]
        rows.append(einsum(H, C[:, j], "b h n i, b h n -> b h i"))
    return torch.stack(rows, dim=2)  # [b h j i]


@pytest.mark.parametrize("case", MAMBA2_DISCRETE)
@pytest.mark.parametrize("seq_len", LENGTHS + [65])
def test_mamba2_discrete_chunked_equals_dense_equals_recurrence(case, seq_len):
    A_bar, B_bar, C, oracle = mamba2_discrete_case(case, seq_len)
    torch.testing.assert_close(_discrete_by_cumprod(A_bar, B_bar, C), oracle, **EXACT)
    torch.testing.assert_close(mamba2_kernel_discrete(A_bar, B_bar, C), oracle, **EXACT)
    for chunk in CHUNKS + [64]:
        kernel = mamba2_kernel_discrete_chunked(A_bar, B_bar, C, chunk_size=chunk)
        assert kernel.isfinite().all() and (kernel.triu(1) == 0).all()
        torch.testing.assert_close(kernel, oracle, **EXACT)


def test_mamba2_discrete_of_unedited_equals_the_kernel_from_dt():
    inp = mamba2_inputs(70)
    dt, A, B, C = inp["dt"], inp["A"], inp["B"], inp["C"]
    heads = dt.shape[-1]
    B_h, C_h = (repeat(t, "b l g n -> b l (g k) n", k=heads // t.shape[2]) for t in (B, C))
    kernel = mamba2_kernel_discrete(torch.exp(dt * A), dt[..., None] * B_h, C_h)
    torch.testing.assert_close(kernel, mamba2_kernel(dt, A, B, C), **EXACT)


def test_mamba2_discrete_extreme_cases_are_extreme():
    A_bar, *_ = mamba2_discrete_case("underflow", 300)
    assert torch.log(A_bar).sum(1).max() < -745
    assert mamba2_discrete_case("near_zero", 17)[0].max() < 1e-13
    assert mamba2_discrete_case("near_one", 17)[0].min() > 1 - 1e-6
    assert (mamba2_discrete_case("ones", 17)[0] == 1).any()


@pytest.mark.parametrize("edit", ["zero", "negative", "growth"])
def test_mamba2_discrete_slow_path_for_other_decays(edit):
    A_bar, B_bar, C, _ = mamba2_discrete_case("scaled", 33)
    A_bar = A_bar.clone()
    A_bar[:, 3::4, 1] = {"zero": 0.0, "negative": -0.7, "growth": 1.3}[edit]
    oracle = mamba2_kernel_by_recurrence(A_bar, B_bar, C)
    torch.testing.assert_close(mamba2_kernel_discrete(A_bar, B_bar, C), oracle, **EXACT)
    with pytest.raises(ValueError, match="0 < A_bar <= 1"):
        mamba2_kernel_discrete_chunked(A_bar, B_bar, C)


def test_mamba2_discrete_chunked_gradients():
    A_bar, B_bar, C, _ = mamba2_discrete_case("scaled", 5)
    leaves = [t[:1, :, :2, :2].clone().requires_grad_() for t in (A_bar[..., None], B_bar, C)]
    fn = lambda a, b, c: mamba2_kernel_discrete_chunked(a[..., 0], b, c, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves)


MAMBA2_WHOLE = {
    "from_dt": lambda A_bar, B_bar, C, dt, A, B, Cg, chunk: mamba2_kernel_chunked(dt, A, B, Cg, chunk_size=chunk),
    "discrete": lambda A_bar, B_bar, C, dt, A, B, Cg, chunk: mamba2_kernel_discrete_chunked(A_bar, B_bar, C,
                                                                                          chunk_size=chunk),
}


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("name", MAMBA2_WHOLE)
def test_mamba2_written_in_place_equals_autograd_path(name, mapped, monkeypatch):
    if mapped:
        if not big_buffer.thp_offered():
            pytest.skip("no transparent huge pages to advise here")
        monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
        monkeypatch.setattr(big_buffer, "HUGE_PAGES", True)
    inp = mamba2_inputs(150, n_groups=1)
    A_bar, B_bar, C, _ = mamba2_discrete_case("scaled", 150)
    args = [A_bar, B_bar, C, inp["dt"], inp["A"], inp["B"], inp["C"]]
    for chunk in [7, 16]:  # (a block of chunk rows stays below a quarter of the kernel)
        with KernelSized(C.shape[0] * C.shape[2] * 150**2 // 4) as probe:
            kernel = MAMBA2_WHOLE[name](*args, chunk)
        assert probe.storages == {kernel.untyped_storage().data_ptr()}
        assert kernel.untyped_storage().resizable() is not mapped
        with_grad = MAMBA2_WHOLE[name](*[t.clone().requires_grad_() for t in args], chunk)
        assert with_grad.requires_grad
        torch.testing.assert_close(kernel, with_grad.detach(), **EXACT)


# ---------------------------------------------------------------- rows and columns


def positions(seq_len, seed=0):
    """Unsorted, with a repeat, the first and the last position."""
    g = torch.Generator().manual_seed(seed)
    picked = torch.randint(seq_len, (4,), generator=g)
    return torch.cat([torch.tensor([seq_len - 1]), picked, picked[:1], torch.tensor([0])])


@pytest.mark.parametrize("case", ["random", "underflow"])
@pytest.mark.parametrize("seq_len", [1, 17, 64, 300])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_mamba1_rows_and_cols_are_slices(case, seq_len, chunk):
    dt, A, B, C, oracle = mamba1_case(case, seq_len)
    idx = positions(seq_len)
    torch.testing.assert_close(mamba1_kernel_rows(dt, A, B, C, idx, chunk_size=chunk), oracle[:, :, idx], **EXACT)
    torch.testing.assert_close(mamba1_kernel_cols(dt, A, B, C, idx, chunk_size=chunk), oracle[:, :, :, idx], **EXACT)


@pytest.mark.skipif(not big_buffer.thp_offered(), reason="no transparent huge pages to advise here")
@pytest.mark.parametrize("case", ["random", "underflow"])
def test_mamba1_rows_and_cols_into_mapped_zeros(case, monkeypatch):
    """Rows are written into big_zeros memory (sources after a row's chunk are left as its zeros)."""
    monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
    monkeypatch.setattr(big_buffer, "HUGE_PAGES", True)
    dt, A, B, C, oracle = mamba1_case(case, 300)
    idx = positions(300)
    rows = mamba1_kernel_rows(dt, A, B, C, idx, chunk_size=7)
    sorted_rows = mamba1_kernel_rows(dt, A, B, C, idx.sort().values, chunk_size=7)
    assert not sorted_rows.untyped_storage().resizable()  # the mapping itself (no reordering copy)
    torch.testing.assert_close(rows, oracle[:, :, idx], **EXACT)
    torch.testing.assert_close(sorted_rows, oracle[:, :, idx.sort().values], **EXACT)
    torch.testing.assert_close(mamba1_kernel_cols(dt, A, B, C, idx, chunk_size=7), oracle[:, :, :, idx], **EXACT)


@pytest.mark.parametrize("seq_len", [1, 17, 64, 300])
@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_rows_and_cols_are_slices(seq_len, n_groups):
    inp = mamba2_inputs(seq_len, n_groups=n_groups)
    dt, A, B, C = inp["dt"], inp["A"], inp["B"], inp["C"]
    kernel = mamba2_kernel(dt, A, B, C)
    idx = positions(seq_len)
    torch.testing.assert_close(mamba2_kernel_rows(dt, A, B, C, idx), kernel[:, :, idx], **EXACT)
    torch.testing.assert_close(mamba2_kernel_cols(dt, A, B, C, idx), kernel[:, :, :, idx], **EXACT)


def test_mamba2_rows_and_cols_with_huge_dt():
    """exp(+S) would overflow: each row's and column's own sums never need it."""
    inp = mamba2_inputs(40, seed=2)
    dt, A, B, C = 1e3 * inp["dt"], inp["A"], inp["B"], inp["C"]
    kernel, idx = mamba2_kernel(dt, A, B, C), positions(40)
    rows, cols = mamba2_kernel_rows(dt, A, B, C, idx), mamba2_kernel_cols(dt, A, B, C, idx)
    assert rows.isfinite().all() and cols.isfinite().all()
    torch.testing.assert_close(rows, kernel[:, :, idx], **EXACT)
    torch.testing.assert_close(cols, kernel[:, :, :, idx], **EXACT)


ROW_COL_FUNCS = {
    "mamba1_rows": (mamba1_kernel_rows, "mamba1"),
    "mamba1_cols": (mamba1_kernel_cols, "mamba1"),
    "mamba2_rows": (mamba2_kernel_rows, "mamba2"),
    "mamba2_cols": (mamba2_kernel_cols, "mamba2"),
}


@pytest.mark.parametrize("name", ROW_COL_FUNCS)
def test_rows_and_cols_never_build_pos_by_pos(name):
    """At pos 2048, 8 rows or columns of 8 channels stay far below one pos x pos tensor."""
    fn, family = ROW_COL_FUNCS[name]
    seq_len = 2048
    if family == "mamba1":
        g = torch.Generator().manual_seed(0)
        dt = F.softplus(torch.randn(1, seq_len, 8, generator=g))
        A = -torch.exp(torch.randn(8, 4, generator=g))
        B, C = torch.randn(1, seq_len, 4, generator=g), torch.randn(1, seq_len, 4, generator=g)
    else:
        inp = mamba2_inputs(seq_len, batch=1, dtype=torch.float32)
        dt, A, B, C = inp["dt"], inp["A"], inp["B"], inp["C"]
    idx = torch.arange(seq_len - 8, seq_len)
    with LargestTensor() as probe:
        out = fn(dt, A, B, C, idx)
    assert out.numel() == 8 * seq_len * dt.shape[-1]
    assert probe.numel < seq_len * seq_len // 16


@pytest.mark.parametrize("fn", [mamba1_kernel_rows, mamba1_kernel_cols, mamba2_kernel_rows, mamba2_kernel_cols])
def test_positions_out_of_range_are_refused(fn):
    if fn in (mamba1_kernel_rows, mamba1_kernel_cols):
        dt, A, B, C, _ = mamba1_case("random", 5)
    else:
        inp = mamba2_inputs(5)
        dt, A, B, C = inp["dt"], inp["A"], inp["B"], inp["C"]
    with pytest.raises(IndexError, match=r"must lie in \[0, 5\).*\[5\]"):
        fn(dt, A, B, C, torch.tensor([5]))


GRADCHECK_CASES = {
    "chunked": lambda dt, A, B, C: mamba1_kernel_chunked(dt, A, B, C, chunk_size=2),
    "rows": lambda dt, A, B, C: mamba1_kernel_rows(dt, A, B, C, torch.tensor([4, 1]), chunk_size=2),
    "cols": lambda dt, A, B, C: mamba1_kernel_cols(dt, A, B, C, torch.tensor([0, 3]), chunk_size=2),
}


@pytest.mark.parametrize("name", GRADCHECK_CASES)
def test_mamba1_factorised_gradients(name):
    dt, A, B, C, _ = mamba1_case("random", 5, d_inner=2, d_state=2)
    inp = [t.clone().requires_grad_() for t in (dt, A, B, C)]
    assert torch.autograd.gradcheck(GRADCHECK_CASES[name], inp)


def test_mamba2_chunked_gradients():
    inp = mamba2_inputs(5, n_heads=2, d_head=1, n_groups=1, d_state=2)
    leaves = [inp[k].clone().requires_grad_() for k in ("dt", "A", "B", "C")]
    assert torch.autograd.gradcheck(lambda *a: mamba2_kernel_chunked(*a, chunk_size=2), leaves)
