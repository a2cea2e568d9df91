"""Host reads of device values in hooked/ops (each one waits for the GPU): counted, never one per chunk.

A torch-function mode counts the calls that read a tensor's value into Python (tolist, item,
bool, int, index, float, equal, nonzero: on CUDA each waits for the queued work). The fast paths
(two-level scan, fused wrappers, SDPA attention) read nothing; the kernel functions read their
positions once per call (one `tolist` of the rows or columns they are given), never once per
chunk: the count is the same for rows in one chunk and rows spread over many.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hooked.ops.fused import REFERENCE, causal_conv1d_fused, selective_scan_fused, ssd_fused
from hooked.ops.scan_chunked import linear_scan_chunked, selective_scan_chunked
from hooked.ops.sdpa import sdpa_attention
from hooked.ops.selective_kernel import (
    mamba1_kernel_chunked,
    mamba1_kernel_cols,
    mamba1_kernel_discrete_chunked,
    mamba1_kernel_rows,
)
from hooked.ops.selective_scan import mamba1_kernel_discrete, selective_scan
from hooked.ops.ssd import ssd_chunked
from hooked.ops.ssd_kernel import mamba2_kernel_discrete, mamba2_kernel_rows

READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "equal", "nonzero"}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


def reads(fn) -> int:
    with torch.no_grad(), HostReads() as probe:
        fn()
    return probe.n


def mamba1(seq_len=200, batch=1, d=4, n=3):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(batch, seq_len, d), F.softplus(r(batch, seq_len, d) - 1), -torch.exp(r(d, n)), r(batch, seq_len, n), \
        r(batch, seq_len, n)


def test_the_counter_sees_a_host_read():
    assert reads(lambda: torch.arange(3).tolist()) == 1 and reads(lambda: bool(torch.ones(1))) == 1


@pytest.mark.parametrize("name", ["selective_scan_chunked", "linear_scan_chunked", "selective_scan_fused",
                                  "causal_conv1d_fused", "ssd_fused", "ssd_chunked", "selective_scan", "sdpa",
                                  "sdpa_padded"])
def test_fast_paths_read_nothing(name):
    u, dt, A, B, C = mamba1()
    x = torch.randn(1, 200, 4, 3)
    q, k = torch.randn(2, 50, 4, 8), torch.randn(2, 50, 2, 8)
    key_mask = torch.ones(2, 50, dtype=torch.bool)
    key_mask[0, :7] = False
    calls = {
        "selective_scan_chunked": lambda: selective_scan_chunked(u, dt, A, B, C),
        "linear_scan_chunked": lambda: linear_scan_chunked(torch.exp(dt[..., None] * A), dt[..., None] * B[:, :, None]),
        "selective_scan_fused": lambda: selective_scan_fused(u, dt, A, B, C, kernels=REFERENCE),
        "causal_conv1d_fused": lambda: causal_conv1d_fused(u, torch.randn(4, 4), kernels=REFERENCE),
        "ssd_fused": lambda: ssd_fused(x, dt, A[:, 0], B[:, :, None], C[:, :, None], 64, kernels=REFERENCE),
        "ssd_chunked": lambda: ssd_chunked(x, dt, A[:, 0], B[:, :, None], C[:, :, None], 64),
        "selective_scan": lambda: selective_scan(u, dt, A, B, C),
        "sdpa": lambda: sdpa_attention(q, k, k, 0.3),
        "sdpa_padded": lambda: sdpa_attention(q, k, k, 0.3, window=5, key_mask=key_mask),
    }
    assert reads(calls[name]) == 0


@pytest.mark.parametrize("spread", [False, True])
def test_kernel_rows_and_cols_read_their_positions_once(spread):
    """Rows in one chunk or spread over all of them: one host read either way (it was 3 per chunk)."""
    u, dt, A, B, C = mamba1(seq_len=640)
    positions = torch.tensor([5, 600, 130, 300, 64, 7] if spread else [3, 5, 7])
    assert reads(lambda: mamba1_kernel_rows(dt, A, B, C, positions)) == 1
    assert reads(lambda: mamba1_kernel_cols(dt, A, B, C, positions)) == 1
    assert reads(lambda: mamba2_kernel_rows(dt, A[:, 0], B[:, :, None], C[:, :, None], positions)) == 1


def test_whole_kernels_read_only_their_sign_check():
    u, dt, A, B, C = mamba1(seq_len=300)
    A_bar = torch.exp(dt[..., None] * A)
    B_bar = dt[..., None] * B[:, :, None]
    assert reads(lambda: mamba1_kernel_chunked(dt, A, B, C)) == 0
    assert reads(lambda: mamba1_kernel_discrete(A_bar, B_bar, C)) == 1  # is 0 < A_bar <= 1? (one check)
    assert reads(lambda: mamba1_kernel_discrete_chunked(A_bar, B_bar, C)) == 1
    A2 = torch.exp(dt[..., 0] * 0.3)
    assert reads(lambda: mamba2_kernel_discrete(A2[..., None], B_bar[:, :, :1], B_bar[:, :, :1])) == 1


@pytest.mark.parametrize("decoding", [False, True])
def test_rotary_sized_from_a_host_bound_reads_nothing(decoding):
    """Rotary(position_ids, dtype, max_position=...) gives the same cos/sin without the max read."""
    from hooked.ops.rotary import Rotary

    rope = Rotary.of(8, 10000.0, None)
    start = 37 if decoding else 0
    position_ids = start + torch.arange(5).expand(2, 5)
    assert reads(lambda: rope(position_ids, torch.float32)) == 1
    assert reads(lambda: rope(position_ids, torch.float32, max_position=start + 4)) == 0
    for got, want in zip(rope(position_ids, torch.float32, max_position=start + 4 + 50 * decoding),
                         rope(position_ids, torch.float32), strict=True):
        assert torch.equal(got, want)
