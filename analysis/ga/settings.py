"""The G&A settings object and the lap timer: what `rank_heads` and `ga_report` used to take as 16 loose
parameters each, in one frozen dataclass checked once at construction.

Glossary
    RankSettings  how the heads are ranked (ranking.py's glossary explains each): the method and its
                  screen (verify_top, n_control, prescreen_n, refine, stage_n, stage_keep), the ablation
                  (mode, channel_group), the batching (batch_size, replicas, reuse_prefix), the pairs
                  (pairs_top_k), the intervals (confidence, seed) and progress bars
    REPORT        the report's defaults (a screened ranking with a staged verification), `ga_report`'s
    settings_of   the settings a call runs with: `settings` (default: the entry point's) with the loose
                  keywords of the old call (`rank_heads(model, ex, batch_size=8)`) replaced, each checked
                  and refused in the entry point's name ("rank_heads: batch_size=0: must be >= 1")
    Laps          wall and CPU seconds of each step, one timer for the ranking and the report
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any

from hooked.validate import Flag, Integer, Number, OneOf, checked_fields


@dataclass(frozen=True)
@checked_fields(method=OneOf("exhaustive", "screened"), batch_size=Integer(ge=1), reuse_prefix=Flag(),
                pairs_top_k=Integer(ge=0), mode=OneOf("zero", "mean"), channel_group=Integer(ge=1, none=True),
                progress=Flag(), verify_top=Integer(ge=1), n_control=Integer(ge=0), seed=Integer(ge=0),
                replicas=Integer(ge=1, none=True), confidence=Number(gt=0, lt=1), prescreen_n=Integer(ge=1, none=True),
                refine=OneOf("none", "scores", "qk"), stage_n=Integer(ge=1, none=True), stage_keep=Integer(ge=1))
class RankSettings:
    method: str = "exhaustive"  # or "screened": estimate every unit, verify the best verify_top exactly
    batch_size: int = 16  # prompts per forward
    reuse_prefix: bool = True  # run the shared prompt prefix once (tasks.shared_prefix)
    pairs_top_k: int = 4  # units ablated two at a time: every pair of the top k
    mode: str = "zero"  # ablation: "zero" or "mean" (needs a mean_cache)
    channel_group: int | None = None  # Mamba-1 channels per unit (None: the default grouping)
    progress: bool = True
    verify_top: int = 60  # screened: units verified exactly
    n_control: int = 10  # screened: random other units verified too (the screen's misses)
    seed: int = 0
    replicas: int | None = None  # units per forward (None: the batching rule)
    confidence: float = 0.95
    prescreen_n: int | None = None  # screened: also ablate every unit on the first prescreen_n prompts
    refine: str = "none"  # screened: the estimate's refinement, "none", "scores" or "qk"
    stage_n: int | None = None  # screened: prompts of the first verification stage (None: one stage)
    stage_keep: int = 20  # screened: units the first stage sends on to every prompt


REPORT = RankSettings(method="screened", verify_top=40, stage_n=6, stage_keep=12)
FIELDS = tuple(f.name for f in fields(RankSettings))


def settings_of(settings: RankSettings | None, loose: dict[str, Any], default: RankSettings,
                where: str) -> RankSettings:
    """`settings` (None: `default`) with the loose keywords replaced (see the glossary), checked."""
    if settings is not None and not isinstance(settings, RankSettings):
        raise TypeError(f"{where}: settings: expected a RankSettings, got {type(settings).__name__}")
    unknown = sorted(set(loose) - set(FIELDS))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword arguments {unknown}; the settings are {list(FIELDS)}")
    try:
        return replace(settings or default, **loose)
    except ValueError as e:  # a loose keyword's error names the entry point it was given to (WrongType too)
        raise type(e)(str(e).replace(f"{RankSettings.__name__}:", f"{where}:", 1)) from None


class Laps:
    """Wall and CPU seconds of each step since the one before: `laps.lap("step")`, `laps.laps` (see the glossary)."""

    def __init__(self) -> None:
        self.laps: dict[str, dict[str, float]] = {}
        self.now = (time.perf_counter(), time.process_time())

    def lap(self, step: str) -> dict[str, float]:
        now = (time.perf_counter(), time.process_time())
        self.laps[step] = {"wall_s": now[0] - self.now[0], "cpu_s": now[1] - self.now[1]}
        self.now = now
        return self.laps[step]

    def total(self) -> dict[str, float]:
        return {k: sum(t[k] for t in self.laps.values()) for k in ("wall_s", "cpu_s")}
