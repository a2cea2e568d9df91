"""CPU forward time of every tiny family, this checkout against another, as interleaved ratios.

    python benchmarks/bench_checkouts.py --before DIR [--after .] [--rounds 5] [--batch 8] [--pos 60] [--out FILE]

Each round runs one worker process in `after` then one in `before` (A B A B ...: drift hits both); a
worker builds every family of tests/tiny_families.py (float32, no hooks, no autograd), warms up and prints
the median of 5 forwards per family. The ratio after / before is taken per round and the median over
rounds is reported, with its min and max: below 1 is faster than `before`. Families the `before`
checkout lacks are left out. Never absolute times: machines here are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, statistics, sys, time
import torch
sys.path[:0] = [".", "tests"]
torch.set_num_threads(1)
from tiny_families import FAMILIES, V, tiny
batch, pos = int(sys.argv[1]), int(sys.argv[2])
tokens = torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(0))
out = {}
with torch.no_grad():
    for name in FAMILIES:
        model = tiny(name)
        model(tokens)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            model(tokens)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
print(json.dumps(out))
"""


def run(root: Path, batch: int, pos: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", WORKER, str(batch), str(pos)], cwd=root, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", default=Path("."), type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pos", type=int, default=60)  # gpt2 tiny has 64 positions
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        t = time.perf_counter()
        after = run(args.after.resolve(), args.batch, args.pos)
        before = run(args.before.resolve(), args.batch, args.pos)
        for name in after.keys() & before.keys():
            ratios.setdefault(name, []).append(after[name] / before[name])
        print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    table = {name: dict(median=statistics.median(v), min=min(v), max=max(v)) for name, v in sorted(ratios.items())}
    print(f"{'family':14s} after/before  (min - max over {args.rounds} rounds; batch {args.batch}, {args.pos} tokens)")
    for name, row in table.items():
        print(f"{name:14s} {row['median']:.3f}        ({row['min']:.3f} - {row['max']:.3f})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(batch=args.batch, pos=args.pos, rounds=args.rounds, ratios=table), indent=1))


if __name__ == "__main__":
    main()
