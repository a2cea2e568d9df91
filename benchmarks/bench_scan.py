"""Scan and kernel benchmarks: ratios measured in one run on this machine (1 thread, CPU time).

    OMP_NUM_THREADS=1 python benchmarks/bench_scan.py

1. Mamba-1 scan at the 130M size (d_inner 1536, d_state 16, pos 256, batch 1, float32):
   selective_scan (chunked, in place) vs selective_scan_sequential (plain loop) vs the HF
   recurrent loop (transformers' mamba_selective_scan, which holds [b d l n] A_bar and B_bar*u),
   and selective_scan's chunk_size.
2. Mamba-2 scan at the 130M size (24 heads of 64, d_state 128, pos 256): ssd_chunked vs
   ssd_sequential vs HF's mamba2_chunk_scan (torch path).
3. Peak memory (glibc heap in use, sampled after every aten op) of mamba1_kernel_pairs at
   pos 2048 with P in {1, 16, 256} pairs vs the full mamba1_kernel (small d_inner so it fits).
"""

import ctypes
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hooked.ops import (
    mamba1_kernel,
    mamba1_kernel_pairs,
    selective_scan,
    selective_scan_sequential,
    ssd_chunked,
    ssd_sequential,
)
from hooked.ops.big_buffer import mapped_bytes


def best_times(fns, rounds=7):
    """Min CPU time of each function (1 thread), round-robin so load from others hits all alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def report(times, reference):
    for name, t in times.items():
        print(f"{name:34s} {t * 1e3:8.1f} ms   {t / times[reference]:5.2f}x {reference}")


def mamba1_inputs(seq_len=256, d_inner=1536, d_state=16, batch=1, dtype=torch.float32):
    u = torch.randn(batch, seq_len, d_inner, dtype=dtype)
    dt = F.softplus(torch.randn(batch, seq_len, d_inner, dtype=dtype) - 2)
    A = -torch.exp(torch.randn(d_inner, d_state, dtype=dtype))
    B, C = (torch.randn(batch, seq_len, d_state, dtype=dtype) for _ in range(2))
    return u, dt, A, B, C


def hf_modules():
    try:
        from transformers.models.mamba import modeling_mamba
        from transformers.models.mamba2 import modeling_mamba2
    except ImportError:
        return None, None
    return modeling_mamba, modeling_mamba2


def bench_mamba1(modeling_mamba):
    print("== Mamba-1 scan: d_inner 1536, d_state 16, pos 256, batch 1, float32 ==")
    u, dt, A, B, C = mamba1_inputs()
    fns = {"selective_scan": lambda: selective_scan(u, dt, A, B, C)}
    for chunk_size in (4, 16, 32, 64, 256):
        fns[f"  chunk_size={chunk_size}"] = lambda c=chunk_size: selective_scan(u, dt, A, B, C, chunk_size=c)
    fns["selective_scan_sequential"] = lambda: selective_scan_sequential(u, dt, A, B, C)
    if modeling_mamba is not None:
        fns["HF mamba_selective_scan (loop)"] = lambda: modeling_mamba.mamba_selective_scan(
            u.mT, dt.mT, A, B.mT, C.mT
        )
    with torch.no_grad():
        report(best_times(fns), "selective_scan")


def bench_mamba2(modeling_mamba2):
    print("== Mamba-2 scan: 24 heads x 64, d_state 128, 1 group, pos 256, batch 1, float32 ==")
    x = torch.randn(1, 256, 24, 64)
    dt = F.softplus(torch.randn(1, 256, 24) - 2)
    A = -torch.exp(torch.randn(24))
    B, C = (torch.randn(1, 256, 1, 128) for _ in range(2))
    fns = {
        "ssd_chunked (chunk 256)": lambda: ssd_chunked(x, dt, A, B, C, chunk_size=256),
        "ssd_chunked (chunk 64)": lambda: ssd_chunked(x, dt, A, B, C, chunk_size=64),
        "ssd_sequential": lambda: ssd_sequential(x, dt, A, B, C),
    }
    if modeling_mamba2 is not None:
        fns["HF mamba2_chunk_scan (chunk 256)"] = lambda: modeling_mamba2.mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size=256
        )
    with torch.no_grad():
        report(best_times(fns, rounds=3), "ssd_chunked (chunk 256)")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _heap_in_use():
    """Bytes in use on the glibc heap (small blocks + mmapped blocks), where CPU tensors live, plus
    the huge-page mappings of hooked.ops.big_zeros (outside glibc's heap)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd + mapped_bytes()


class _HeapPeak(TorchDispatchMode):
    """Samples heap use after every aten op; peak = largest increase over the start."""

    def __enter__(self):
        self.start = self.peak = _heap_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_in_use())
        return out


def peak_bytes(fn):
    with torch.no_grad(), _HeapPeak() as probe:
        fn()
    return probe.peak - probe.start


def bench_pairs_memory():
    seq_len, d_inner, d_state = 2048, 16, 16
    print(f"== Kernel peak memory: pos {seq_len}, d_inner {d_inner}, d_state {d_state}, float32 ==")
    dt = F.softplus(torch.randn(1, seq_len, d_inner) - 2)
    A = -torch.exp(torch.randn(d_inner, d_state))
    B, C = torch.randn(1, seq_len, d_state), torch.randn(1, seq_len, d_state)
    full = peak_bytes(lambda: mamba1_kernel(dt, A, B, C))
    size = d_inner * seq_len**2 * 4
    print(f"mamba1_kernel (full)       peak +{full / 2**20:9.3f} MiB   (the kernel alone: {size / 2**20:.0f} MiB)")
    for n_pairs in (1, 16, 256):
        target = torch.randint(seq_len, (n_pairs,))
        source = (target - torch.randint(seq_len, (n_pairs,))).clamp(min=0)
        batch_idx = torch.zeros_like(target)
        peak = peak_bytes(lambda: mamba1_kernel_pairs(dt, A, B, C, batch_idx, target, source))
        print(f"mamba1_kernel_pairs P={n_pairs:<4d} peak +{peak / 2**20:9.3f} MiB   {full / peak:.0f}x less")
    print(f"(at the 130M size, d_inner 1536, the full kernel alone would be {1536 * seq_len**2 * 4 / 2**30:.0f} GiB)")


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    modeling_mamba, modeling_mamba2 = hf_modules()
    bench_mamba1(modeling_mamba)
    bench_mamba2(modeling_mamba2)
    bench_pairs_memory()


if __name__ == "__main__":
    main()
