"""Gather-and-Aggregate (Bick, Xing, Gu 2025): which heads gather segments and which aggregate them.

    ranking  `rank_heads` (accuracy drop when each unit is ablated, pairs too; method="screened" verifies
             only the units an attribution pass picks), `head_units`, `expert_units` (mixture-of-experts
             experts as units), `HeadRanking`, `ranking_scorer` (the scorer a ranking keeps its clean
             run in: pass it to `rank_heads(scorer=)` and to later runs on the same prompts)
    screening  `estimate_effects` (every unit's ablation effect from one forward and backward; refine=
             "scores" (per-choice, exact log-softmax) or "qk" (+ AtP*'s QK fix, qk_fix.py))
    scores   `ga_scores` (gather / aggregate mass from patterns and SSM kernels), masking experiments
             (`gather_only`, `aggregate_only`, `restrict_heads`, `masked_accuracy`); a head's mixing
             weights are its site's `mixing().weights` (hooked.models.model_map)
    reads    role-aware read shares on the organisms' KV task (`reads`)
    report   `ga_report` and the `hooked ga` command
    settings `RankSettings`: how rank_heads and ga_report rank, one frozen object (their loose keywords too)

`kv_retrieval` and `score_choices` (analysis.tasks) are exported here too, as DESIGN.md section 5 names them.
"""

from analysis.ga.ranking import HeadRanking, Unit, expert_units, head_units, rank_heads, ranking_scorer
from analysis.ga.reads import reads
from analysis.ga.screening import estimate_effects
from analysis.ga.settings import RankSettings
from analysis.ga.report import ga_report
from analysis.ga.scores import aggregate_only, ga_scores, gather_only, masked_accuracy, restrict_heads
from analysis.tasks.scoring import score_choices
from analysis.tasks.text import kv_retrieval

__all__ = ["HeadRanking", "Unit", "expert_units", "head_units", "rank_heads", "ranking_scorer", "estimate_effects",
           "reads", "RankSettings",
           "ga_report", "aggregate_only",
           "ga_scores", "gather_only", "masked_accuracy", "restrict_heads", "score_choices", "kv_retrieval"]
