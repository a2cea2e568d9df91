"""Cost of padding in circuits: a padded batch of prompts of different lengths against the same shapes unpadded.

    python benchmarks/bench_circuit_padding.py [--model smollm2-135m] [--n 16] [--repeats 3] [--out FILE]

Prompts: known facts (analysis.tasks.known_facts) paired within one relation template and token length
(clean = a fact, corrupt = another fact's subject in the same template, as analysis.circuits.tasks.fact_pairs
does), the pairs taken round-robin over every length that pairs, so the batch spans several lengths. In one
run (ratios, never absolute times, are the result):
    padded     the pairs as lists of token ids: left-padded to the longest, run with the mask
    one length the same token batches [n width] without a mask (the pad ids read as tokens): the same
               shapes at one length, so the ratio is what padding itself costs (the mask path of every
               layer, the metric reading each prompt's last token, the diffs zeroed at pad positions)
    per prompt each pair alone (n batches of one), for scale
for EAP, EAP-IG (steps=5) and verify_circuit of the top 100 edges, the cases interleaved; the medians of
`repeats` runs are reported. Clock: on a CPU this process's CPU time with one thread (--threads), which a
shared machine's load does not inflate; on a GPU the wall time. The issue asks padded / one length <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from analysis.circuits import edge_attribution, verify_circuit
from analysis.circuits.metrics import AnswerDiff
from analysis.circuits.prompts import prompt_pair
from analysis.circuits.tasks import _pairs
from analysis.tasks.known_facts import load_facts, prepare_facts
from analysis.tasks.text import tokenizer_of
from loaders import from_pretrained


def clock(device: torch.device) -> float:
    """Seconds: this process's CPU time on a CPU (one thread: stable on a shared machine), wall time on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def timed(fn, repeats: int, device: torch.device) -> tuple[object, list[float]]:
    times, out = [], None
    for _ in range(repeats):
        t = clock(device)
        out = fn()
        times.append(clock(device) - t)
    return out, times


def padded_pairs(model, n: int) -> tuple[list[list[int]], list[list[int]], AnswerDiff]:
    """n (clean, corrupt) fact pairs of several token lengths, taken round-robin over the lengths."""
    prompts, _ = prepare_facts(tokenizer_of(model), load_facts())
    by_length: dict[int, list] = {}
    for p in prompts:
        by_length.setdefault(len(p.ids), []).append(p)
    pools = [_pairs(members) for _, members in sorted(by_length.items())]
    pools = [p for p in pools if p]
    chosen = []
    while len(chosen) < n and any(pools):
        for pool in pools:
            if pool and len(chosen) < n:
                chosen.append(pool.pop(0))
    clean, corrupt = [a.ids for a, _ in chosen], [b.ids for _, b in chosen]
    return clean, corrupt, AnswerDiff([a.answer for a, _ in chosen], [b.answer for _, b in chosen])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--per-prompt", action="store_true", help="also time each pair alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = from_pretrained(args.model)
    device = next(model.parameters()).device
    clean, corrupt, metric = padded_pairs(model, args.n)
    c, x = prompt_pair(model, [torch.tensor(r) for r in clean], [torch.tensor(r) for r in corrupt])
    lengths = c.lengths.tolist()
    cases = {  # name -> (clean, corrupt) as edge_attribution takes them
        "padded": (clean, corrupt),
        "one_length": (c.tokens, x.tokens),  # the same [n width] batches, no mask
    }
    top = edge_attribution(model, c.tokens, x.tokens, metric).top(100)  # warm-up; the circuit verified
    runs = {  # name -> fn(clean, corrupt)
        "eap": lambda a, b: edge_attribution(model, a, b, metric),
        "eap_ig": lambda a, b: edge_attribution(model, a, b, metric, method="eap-ig", steps=args.steps),
        "verify_100": lambda a, b: verify_circuit(model, top, a, b, metric),
    }
    times = {(case, run): [] for case in cases for run in runs}
    for _ in range(args.repeats):  # interleaved, so a change of load hits both alike
        for run, fn in runs.items():
            for case, (a, b) in cases.items():
                times[case, run] += timed(lambda: fn(a, b), 1, device)[1]
    result = {"model": args.model, "prompts": len(clean), "width": c.width, "lengths": lengths,
              "padding_fraction": 1 - sum(lengths) / (len(lengths) * c.width), "threads": torch.get_num_threads(),
              "device": str(device), "clock": "wall" if device.type == "cuda" else "process cpu time"}
    for case in cases:
        result[case] = {f"{run}_s": statistics.median(times[case, run]) for run in runs}
    for run in runs:
        result[f"ratio_{run}"] = result["padded"][f"{run}_s"] / result["one_length"][f"{run}_s"]
    if args.per_prompt:
        rows = list(zip(clean, corrupt))
        for run, fn in (("eap", lambda p, q, m: edge_attribution(model, p, q, m)),
                        ("verify_100", lambda p, q, m: verify_circuit(model, top, p, q, m))):
            _, t = timed(lambda: [fn([p], [q], metric.rows(slice(k, k + 1))) for k, (p, q) in enumerate(rows)],
                         1, device)
            result.setdefault("per_prompt", {})[f"{run}_s"] = t[0]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
