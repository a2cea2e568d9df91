"""Cost of edge attribution and exact verification, in forward-equivalents, on SmolLM2-135M.

    python benchmarks/bench_circuits.py [--model smollm2-135m] [--n 32] [--repeats 3] [--out FILE]

In one run (ratios, never absolute times, are the result): the wall time of one plain forward of the
n clean prompts (known facts with the subject swapped, analysis.circuits.tasks.fact_pairs) is the unit;
    EAP           edge_attribution(method="eap"): one corrupt forward, one clean forward and backward,
                  the receivers' vector-Jacobian products and the score product (issue 32 asks <= 4)
    EAP-IG        the same with steps=5
    verify 100    verify_circuit of the top 100 edges: the source recording and one patched forward
                  (plus the clean and corrupt metric forwards)
    edge effects  edge_effects of 32 edges alone, replicas batched, per edge
The medians of `repeats` runs are reported, with the graph's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from analysis.circuits import edge_attribution, edge_effects, verify_circuit
from analysis.circuits.tasks import fact_pairs
from loaders import from_pretrained


def timed(fn, repeats: int) -> tuple[object, float]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = from_pretrained(args.model)
    clean, corrupt, metric, _ = fact_pairs(model, n=args.n)
    with torch.no_grad():
        model(clean)  # warm-up
        _, forward = timed(lambda: model(clean), args.repeats)
    scores, eap = timed(lambda: edge_attribution(model, clean, corrupt, metric), args.repeats)
    _, eap_ig = timed(lambda: edge_attribution(model, clean, corrupt, metric, method="eap-ig", steps=5), args.repeats)
    top = scores.top(100)
    faith, verify = timed(lambda: verify_circuit(model, top, clean, corrupt, metric), args.repeats)
    _, effects = timed(lambda: edge_effects(model, scores.top(32), clean, corrupt, metric), 1)
    result = {"model": args.model, "prompts": list(clean.shape), "edges": len(scores),
              "senders": len(scores.graph.senders), "receivers": len(scores.graph.receivers),
              "forward_s": forward, "eap_forwards": eap / forward, "eap_ig5_forwards": eap_ig / forward,
              "verify_100_forwards": verify / forward, "faithfulness_top100": faith,
              "edge_effect_forwards_per_edge": effects / forward / 32, "threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
