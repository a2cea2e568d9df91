"""The G&A report's cost in forward-equivalents F, measured in one process.

    python benchmarks/ga_cost.py smollm2-135m --out docs/results/ga_smollm2_screened/full -- --pairs 5,10,20,30 --n 50 --rank-n 16

F is one forward of the ranking prompts the way the report scored them before the shared-prefix
scorer (one whole row per choice context: `ChoiceScorer(..., shared_prefix=False).scores()`), the
unit docs/results/ga_smollm2_screened/README.md counts in. It is timed (CPU seconds, the median
of 3) before and after the report, in the same process and under the same load; each stage of the
report's timing.json is then divided by it. One torch thread by default (`--threads`): CPU time of
two threads counts their waits on each other too, and the small forwards of a screen wait more. Wall
time is reported too (the machine is shared, so wall time swings with the load; CPU time much less).
Writes cost.json beside the report. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from analysis.ga.report import add_ga_parser, ga_report, task_for
from analysis.ga.settings import RankSettings
from analysis.tasks.scoring import ChoiceScorer
from loaders import from_pretrained


def forward_cost(model, examples) -> dict[str, float]:
    """CPU and wall seconds of one whole-row forward of `examples` (median of 3)."""
    scorer = ChoiceScorer(model, examples, 16, shared_prefix=False)
    cpu, wall = [], []
    for _ in range(3):
        c, w = time.process_time(), time.perf_counter()
        scorer.scores()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as every cost.json so far)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sub = argparse.ArgumentParser().add_subparsers()
    ga = add_ga_parser(sub).parse_args([args.model, "--out", args.out, "--no-progress", *extra])
    model = from_pretrained(args.model)
    sizes = [int(s) for s in ga.pairs.split(",")]
    examples = task_for(args.model)(sizes[0], ga.rank_n or ga.n, ga.seed)
    before = forward_cost(model, examples)
    settings = RankSettings(method="exhaustive" if ga.exhaustive else "screened", batch_size=ga.batch_size,
                            pairs_top_k=ga.top_k, channel_group=ga.channel_group, progress=False,
                            verify_top=ga.verify_top, n_control=ga.controls, seed=ga.seed, replicas=ga.replicas,
                            refine=ga.refine, stage_n=None if ga.one_stage else ga.stage_n, stage_keep=ga.stage_keep)
    summary = ga_report(model, args.out, sizes, ga.n, ga.rank_n, task=task_for(args.model), n_random=ga.random_draws,
                        settings=settings)
    after = forward_cost(model, examples)
    f_cpu = (before["cpu_s"] + after["cpu_s"]) / 2
    timing = summary["timing"]
    stages = {}
    for stage, t in timing.items():
        stages[stage] = {"cpu_s": t["cpu_s"], "wall_s": t["wall_s"], "F": t["cpu_s"] / f_cpu}
        for step, s in t.get("steps", {}).items():
            stages[f"{stage}.{step}"] = {"cpu_s": s["cpu_s"], "wall_s": s["wall_s"], "F": s["cpu_s"] / f_cpu}
    out = {"command": " ".join(["hooked ga", args.model, *extra]), "threads": args.threads, "F_before": before, "F_after": after,
           "F_cpu_s": f_cpu, "stages": stages, "total_F": timing["total"]["cpu_s"] / f_cpu,
           "screen": summary["screen"], "top10": [r["unit"] for r in summary["top"][:10]]}
    (Path(args.out) / "cost.json").write_text(json.dumps(out, indent=1))
    for stage, s in stages.items():
        print(f"{stage:>28}: {s['F']:6.2f} F  ({s['cpu_s']:.0f} s CPU, {s['wall_s']:.0f} s wall)")
    print(f"F = {f_cpu:.2f} s CPU (before {before['cpu_s']:.2f}, after {after['cpu_s']:.2f}); "
          f"total {out['total_F']:.1f} F")


if __name__ == "__main__":
    main()
