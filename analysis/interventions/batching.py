"""When many different interventions share one forward: the tiling rule.

Glossary
    replicas     r different interventions (ablations, patches) in one forward: the batch is tiled r
                 times along the batch axis and block j of rows (rows [j * batch, (j + 1) * batch))
                 carries intervention j. Each block's values equal that intervention run alone, up
                 to the rounding of a larger matmul (tests: within 1e-6).
    rule         `tiles_for`: on an accelerator, as many replicas as keep a forward under 512 rows
                 (its throughput grows with the batch); on CPU a forward of a few hundred thousand
                 activation elements per layer (rows x positions x d_model) is already compute-bound,
                 and tiling only saves per-forward overhead (hooks, small kernels), so replicas are
                 added while one forward stays under 2**17 elements. A hooked lazy quantity larger
                 than the stream (an SSM state hook_h: positions x d_inner x d_state per row) is
                 materialised for every row, so it counts instead of d_model when it is larger
                 (`per_row`): measured, tiling hook_h sweeps by the stream's size ran 0.4-0.5x.
                 Never more than 32.
                 benchmarks/bench_screening.py (ablations) and benchmarks/bench_batched_patching.py
                 (patches) measure both sides.
"""

from __future__ import annotations

from typing import Any

MAX_REPLICAS = 32
ACCELERATOR_ROWS = 512
CPU_ELEMENTS = 2**17


def tiles_for(model: Any, rows: int, width: int, limit: int | None = None, per_row: int = 0) -> int:
    """Interventions per forward for a batch of `rows` x `width` tokens (the rule above); `limit` caps it.

    per_row: elements per batch row of the largest hooked activation, when it exceeds the stream's
    width x d_model (a lazy SSM state).
    """
    if next(model.parameters()).device.type != "cpu":
        r = max(1, ACCELERATOR_ROWS // max(rows, 1))
    else:
        r = max(1, CPU_ELEMENTS // max(rows * max(width * model.cfg.d_model, per_row), 1))
    return max(1, min(r, MAX_REPLICAS, limit or MAX_REPLICAS))
