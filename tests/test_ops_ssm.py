"""Invariants of the SSM kernels in hooked.ops (float64 within 1e-10 unless stated).

sequential == fast scan == linear scan == kernel reconstruction, for Mamba-1 and Mamba-2;
pairwise kernel entries == full kernel; causal_conv1d == torch Conv1d; pairwise kernel never
builds a pos x pos tensor.
"""

import pytest
import torch
import torch.nn.functional as F
from einops import einsum
from torch.overrides import TorchFunctionMode

from hooked.ops import (
    causal_conv1d,
    linear_scan,
    linear_scan_heads,
    mamba1_kernel,
    mamba1_kernel_discrete,
    mamba1_kernel_pairs,
    mamba2_kernel,
    mamba2_kernel_pairs,
    segsum,
    segsum_naive,
    selective_scan,
    selective_scan_sequential,
    ssd_chunked,
    ssd_sequential,
    ssd_states,
)

EXACT = dict(atol=1e-10, rtol=1e-10)
LENGTHS = [1, 2, 17, 64, 300]


def mamba1_inputs(seq_len, batch=2, d_inner=3, d_state=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return dict(
        u=randn(batch, seq_len, d_inner),
        dt=F.softplus(randn(batch, seq_len, d_inner) - 1),
        A=-torch.exp(randn(d_inner, d_state)),
        B=randn(batch, seq_len, d_state),
        C=randn(batch, seq_len, d_state),
    )


def mamba2_inputs(seq_len, batch=2, n_heads=4, d_head=3, n_groups=2, d_state=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return dict(
        x=randn(batch, seq_len, n_heads, d_head),
        dt=F.softplus(randn(batch, seq_len, n_heads) - 1),
        A=-torch.exp(randn(n_heads)),
        B=randn(batch, seq_len, n_groups, d_state),
        C=randn(batch, seq_len, n_groups, d_state),
    )


def random_pairs(batch, seq_len, n_pairs, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch_idx = torch.randint(batch, (n_pairs,), generator=g)
    target = torch.randint(seq_len, (n_pairs,), generator=g)
    source = torch.randint(seq_len, (n_pairs,), generator=g)
    source[:3] = target[:3]  # self edges
    source[3:6] = (target[3:6] + 1).clamp(max=seq_len - 1)  # source > target (when possible)
    return batch_idx, target, source


# ---------------------------------------------------------------- Mamba-1


@pytest.mark.parametrize("seq_len", LENGTHS)
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_selective_scan_matches_sequential(seq_len, with_h0, chunk_size):
    inp = mamba1_inputs(seq_len)
    h0 = torch.randn(2, 3, 4, dtype=torch.float64) if with_h0 else None
    y_ref, h_ref = selective_scan_sequential(**inp, h0=h0)
    y, h = selective_scan(**inp, h0=h0, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(h, h_ref, **EXACT)


@pytest.mark.parametrize("seq_len", LENGTHS)
def test_mamba1_kernel_and_linear_scan_match_scan(seq_len):
    inp = mamba1_inputs(seq_len)
    u, dt, A, B, C = inp.values()
    y_ref, h_ref = selective_scan_sequential(**inp)
    kernel = mamba1_kernel(dt, A, B, C)
    torch.testing.assert_close(einsum(kernel, u, "b d j i, b i d -> b j d"), y_ref, **EXACT)
    assert (kernel.triu(1) == 0).all()
    A_bar = torch.exp(dt[..., None] * A)
    B_bar = dt[..., None] * B[:, :, None, :]
    states = linear_scan(A_bar, B_bar * u[..., None])
    torch.testing.assert_close(einsum(states, C, "b l d n, b l n -> b l d"), y_ref, **EXACT)
    torch.testing.assert_close(states[:, -1], h_ref, **EXACT)
    torch.testing.assert_close(mamba1_kernel_discrete(A_bar, B_bar, C), kernel, **EXACT)


@pytest.mark.parametrize("seq_len", [2, 17, 64])
def test_mamba1_kernel_discrete_any_sign(seq_len):
    """Edited A_bar with zeros and negative entries: K u still equals the scan of the edit."""
    inp = mamba1_inputs(seq_len, seed=1)
    u, dt, A, B, C = inp.values()
    A_bar = torch.exp(dt[..., None] * A)
    A_bar[:, 1::3] *= -1.0
    A_bar[:, 1::5, 0] = 0.0
    B_bar = dt[..., None] * B[:, :, None, :]
    states = linear_scan(A_bar, B_bar * u[..., None])
    y_ref = einsum(states, C, "b l d n, b l n -> b l d")
    kernel = mamba1_kernel_discrete(A_bar, B_bar, C)
    torch.testing.assert_close(einsum(kernel, u, "b d j i, b i d -> b j d"), y_ref, **EXACT)


def test_linear_scan_carries_state_edit_forward():
    """Editing h at position t == continuing the recurrence from the edited state."""
    inp = mamba1_inputs(40, seed=2)
    u, dt, A, B, C = inp.values()
    A_bar, X = torch.exp(dt[..., None] * A), dt[..., None] * B[:, :, None, :] * u[..., None]
    states = linear_scan(A_bar, X)
    t, delta = 11, torch.randn(2, 3, 4, dtype=torch.float64)
    rerun = linear_scan(A_bar[:, t + 1 :], X[:, t + 1 :], h0=states[:, t] + delta)
    edit = torch.zeros_like(states)
    edit[:, t] = delta
    edited = states + linear_scan(A_bar, edit)
    torch.testing.assert_close(edited[:, t + 1 :], rerun, **EXACT)
    torch.testing.assert_close(edited[:, :t], states[:, :t], **EXACT)


@pytest.mark.parametrize("seq_len", [1, 17, 64])
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_mamba1_kernel_pairs_match_full(seq_len, chunk):
    inp = mamba1_inputs(seq_len)
    u, dt, A, B, C = inp.values()
    kernel = mamba1_kernel(dt, A, B, C)
    batch_idx, target, source = random_pairs(2, seq_len, 40)
    entries = mamba1_kernel_pairs(dt, A, B, C, batch_idx, target, source, chunk=chunk)
    torch.testing.assert_close(entries, kernel[batch_idx, :, target, source], **EXACT)
    assert (entries[source > target] == 0).all()


def test_selective_scan_gradients_match_sequential():
    inp = {k: v.requires_grad_() for k, v in mamba1_inputs(20).items()}
    h0 = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y, h = selective_scan(**inp, h0=h0, chunk_size=8)
    y_ref, h_ref = selective_scan_sequential(**inp, h0=h0)
    leaves = [*inp.values(), h0]
    grads = torch.autograd.grad((y.sum() + h.sum()), leaves)
    grads_ref = torch.autograd.grad((y_ref.sum() + h_ref.sum()), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **EXACT)


# ---------------------------------------------------------------- Mamba-2


def test_segsum_matches_naive():
    x = torch.randn(2, 3, 33, dtype=torch.float64)
    torch.testing.assert_close(segsum(x), segsum_naive(x), **EXACT)
    above_diagonal = torch.ones(33, 33, dtype=torch.bool).triu(1)
    assert torch.equal(torch.isneginf(segsum(x)), above_diagonal.expand(2, 3, 33, 33))
    torch.testing.assert_close(segsum(x)[..., 5, 2], x[..., 3:6].sum(-1), **EXACT)


@pytest.mark.parametrize("seq_len", [1, 5, 17, 64])
@pytest.mark.parametrize("chunk_size", [1, 4, 16])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("n_groups", [1, 2])
def test_ssd_chunked_matches_sequential(seq_len, chunk_size, with_h0, n_groups):
    inp = mamba2_inputs(seq_len, n_groups=n_groups)
    h0 = torch.randn(2, 4, 3, 5, dtype=torch.float64) if with_h0 else None
    y_ref, h_ref = ssd_sequential(**inp, h0=h0)
    y, h = ssd_chunked(**inp, chunk_size=chunk_size, h0=h0)
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(h, h_ref, **EXACT)


@pytest.mark.parametrize("seq_len", [1, 17, 64])
def test_mamba2_kernel_and_states_match_scan(seq_len):
    inp = mamba2_inputs(seq_len)
    x, dt, A, B, C = inp.values()
    y_ref, h_ref = ssd_sequential(**inp)
    kernel = mamba2_kernel(dt, A, B, C)
    torch.testing.assert_close(einsum(kernel, x, "b h j i, b i h p -> b j h p"), y_ref, **EXACT)
    assert (kernel.triu(1) == 0).all()
    states = ssd_states(x, dt, A, B, C)
    C_heads = C.repeat_interleave(2, dim=2)  # 4 heads, 2 groups: head h reads group h // 2
    torch.testing.assert_close(einsum(states, C_heads, "b l h p n, b l h n -> b l h p"), y_ref, **EXACT)
    torch.testing.assert_close(states[:, -1], h_ref, **EXACT)


def test_ssd_states_with_h0_and_linear_scan_heads():
    inp = mamba2_inputs(9, seed=3)
    x, dt, A, B, C = inp.values()
    h0 = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    _, h_ref = ssd_sequential(**inp, h0=h0)
    states = ssd_states(x, dt, A, B, h0=h0)
    torch.testing.assert_close(states[:, -1], h_ref, **EXACT)
    edit = torch.zeros_like(states)
    edit[:, 4] = 1.0
    carried = linear_scan_heads(torch.exp(dt * A), edit)
    decay = torch.exp((dt[:, 5:] * A).cumsum(1))  # exp(sum_{t=5..j} dt_t A)
    torch.testing.assert_close(carried[:, 5:], decay[..., None, None].expand_as(carried[:, 5:]), **EXACT)


@pytest.mark.parametrize("seq_len", [1, 17, 64])
def test_mamba2_kernel_pairs_match_full(seq_len):
    inp = mamba2_inputs(seq_len)
    x, dt, A, B, C = inp.values()
    kernel = mamba2_kernel(dt, A, B, C)
    batch_idx, target, source = random_pairs(2, seq_len, 40)
    entries = mamba2_kernel_pairs(dt, A, B, C, batch_idx, target, source)
    torch.testing.assert_close(entries, kernel[batch_idx, :, target, source], **EXACT)
    assert (entries[source > target] == 0).all()


@pytest.mark.parametrize("seq_len", [7, 100, 300])
def test_ssd_chunked_float32_close_to_sequential(seq_len):
    inp = mamba2_inputs(seq_len, dtype=torch.float32, n_heads=8, d_head=16, d_state=16)
    y_ref, h_ref = ssd_sequential(**inp)
    y, h = ssd_chunked(**inp, chunk_size=64)
    torch.testing.assert_close(y, y_ref, atol=1e-5 * y_ref.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5 * h_ref.abs().max().item(), rtol=1e-5)


# ---------------------------------------------------------------- conv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("seq_len", [1, 3, 20])
def test_causal_conv1d_matches_torch_conv(dtype, width, with_bias, seq_len):
    channels = 6
    conv = torch.nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1, bias=with_bias)
    conv = conv.to(dtype)
    x = torch.randn(2, seq_len, channels, dtype=dtype)
    ref = conv(x.transpose(1, 2))[..., :seq_len].transpose(1, 2)
    bias = conv.bias.detach() if with_bias else None
    out = causal_conv1d(x, conv.weight.detach()[:, 0], bias)
    torch.testing.assert_close(out, ref.detach())
    # the formula, position by position
    w = conv.weight.detach()[:, 0]
    padded = F.pad(x, (0, 0, width - 1, 0))
    by_hand = sum(padded[:, k : k + seq_len] * w[:, k] for k in range(width))
    torch.testing.assert_close(out, by_hand + (bias if with_bias else 0))


# ---------------------------------------------------------------- memory


class LargestTensor(TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch function returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_largest_tensor_detects_full_kernel():
    inp = mamba1_inputs(128, batch=1, d_inner=4, d_state=2, dtype=torch.float32)
    with LargestTensor() as probe:
        mamba1_kernel(inp["dt"], inp["A"], inp["B"], inp["C"])
    assert probe.numel >= 4 * 128 * 128


@pytest.mark.parametrize("n_pairs", [1, 64])
def test_kernel_pairs_never_build_pos_by_pos(n_pairs):
    """At pos 2048 the full Mamba-1 kernel has 8 * 2048^2 entries; pairs stay far below 2048^2."""
    seq_len = 2048
    inp = mamba1_inputs(seq_len, batch=1, d_inner=8, d_state=4, dtype=torch.float32)
    batch_idx, target, source = random_pairs(1, seq_len, n_pairs)
    with LargestTensor() as probe:
        mamba1_kernel_pairs(inp["dt"], inp["A"], inp["B"], inp["C"], batch_idx, target, source)
    assert probe.numel < seq_len * seq_len // 16
    inp2 = mamba2_inputs(seq_len, batch=1, dtype=torch.float32)
    with LargestTensor() as probe:
        mamba2_kernel_pairs(inp2["dt"], inp2["A"], inp2["B"], inp2["C"], batch_idx, target, source)
    assert probe.numel < seq_len * seq_len // 16


# ---------------------------------------------------------------- HF numerics (float32)


def test_float32_parity_with_hf_torch_paths():
    m2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    m1 = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    inp = mamba2_inputs(100, n_heads=8, d_head=16, n_groups=2, d_state=16, dtype=torch.float32)
    ref = m2.mamba2_chunk_scan(*inp.values(), chunk_size=32)
    y, _ = ssd_chunked(**inp, chunk_size=32)
    torch.testing.assert_close(y, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)

    u, dt, A, B, C = mamba1_inputs(100, d_inner=32, d_state=16, dtype=torch.float32).values()
    ref = m1.mamba_selective_scan(u.mT, dt.mT, A, B.mT, C.mT)
    y, _ = selective_scan(u, dt, A, B, C)
    torch.testing.assert_close(y, ref.mT, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)


def test_shapes_are_checked_under_pytest():
    """pyproject runs jaxtyping + beartype on hooked: a mismatched A is refused."""
    inp = mamba1_inputs(5)
    inp["A"] = inp["A"][:2]
    with pytest.raises(TypeError, match="Type-check error"):
        selective_scan(**inp)


GRADCHECK_CASES = {
    "selective_scan": lambda u, dt, A, B, C: selective_scan(u, dt, A, B, C, chunk_size=2)[0],
    "mamba1_kernel": lambda u, dt, A, B, C: mamba1_kernel(dt, A, B, C),
    "mamba1_kernel_pairs": lambda u, dt, A, B, C: mamba1_kernel_pairs(
        dt, A, B, C, torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([1, 2])
    ),
}


@pytest.mark.parametrize("name", GRADCHECK_CASES)
def test_mamba1_gradients(name):
    inp = [t.requires_grad_() for t in mamba1_inputs(4, d_inner=2, d_state=2).values()]
    assert torch.autograd.gradcheck(GRADCHECK_CASES[name], inp)


def test_ssd_chunked_gradients():
    inp = [t.requires_grad_() for t in mamba2_inputs(5, n_heads=2, d_head=2, n_groups=1, d_state=2).values()]
    h0 = torch.randn(2, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: ssd_chunked(*a[:5], chunk_size=2, h0=a[5]), [*inp, h0])
