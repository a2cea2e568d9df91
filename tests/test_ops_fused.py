"""The fused-kernel wrappers (hooked/ops/fused.py) and the stand-ins of the kernels' semantics.

On CPU: each stand-in (fused_reference.py) equals an independent computation of the kernel's
documented semantics (the sequential scans, torch's Conv1d, HF's torch reference of the Mamba-1
scan), with every optional argument; each wrapper forced onto the stand-ins equals the op it
replaces (float64 within 1e-12, float32 within 1e-5), passes the kernels' layout ([b c l]) and
dtypes, and falls back to our own op where a kernel cannot take the call. On CUDA with mamba-ssm /
causal-conv1d installed (gpu-marked, skipped otherwise): the real kernels equal the stand-ins on
the same arguments, and the wrappers equal our ops (float32 within 1e-5, bfloat16 within 2e-2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from hooked.ops.conv import causal_conv1d
from hooked.ops.fused import (
    REFERENCE,
    Kernels,
    causal_conv1d_fused,
    fused_available,
    mamba_ssm_kernels,
    selective_scan_fused,
    ssd_fused,
)
from hooked.ops.fused_reference import (
    causal_conv1d_reference,
    chunk_scan_combined_reference,
    selective_scan_reference,
)
from hooked.ops.scan_chunked import selective_scan_chunked
from hooked.ops.selective_scan import selective_scan_sequential
from hooked.ops.ssd import ssd_chunked, ssd_sequential

EXACT = dict(atol=1e-12, rtol=1e-12)


def _randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def mamba1(seq_len=13, batch=2, d=6, n=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(u=_randn(g, batch, seq_len, d, dtype=dtype),
                dt=F.softplus(_randn(g, batch, seq_len, d, dtype=dtype) - 1),
                A=-torch.exp(_randn(g, d, n)).to(torch.float32 if dtype != torch.float64 else dtype),
                B=_randn(g, batch, seq_len, n, dtype=dtype), C=_randn(g, batch, seq_len, n, dtype=dtype))


def mamba2(seq_len=13, batch=2, h=4, p=3, g_=2, n=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=_randn(g, batch, seq_len, h, p, dtype=dtype),
                dt=F.softplus(_randn(g, batch, seq_len, h, dtype=dtype) - 1),
                A=-torch.exp(_randn(g, h)).to(torch.float32 if dtype != torch.float64 else dtype),
                B=_randn(g, batch, seq_len, g_, n, dtype=dtype), C=_randn(g, batch, seq_len, g_, n, dtype=dtype))


# ------------------------------------------------------------------- stand-ins == the semantics
@pytest.mark.parametrize("bc", ["shared", "grouped", "constant"])
@pytest.mark.parametrize("extras", [False, True])
def test_selective_scan_reference_semantics(bc, extras):
    """Kernel layout [b d l]; B/C shared [b n l], grouped [b g n l] or constant [d n]; D, z, delta_bias, softplus."""
    g = torch.Generator().manual_seed(1)
    batch, d, seq_len, n, groups = 2, 6, 11, 4, 3
    u, delta, z = (_randn(g, batch, d, seq_len) for _ in range(3))
    A = -torch.exp(_randn(g, d, n))
    if bc == "shared":
        B, C = _randn(g, batch, n, seq_len), _randn(g, batch, n, seq_len)
        per = lambda t: rearrange(t, "b n l -> b l 1 n")  # noqa: E731
    elif bc == "grouped":
        B, C = _randn(g, batch, groups, n, seq_len), _randn(g, batch, groups, n, seq_len)
        per = lambda t: rearrange(t, "b g n l -> b l g 1 n").expand(-1, -1, -1, d // groups, -1).reshape(  # noqa: E731
            batch, seq_len, d, n)
    else:
        B, C = _randn(g, d, n), _randn(g, d, n)
        per = lambda t: t[None, None]  # noqa: E731
    D, bias = (_randn(g, d), _randn(g, d)) if extras else (None, None)
    out, last = selective_scan_reference(u, delta, A, B, C, D=D, z=z if extras else None, delta_bias=bias,
                                         delta_softplus=extras, return_last_state=True)
    # the recurrence written out per position, channel by channel
    dt = delta + bias[:, None] if extras else delta
    dt = F.softplus(dt) if extras else dt
    dt, u_l = dt.transpose(1, 2), u.transpose(1, 2)
    Bf, Cf = per(B).expand(batch, seq_len, d, n), per(C).expand(batch, seq_len, d, n)
    h = torch.zeros(batch, d, n, dtype=torch.float64)
    ys = []
    for t in range(seq_len):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u_l[:, t])[..., None] * Bf[:, t]
        ys.append((h * Cf[:, t]).sum(-1))
    want = torch.stack(ys, dim=2)
    if extras:
        want = (want + u * D[:, None]) * F.silu(z)
    # the stand-in computes in float32, as the kernel does
    torch.testing.assert_close(out, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(last.double(), h, atol=1e-5 * h.abs().max().item(), rtol=0)
    assert out.dtype == torch.float64 and last.dtype == torch.float32
    assert selective_scan_reference(u, delta, A, B, C).shape == (batch, d, seq_len)  # no state: one tensor


def test_selective_scan_reference_equals_hf_torch_reference():
    """HF's torch path of the Mamba-1 scan takes the kernel layout too: an independent oracle."""
    m1 = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    if not hasattr(m1, "mamba_selective_scan"):
        pytest.skip("this transformers has no mamba_selective_scan")
    u, dt, A, B, C = mamba1(seq_len=40, d=8, n=4, dtype=torch.float32).values()
    want = m1.mamba_selective_scan(u.mT, dt.mT, A, B.mT, C.mT)
    got = selective_scan_reference(u.mT, dt.mT, A, B.mT, C.mT)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


def test_selective_scan_reference_casts_back_to_the_input_dtype():
    u, dt, A, B, C = mamba1(dtype=torch.bfloat16).values()
    out, last = selective_scan_reference(u.mT, dt.mT, A, B.mT, C.mT, return_last_state=True)
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32


@pytest.mark.parametrize("width", [1, 2, 4, 5])
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_reference_semantics(width, initial, activation):
    g = torch.Generator().manual_seed(2)
    batch, d, seq_len = 2, 5, 3
    x, weight, bias = _randn(g, batch, d, seq_len), _randn(g, d, width), _randn(g, d)
    init = _randn(g, batch, d, width - 1) if initial else None
    out, final = causal_conv1d_reference(x, weight, bias, initial_states=init, return_final_states=True,
                                         activation=activation)
    before = init if initial else torch.zeros(batch, d, width - 1, dtype=torch.float64)
    full = torch.cat([before, x], dim=-1)
    conv = torch.nn.Conv1d(d, d, width, groups=d).double()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None])
        conv.bias.copy_(bias)
        want = conv(full)
    want = F.silu(want) if activation else want
    torch.testing.assert_close(out, want, **EXACT)
    torch.testing.assert_close(final, full[..., full.shape[-1] - (width - 1):], **EXACT)
    buffer = torch.empty(batch, d, width - 1, dtype=torch.float64)
    _, written = causal_conv1d_reference(x, weight, bias, initial_states=init, return_final_states=True,
                                         final_states_out=buffer)
    assert written is buffer and torch.equal(buffer, final)
    with pytest.raises(NotImplementedError, match="activation"):
        causal_conv1d_reference(x, weight, activation="relu")


@pytest.mark.parametrize("D_shape", [None, "h", "hp"])
@pytest.mark.parametrize("extras", [False, True])
def test_chunk_scan_combined_reference_semantics(D_shape, extras):
    inp = mamba2(seq_len=17)
    x, dt_raw, A, B, C = inp.values()
    g = torch.Generator().manual_seed(3)
    h, p = x.shape[2:]
    D = None if D_shape is None else _randn(g, h) if D_shape == "h" else _randn(g, h, p)
    z = _randn(g, *x.shape) if extras else None
    dt_bias = _randn(g, h) if extras else None
    h0 = _randn(g, 2, h, p, 5) if extras else None
    limit = (0.05, 0.8) if extras else (0.0, math.inf)
    out, final = chunk_scan_combined_reference(x, dt_raw, A, B, C, 8, D=D, z=z, dt_bias=dt_bias, initial_states=h0,
                                               dt_softplus=extras, dt_limit=limit, return_final_states=True)
    dt = F.softplus(dt_raw + dt_bias).clamp(*limit) if extras else dt_raw
    y, h_last = ssd_sequential(x, dt, A, B, C, h0=h0)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    torch.testing.assert_close(out, y, atol=1e-5 * y.abs().max().item(), rtol=0)
    torch.testing.assert_close(final.double(), h_last, atol=1e-5 * h_last.abs().max().item(), rtol=0)
    assert out.dtype == x.dtype and final.dtype == torch.float32


# ------------------------------------------------------------------- wrappers == our ops
@pytest.mark.parametrize("seq_len", [1, 13, 70])
@pytest.mark.parametrize("with_h0", [False, True])
def test_selective_scan_fused_wiring_on_the_stand_in(seq_len, with_h0):
    inp = mamba1(seq_len, dtype=torch.float32)
    h0 = torch.randn(2, 6, 4) if with_h0 else None
    y_ref, h_ref = selective_scan_sequential(**{k: v.double() for k, v in inp.items()},
                                             h0=None if h0 is None else h0.double())
    y, h = selective_scan_fused(**inp, h0=h0, kernels=REFERENCE)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5 * y_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5 * h_ref.abs().max().item(), rtol=0)
    assert y.dtype == h.dtype == torch.float32 and y.shape == inp["u"].shape


@pytest.mark.parametrize("width", [2, 4, 5])
def test_causal_conv1d_fused_wiring_on_the_stand_in(width):
    g = torch.Generator().manual_seed(4)
    x, weight, bias = _randn(g, 2, 9, 7), _randn(g, 7, width), _randn(g, 7)
    torch.testing.assert_close(causal_conv1d_fused(x, weight, bias, kernels=REFERENCE), causal_conv1d(x, weight, bias),
                               **EXACT)
    torch.testing.assert_close(causal_conv1d_fused(x, weight, kernels=REFERENCE), causal_conv1d(x, weight), **EXACT)


@pytest.mark.parametrize("seq_len", [1, 13, 40])
@pytest.mark.parametrize("with_h0", [False, True])
def test_ssd_fused_wiring_on_the_stand_in(seq_len, with_h0):
    inp = mamba2(seq_len, dtype=torch.float32)
    h0 = torch.randn(2, 4, 3, 5) if with_h0 else None
    y_ref, h_ref = ssd_chunked(**inp, chunk_size=8, h0=h0)
    y, h = ssd_fused(**inp, chunk_size=8, h0=h0, kernels=REFERENCE)
    torch.testing.assert_close(y, y_ref, atol=1e-6 * y_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(h, h_ref, atol=1e-6 * h_ref.abs().max().item(), rtol=0)


class Spy:
    """Records the arguments a wrapper passes, then runs the stand-in."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def test_wrappers_pass_the_kernels_layout_and_arguments():
    spies = Kernels(Spy(selective_scan_reference), Spy(causal_conv1d_reference), Spy(chunk_scan_combined_reference),
                    real=False)
    inp = mamba1(dtype=torch.float32)
    selective_scan_fused(**inp, kernels=spies)
    args, kw = spies.selective_scan_fn.calls[0]  # keywords only
    u, dt, A, B, C = (kw.pop(n) for n in ("u", "delta", "A", "B", "C"))
    assert args == () and u.shape == dt.shape == (2, 6, 13) and B.shape == C.shape == (2, 4, 13)
    assert A.dtype == torch.float32
    assert kw == dict(D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=True)
    causal_conv1d_fused(inp["u"], torch.randn(6, 4), kernels=spies)
    args, kw = spies.causal_conv1d_fn.calls[0]
    x = kw.pop("x")
    assert args == () and set(kw) == {"weight", "bias", "activation"} and kw["activation"] is None
    assert x.shape == (2, 6, 13) and x.stride(1) == 1  # channel-last, no copy
    inp2 = mamba2(dtype=torch.float32)
    h0 = torch.randn(2, 4, 3, 5)
    ssd_fused(**inp2, chunk_size=8, h0=h0, kernels=spies)
    args, kw = spies.mamba_chunk_scan_combined.calls[0]
    assert args == () and kw["x"] is inp2["x"] and kw["chunk_size"] == 8 and kw["initial_states"] is h0
    assert kw["return_final_states"]
    assert kw["dt_softplus"] is False and kw["D"] is None and kw["z"] is None and kw["dt_bias"] is None
    # the kernel takes no initial state: with h0 the scan is ours, the kernel is not called
    selective_scan_fused(**inp, h0=torch.randn(2, 6, 4), kernels=spies)
    assert len(spies.selective_scan_fn.calls) == 1


def test_real_kernels_are_only_given_cuda_tensors_of_their_dtypes():
    """A `real` kernel on CPU tensors, or on float64, is not called: our op computes the result."""
    def refuse(*args, **kwargs):
        raise AssertionError("a real kernel was called on a CPU tensor")

    fake = Kernels(refuse, refuse, refuse, real=True)
    inp = mamba1(dtype=torch.float32)
    y, h = selective_scan_fused(**inp, kernels=fake)
    torch.testing.assert_close(y, selective_scan_chunked(**inp)[0])
    causal_conv1d_fused(inp["u"], torch.randn(6, 4), kernels=fake)
    ssd_fused(**mamba2(dtype=torch.float32), chunk_size=8, kernels=fake)
    assert not fused_available("cpu")
    assert isinstance(mamba_ssm_kernels(), Kernels) and mamba_ssm_kernels().real


def test_default_kernels_on_cpu_are_our_ops():
    inp = mamba1(dtype=torch.float64)
    y, h = selective_scan_fused(**inp)
    y_ref, h_ref = selective_scan_sequential(**inp)
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(h, h_ref, **EXACT)


# ------------------------------------------------------------------- the real kernels (CUDA)
def _need(op: str) -> None:
    if not fused_available("cuda", op):
        pytest.skip(f"{op} is not importable (pip install hooked[cuda] on a CUDA machine)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_real_selective_scan_equals_ours_and_the_stand_in(cuda, dtype, rel):
    _need("selective_scan_fn")
    inp = {k: v.to(cuda) for k, v in mamba1(seq_len=300, d=64, n=16, dtype=dtype).items()}
    y, h = selective_scan_fused(**inp)
    y_ref, h_ref = selective_scan_chunked(**{k: v.float() for k, v in inp.items()})
    torch.testing.assert_close(y.float(), y_ref, atol=rel * y_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(h.float(), h_ref, atol=rel * h_ref.abs().max().item(), rtol=0)
    g = torch.Generator().manual_seed(5)
    D, z, bias = (_randn(g, *s).float().to(cuda) for s in ((64,), (2, 64, 300), (64,)))
    args = [t.mT.contiguous() if t.dim() == 3 else t for t in inp.values()]
    kw = dict(D=D, z=z.to(dtype), delta_bias=bias, delta_softplus=True, return_last_state=True)
    out, last = mamba_ssm_kernels().selective_scan_fn(*args, **kw)
    out_ref, last_ref = selective_scan_reference(*args, **kw)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=rel * out_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(last, last_ref, atol=1e-4 * last_ref.abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_real_causal_conv1d_equals_ours(cuda, dtype, rel):
    _need("causal_conv1d_fn")
    g = torch.Generator().manual_seed(6)
    x, weight, bias = (_randn(g, *s, dtype=dtype).to(cuda) for s in ((2, 100, 64), (64, 4), (64,)))
    got = causal_conv1d_fused(x, weight, bias)
    want = causal_conv1d(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, atol=rel * want.abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_real_chunk_scan_equals_ours(cuda, dtype, rel):
    _need("mamba_chunk_scan_combined")
    inp = {k: v.to(cuda) for k, v in mamba2(seq_len=300, h=8, p=16, g_=2, n=16, dtype=dtype).items()}
    h0 = torch.randn(2, 8, 16, 16, device=cuda)
    y, h = ssd_fused(**inp, chunk_size=64, h0=h0)
    y_ref, h_ref = ssd_chunked(**{k: v.float() for k, v in inp.items()}, chunk_size=64, h0=h0)
    torch.testing.assert_close(y.float(), y_ref, atol=rel * y_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(h.float(), h_ref, atol=rel * h_ref.abs().max().item(), rtol=0)
