"""Shared-prefix choice scoring: the continuation's cost with shared keys/values over gathered copies, in one run.

    python benchmarks/bench_shared_prefix.py [--model smollm2-135m] [--sizes 5,30] [--examples 16,50]

For each kv_retrieval size (pairs, examples): CPU seconds (time.process_time) of the prefix forward,
of `DecodeState.select` and of the continuation forward, per `ChoiceScorer.prefix_batches` batch,
summed: once as `select` builds it (keys and values shared through a row map, shared_kv.py) and once
with every `SharedKV` gathered into the plain per-row copy cat([k0[index], own]) the state held before
(the reference: its gather is counted as part of select). Also reports the largest difference of the
continuations' final residuals, relative to the largest residual.
"""

from __future__ import annotations

import argparse
import time

import torch

from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import kv_retrieval
from hooked.models.decode_state import DecodeState
from hooked.models.shared_kv import SharedKV
from loaders import from_pretrained


def gathered(state: DecodeState) -> DecodeState:
    """`state` with its SharedKVs replaced by per-row copies (what select built before shared_kv.py)."""
    out = DecodeState()
    out._owners, out.length, out.past_mask, out.next_position = state._owners, state.length, state.past_mask, state.next_position
    out.entries = {key: (torch.cat([e.k0[e.rows.index], e.k1], 1), torch.cat([e.v0[e.rows.index], e.v1], 1))
                   if isinstance(e, SharedKV) else e for key, e in state.entries.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="5,30")
    parser.add_argument("--examples", default="16,50")
    args = parser.parse_args(argv)
    model = from_pretrained(args.model)
    n = model.cfg.n_layers
    print(f"{'size':>4} {'crows':>5} {'prefix s':>8} {'select s':>9} {'cont s':>7} {'copy select s':>13} "
          f"{'copy cont s':>11} {'ratio':>6} {'rel diff':>10}")
    for pairs, count in zip(map(int, args.sizes.split(",")), map(int, args.examples.split(","))):
        scorer = ChoiceScorer(model, kv_retrieval(pairs, count, 0), 16)
        t = dict.fromkeys(["prefix", "select", "cont", "copy_select", "copy_cont"], 0.0)
        diff, crows = 0.0, 0
        with torch.no_grad():
            for b in scorer.prefix_batches:
                if b.cont is None:
                    continue
                crows += len(b.source)
                clock = time.process_time()
                state = DecodeState()
                model(b.tokens, b.attention_mask, stop_at_layer=n, state=state)
                marks = [clock, time.process_time()]
                shared = state.select(b.source)
                marks.append(time.process_time())
                new = model(b.cont, stop_at_layer=n, state=shared)
                marks.append(time.process_time())
                copy = gathered(state.select(b.source))
                marks.append(time.process_time())
                old = model(b.cont, stop_at_layer=n, state=copy)
                marks.append(time.process_time())
                for key, a, z in zip(t, marks, marks[1:]):
                    t[key] += z - a
                diff = max(diff, ((new - old).abs().max() / old.abs().max()).item())
        ratio = (t["copy_select"] + t["copy_cont"]) / max(t["select"] + t["cont"], 1e-9)
        print(f"{pairs:>4} {crows:>5} {t['prefix']:>8.2f} {t['select']:>9.2f} {t['cont']:>7.2f} "
              f"{t['copy_select']:>13.2f} {t['copy_cont']:>11.2f} {ratio:>6.1f} {diff:>10.2e}")


if __name__ == "__main__":
    main()
