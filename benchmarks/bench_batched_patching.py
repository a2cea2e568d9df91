"""Batched vs sequential activation-patching sweeps on CPU, on the organisms.

    python benchmarks/bench_batched_patching.py [--organisms llama-kv,gpt2-kv,mamba-kv,mamba2-kv] [--out FILE]

For each organism and sweep (residual and SSM state by layer x position; attention heads by layer x
position x head), in one run (ratios of the best of 3 interleaved wall times, never absolute times,
are the result): `act_patch` with one patch per forward (replicas=1) over the batching rule's choice
(`tiles_for` via `patch_replicas`) and over a fixed 8 patches per forward, at a small base batch
(4 prompts: the regime the rule tiles) and a larger one (32), with the max |difference| of the
values. Base run: key-value prompts (8 pairs); the source cache is a second draw with other keys and
values (denoising direction); metric: answer logit minus the corrupted prompt's answer logit.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from analysis.interventions.patching import act_patch, logit_diff, patch_replicas
from analysis.tasks import token_kv as kv_task
from loaders import from_pretrained
from loaders.organisms import accuracy as card


def timed_together(fns: dict, repeats: int = 3) -> tuple[dict, dict]:
    """({name: result}, {name: best wall time}): the runs interleaved, `repeats` rounds, the minimum of
    each kept (the machine is shared: interleaving spreads its load over all of them alike)."""
    out, best = {}, dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            out[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return out, best


def sweeps(model) -> list[tuple[str, tuple[str, ...]]]:
    names = set(model.hook_dict)
    out = [("blocks.{layer}.hook_resid_pre", ("layer", "pos"))]
    if "blocks.0.attn.hook_z" in names:
        out.append(("blocks.{layer}.attn.hook_z", ("layer", "pos", "head")))
    if "blocks.0.mixer.hook_h" in names:
        out.append(("blocks.{layer}.mixer.hook_h", ("layer", "pos")))  # every head / channel at once
    return out


def bench(name: str, batch: int) -> list[dict]:
    model = from_pretrained(f"organism/{name}")
    fmt = card(name)["fmt"]
    clean_p, corrupt_p = kv_task.prompts(8, batch, seed=3, fmt=fmt), kv_task.prompts(8, batch, seed=4, fmt=fmt)
    clean, corrupted = clean_p.tokens, corrupt_p.tokens
    answer = clean_p.choices.gather(1, clean_p.answer[:, None])[:, 0]
    wrong = corrupt_p.choices.gather(1, corrupt_p.answer[:, None])[:, 0]
    metric = logit_diff(answer, wrong)
    rows = []
    for template, over in sweeps(model):
        head, _, tail = template.partition("{layer}")
        _, cache = model.run_with_cache(clean, names_filter=lambda n, h=head, t=tail: n.startswith(h) and n.endswith(t))
        act_patch(model, corrupted, cache, metric, template, over, layers=[0])  # warm-up
        res, t = timed_together({r: (lambda r=r, c=cache, tp=template, o=over:
                                     act_patch(model, corrupted, c, metric, tp, o, replicas=r))
                                 for r in (1, None, 8)})
        (one, rule, eight), (t_one, t_rule, t_eight) = res.values(), t.values()
        ok = ~one.isnan()
        rows.append({"organism": name, "batch": batch, "hook": template, "over": list(over),
                     "patches": int(ok.sum()), "tokens": list(clean.shape),
                     "rule_replicas": patch_replicas(model, corrupted, None, cache[template.format(layer=0)]),
                     "sequential_over_rule": t_one / t_rule, "sequential_over_8": t_one / t_eight,
                     "max_abs_diff": max((rule[ok] - one[ok]).abs().max().item(),
                                         (eight[ok] - one[ok]).abs().max().item())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--organisms", default="llama-kv,gpt2-kv,mamba-kv,mamba2-kv")
    p.add_argument("--batches", default="4,32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for name in args.organisms.split(","):
        for batch in map(int, args.batches.split(",")):
            for r in bench(name, batch):
                rows.append(r)
                print(f"{name:>10} batch {batch:>2} {r['hook'].split('.')[-1]:>15} {'x'.join(r['over']):>15}: "
                      f"{r['patches']} patches, rule tiles {r['rule_replicas']}: sequential/rule "
                      f"{r['sequential_over_rule']:.2f}x, sequential/8 {r['sequential_over_8']:.2f}x, "
                      f"max diff {r['max_abs_diff']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
