"""When many different interventions share one forward: the tiling rule of issue 17.

Glossary
    replicas     r different interventions (ablations, patches) in one forward: the batch is tiled r
                 times along the batch axis and block j of rows (rows [j * batch, (j + 1) * batch))
                 carries intervention j. Each block's values equal that intervention run alone, up
                 to the rounding of a larger matmul (tests: within 1e-6).
    rule         `tiles_for`: on an accelerator, as many replicas as keep a forward under 512 rows
                 (its throughput grows with the batch); on CPU a forward of a few hundred thousand
                 activation elements per layer (rows x positions x d_model) is already compute-bound,
                 and tiling only saves per-forward overhead (hooks, small kernels), so replicas are
                 added while one forward stays under 2**17 elements. Never more than 32.
                 benchmarks/bench_screening.py (ablations) and benchmarks/bench_batched_patching.py
                 (patches) measure both sides.
"""

from __future__ import annotations

from typing import Any

MAX_REPLICAS = 32
ACCELERATOR_ROWS = 512
CPU_ELEMENTS = 2**17


def tiles_for(model: Any, rows: int, width: int, limit: int | None = None) -> int:
    """Interventions per forward for a batch of `rows` x `width` tokens (the rule above); `limit` caps it."""
    if next(model.parameters()).device.type != "cpu":
        r = max(1, ACCELERATOR_ROWS // max(rows, 1))
    else:
        r = max(1, CPU_ELEMENTS // max(rows * width * model.cfg.d_model, 1))
    return max(1, min(r, MAX_REPLICAS, limit or MAX_REPLICAS))
