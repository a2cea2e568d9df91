"""The SSM kernel's cost against the forward it explains: ratios measured in one run (1 thread, CPU time).

    OMP_NUM_THREADS=1 python benchmarks/bench_kernel.py [--pos 256 1024] [--rows-pos 8192] [--rounds 3]

A fresh tensor of the Mamba-1 kernel's size is mostly page faults on a loaded VM (line "zeros").
The kernel is written into ops.big_zeros memory: on 2 MiB pages where they pay (--huge-pages auto:
not on a VM that reports free pages to its host, see ops/big_buffer.py), or always (on), or never
(off; torch.zeros). For comparison, let glibc keep freed memory so repeated kernels reuse their pages:
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184

Glossary
    layer        one block (norm + mixer + residual) of the 130M width, run on a random residual
                 with start_at_layer=0, stop_at_layer=1 (no embedding or unembedding), batch 1,
                 float32, random weights with the models' own initialisation
    forward      the layer's forward, no hooks
    + kernel     run_with_cache(names_filter=hook_kernel) of the same layer: forward and kernel
    kernel / fwd (+ kernel - forward) / forward: what hook_kernel adds, in forwards
    zeros        torch.zeros of the kernel's shape: the floor any kernel that returns a fresh tensor
                 pays (on a loaded VM, page faults cost about as much as writing the memory 10 times)
    big_zeros    ops.big_zeros of the kernel's shape, written once (fill_): the floor of our kernel
    first        the first + kernel run of the process, before any warm-up, one sample: with huge
                 pages on a VM that reports free pages to its host, seconds (the host faults the
                 reported memory back in); later runs reuse the blocks freed just before
    dense        the dense reference ops.mamba1_kernel (d_inner x pos^2 x d_state exponentials),
                 timed once, at the first pos only
    rows         ops.mamba1_kernel_rows / mamba2_kernel_rows for the last 8 targets, from the
                 layer's cached dt, B, C; peak = glibc heap in use (+ big_zeros mappings) above the
                 start, sampled after every aten op (bench_scan.peak_bytes); / pos shows it is
                 linear in pos

Mamba-1: d_model 768, d_inner 1536, d_state 16 (mamba-130m). Mamba-2: d_model 768, 24 heads of
64, d_state 128, 1 group, chunk 256 (mamba2-130m); there the kernel path is also compared with
the SSD op alone (mamba2_kernel_chunked, which hook_kernel uses, and the dense reference
mamba2_kernel, over ssd_chunked on the same dt, A, B, C).
Times are minimum CPU times over --rounds rounds, run round-robin so that load from other
processes falls on all alike. The full Mamba-1 kernel is d_inner x pos^2 floats: 0.4 GB at pos
256, 6.4 GB at 1024; a size that would not fit twice in the memory available now is skipped.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from benchmarks.bench_scan import peak_bytes
from hooked.models.mamba import MambaConfig
from hooked.models.mamba2 import Mamba2Config
from hooked.ops import (
    big_buffer,
    big_zeros,
    mamba1_kernel,
    mamba1_kernel_rows,
    mamba2_kernel,
    mamba2_kernel_chunked,
    mamba2_kernel_rows,
    ssd_chunked,
)
from hooked.models.families import build as build_model

N_ROWS = 8


def best_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Min CPU time of each function, round-robin (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else unlimited."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return 2**62


def once(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mamba1":
        return build_model(MambaConfig(n_layers=1, d_model=768, d_vocab=16, d_inner=1536, d_state=16)).eval()
    return build_model(Mamba2Config(n_layers=1, d_model=768, n_heads=24, d_head=64, d_state=128, d_vocab=16)).eval()


def ssm_inputs(model: torch.nn.Module, resid: torch.Tensor) -> dict[str, torch.Tensor]:
    """dt, A, B, C of layer 0 (float32, as the mixer's scan sees them)."""
    names = [f"blocks.0.mixer.hook_{n}" for n in ("dt", "B", "C")]
    _, cache = model.run_with_cache(resid, names_filter=names, start_at_layer=0, stop_at_layer=1)
    dt, B, C = (cache[n].float() for n in names)
    return dict(dt=dt, A=model.blocks[0].mixer.A().float(), B=B, C=C)


def kernel_ratio(kind: str, seq_len: int, rounds: int, dense: bool) -> None:
    model = build(kind)
    resid = torch.randn(1, seq_len, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    blocks = dict(start_at_layer=0, stop_at_layer=1)
    name = "blocks.0.mixer.hook_kernel"

    def with_kernel() -> None:
        _, cache = model.run_with_cache(resid, names_filter=name, max_cache_bytes=2**50, **blocks)
        del cache

    inp = ssm_inputs(model, resid)
    kernel_shape = (1, inp["dt"].shape[-1], seq_len, seq_len)
    need, free = 2 * 4 * math.prod(kernel_shape) + 2**30, available_bytes()
    if need > free:  # a shared machine: never push others out of memory
        print(f"{kind} pos {seq_len:5d}   skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")
        return
    first = once(with_kernel)
    fns = {"forward": lambda: model(resid, **blocks), "kernel": with_kernel,
           "zeros": lambda: torch.zeros(kernel_shape),
           "big_zeros": lambda: big_zeros(kernel_shape, dtype=torch.float32, device="cpu").fill_(1)}
    if kind == "mamba2":  # the ops alone: SSD forward vs the kernel
        x = torch.randn(1, seq_len, 24, 64)
        fns["ssd_chunked"] = lambda: ssd_chunked(x, inp["dt"], inp["A"], inp["B"], inp["C"], 256)
        fns["mamba2_kernel_chunked"] = lambda: mamba2_kernel_chunked(**inp)
    times = best_times(fns, rounds)
    fwd, both = times["forward"], times["kernel"]
    print(f"{kind} pos {seq_len:5d}   forward {fwd * 1e3:8.1f} ms   forward + kernel {both * 1e3:8.1f} ms   "
          f"ratio {both / fwd:5.2f}   kernel / forward {(both - fwd) / fwd:5.2f}")
    print(f"            of which a fresh tensor of the kernel's size (torch.zeros, page faults): "
          f"{times['zeros'] * 1e3:8.1f} ms = {times['zeros'] / fwd:5.2f} forwards")
    print(f"            big_zeros of that size, written once: {times['big_zeros'] * 1e3:8.1f} ms = "
          f"{times['big_zeros'] / fwd:5.2f} forwards;   first forward + kernel of the process "
          f"{first * 1e3:8.1f} ms = {first / fwd:5.2f} forwards")
    if kind == "mamba2":
        t_chunked, t_ssd = times["mamba2_kernel_chunked"], times["ssd_chunked"]
        t_dense = once(lambda: mamba2_kernel(**inp))
        print(f"            op alone: mamba2_kernel_chunked {t_chunked * 1e3:8.1f} ms / ssd_chunked {t_ssd * 1e3:8.1f} ms "
              f"= {t_chunked / t_ssd:5.2f}   (dense mamba2_kernel, once: {t_dense / t_ssd:5.2f})")
    if dense:
        t_dense = once(lambda: mamba1_kernel(**inp))
        print(f"            dense reference mamba1_kernel (once) {t_dense * 1e3:8.1f} ms = "
              f"{t_dense / fwd:6.1f} forwards; the chunked kernel is {t_dense / (both - fwd):5.1f}x faster")


def rows_cost(kind: str, seq_lens: list[int], rounds: int) -> None:
    model = build(kind)
    rows_fn = mamba1_kernel_rows if kind == "mamba1" else mamba2_kernel_rows
    for seq_len in seq_lens:
        resid = torch.randn(1, seq_len, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
        inp = ssm_inputs(model, resid)
        rows = torch.arange(seq_len - N_ROWS, seq_len)
        times = best_times({"forward": lambda: model(resid, start_at_layer=0, stop_at_layer=1),
                            "rows": lambda: rows_fn(**inp, rows=rows)}, rounds)
        peak = peak_bytes(lambda: rows_fn(**inp, rows=rows))
        channels = inp["dt"].shape[-1]
        full = channels * seq_len**2 * 4
        print(f"{kind} pos {seq_len:5d}   last {N_ROWS} rows {times['rows'] * 1e3:8.1f} ms = "
              f"{times['rows'] / times['forward']:5.2f} forwards   peak +{peak / 2**20:7.1f} MiB "
              f"({peak / seq_len / 2**10:5.1f} KiB per position; full kernel {full / 2**30:6.1f} GiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pos", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rows-pos", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--families", nargs="+", default=["mamba1", "mamba2"])
    p.add_argument("--huge-pages", choices=["auto", "on", "off"], default="auto")
    args = p.parse_args()
    torch.set_num_threads(1)
    big_buffer.HUGE_PAGES = {"auto": None, "on": True, "off": False}[args.huge_pages]
    print(f"huge pages {args.huge_pages}: offered {big_buffer.thp_offered()}, free pages reported to a host "
          f"{big_buffer.free_pages_reported()} -> big_zeros advises them: {big_buffer.huge_pages_pay()}")
    with torch.no_grad():
        for kind in args.families:
            print(f"== {kind}: hook_kernel vs a one-layer forward (130M width) ==")
            for k, seq_len in enumerate(args.pos):
                kernel_ratio(kind, seq_len, args.rounds if seq_len <= 512 else 1, dense=kind == "mamba1" and k == 0)
            print(f"== {kind}: kernel rows for the last {N_ROWS} targets ==")
            rows_cost(kind, args.rows_pos, args.rounds)


if __name__ == "__main__":
    main()
