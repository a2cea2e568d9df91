"""Long contexts on the SSMs: peak memory and time of four analyses at 1k, 2k, 4k and 8k tokens.

Glossary
    model        one Mamba-1 or Mamba-2 layer at mamba-130m / mamba2-130m width (d_model 768, d_inner
                 1536; Mamba-1 d_state 16; Mamba-2 24 heads of 64, d_state 128, one group), random
                 weights, float32, SmolLM2's tokenizer (vocabulary 49,152)
    forward      logits of one sequence [1 L d_vocab]
    cache        run_with_cache with a filter of the linear hooks an analysis reads (resid, u, dt, B,
                 C, y, ssm_out, mixer_out): no state, no kernel
    knockout     the first half of the tokens cut from the last one, in the layer (logits after)
    info_flow    one fact whose prompt is padded to L tokens, four source sets, window 1
    peak         the peak anonymous resident memory (RssAnon, sampled each millisecond) of the operation
                 over the process's before it, in a fresh subprocess per (model, operation, length),
                 with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_)
                 so that freed tensors leave the process at once and the peak follows the live tensors
                 (with glibc's sliding threshold, memory freed while the model was built is reused
                 unseen, and small lengths look bigger than they are)
    exponent     the slope of log(peak) (and log(time)) against log(L): 1 = linear, 2 = quadratic; fitted
                 over all lengths, and for memory also over the last doubling alone (where fixed costs,
                 which pull the fit below 1, weigh least)

Target: memory exponent 1.0 +- 0.15: no L x L x channels tensor in any of the four.

    python benchmarks/bench_long_context.py [--lengths 1024 2048 4096 8192] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from hooked.models.families import build as build_model

OPS = ("forward", "cache", "knockout", "info_flow")
ARCHS = ("mamba", "mamba2")
CACHE_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_ssm_in", "hook_dt", "hook_B", "hook_C", "hook_y",
               "hook_ssm_out", "hook_mixer_out")
MMAP_THRESHOLD = 1 << 16  # glibc: every block above 64 KiB is its own mapping, unmapped when freed
FILLER = "The river runs past the old mill, and the town sleeps while the bells ring out over the hills. "


def tokenizer():
    from loaders.smollm2 import smollm2_path
    from loaders.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_path())


def build(arch: str, d_vocab: int):
    torch.manual_seed(0)
    if arch == "mamba":
        from hooked.models.mamba import MambaConfig

        return build_model(MambaConfig(n_layers=1, d_model=768, d_vocab=d_vocab, d_state=16)).eval()
    from hooked.models.mamba2 import Mamba2Config

    return build_model(Mamba2Config(n_layers=1, d_model=768, n_heads=24, d_head=64, d_state=128,
                                     d_vocab=d_vocab, tied=True)).eval()


def fact_of_length(tok, length: int) -> dict:
    """A fact whose prompt is about `length` tokens: filler, then the subject and the relation."""
    tail = "The Eiffel Tower is located in the city of"
    n_tail, n_fill = len(tok(tail)["input_ids"]), len(tok(FILLER, add_special_tokens=False)["input_ids"])
    prompt = FILLER * max(0, (length - n_tail) // n_fill) + tail
    ids = tok(prompt)["input_ids"]
    while len(ids) < length:  # top up word by word
        prompt = "so " + prompt
        ids = tok(prompt)["input_ids"]
    return {"prompt": prompt, "subject": "The Eiffel Tower", "attribute": "Paris", "length": len(ids)}


class AnonPeak:
    """The peak of RssAnon while inside, sampled every millisecond by a thread (torch releases the GIL
    in its kernels). Anonymous memory only: the pages of shared libraries, which the kernel may drop
    from a process under memory pressure, would otherwise pull the peak down."""

    def __enter__(self) -> "AnonPeak":
        self.before = self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_one(arch: str, op: str, length: int) -> dict:
    """In this process: build, prepare, then measure one operation (peak over the RSS before it)."""
    from analysis.info_flow import info_flow
    from analysis.interventions import knockout

    tok = tokenizer()
    model = build(arch, len(tok))
    model.tokenizer = tok
    fact = fact_of_length(tok, length)
    tokens = torch.tensor([tok(fact["prompt"])["input_ids"]])
    with torch.no_grad():
        model(tokens[:, :16])  # warm up (hook order, kernels)

        def forward():
            return model(tokens)

        def cache():
            return model.run_with_cache(tokens, names_filter=lambda n: n.endswith(CACHE_HOOKS))

        def ko():
            with knockout(model, sources=range(tokens.shape[1] // 2), targets=[-1], layers=[0]):
                return model(tokens)

        def flow():
            return info_flow(model, [fact], window=1, require_correct=False, progress=False, batch_size=1)

        fn = {"forward": forward, "cache": cache, "knockout": ko, "info_flow": flow}[op]
        with AnonPeak() as mem:
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
        peak = mem.peak - mem.before
        del out
    return {"arch": arch, "op": op, "length": int(tokens.shape[1]), "peak": peak, "seconds": seconds}


def exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1.0)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS))
    ap.add_argument("--ops", nargs="+", default=list(OPS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", nargs=3, metavar=("ARCH", "OP", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], int(args.one[2]))))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    print(f"one layer at 130m width, float32, {args.threads} thread(s); peak = max anonymous RSS over its value "
          "before the op")
    print(f"{'model':8s} {'op':10s} " + " ".join(f"{L:>17d}" for L in args.lengths)
          + "   exp(mem) exp(time) exp(mem, last doubling)")
    for arch in args.archs:
        for op in args.ops:
            rows = []
            for length in args.lengths:
                out = subprocess.run([sys.executable, __file__, "--one", arch, op, str(length),
                                      "--threads", str(args.threads)], capture_output=True, text=True, env=env)
                if out.returncode:
                    raise RuntimeError(f"{arch} {op} {length}: {out.stderr[-2000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            cells = " ".join(f"{r['peak'] / 2**20:8.0f}MB {r['seconds']:6.2f}s" for r in rows)
            lengths = [r["length"] for r in rows]
            peaks = [r["peak"] for r in rows]
            print(f"{arch:8s} {op:10s} {cells}   {exponent(lengths, peaks):7.2f} "
                  f"{exponent(lengths, [r['seconds'] for r in rows]):8.2f} {exponent(lengths[-2:], peaks[-2:]):9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
