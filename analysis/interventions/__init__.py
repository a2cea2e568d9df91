"""Interventions: context managers and sweeps that change a forward through hooks, never weights.

    knockout     cut (target, source) edges in attention and SSM layers (DESIGN.md section 5):
                 `knockout`, `decay_norms`, `decay_split`, `feature_plan`, `feature_knockout`
    ablation     zero (or mean-ablate) heads, skip or replace blocks: `ablate_heads`, `ablate_heads_rows`
                 (one ablation per block of batch rows), `skip_layers`,
                 `replace_block`, `prune_from_end`, `remove_and_restore`, `head_layout`, `parse_head`
    experts      mixture-of-experts expert ablation: `ablate_experts` (optionally renormalising), `moe_layout`
    patching     activation patching (one generic loop plus setters) and attribution patching:
                 `patch`, `act_patch`, `attribution_patch`, metrics `logit_diff`, `answer_prob`, ...
    tl_patching  TransformerLens's `get_act_patch_*` names as thin calls of `act_patch`
    batching     `tiles_for`: how many interventions share one forward (one per block of tiled rows)
"""

from analysis.interventions.ablation import (ablate_heads, ablate_heads_rows, head_layout, parse_head, prune_from_end,
                                             remove_and_restore, replace_block, skip_layers)
from analysis.interventions.experts import ablate_experts, moe_layout
from analysis.interventions.knockout import (decay_norms, decay_split, feature_knockout, feature_plan,
                                             knockout)
from analysis.interventions.patching import (act_patch, answer_prob, attribution_patch, compare_attribution,
                                             head_patch, layer_inputs, logit_diff, normalised_score, output_patch,
                                             patch, resid_patch, run_patching, screened_patch,
                                             ssm_state_patch)
from analysis.interventions import tl_patching

__all__ = [
    "ablate_heads", "ablate_heads_rows", "head_layout", "parse_head", "prune_from_end", "remove_and_restore",
    "replace_block", "skip_layers", "ablate_experts", "moe_layout", "decay_norms", "decay_split", "feature_knockout",
    "feature_plan", "knockout",
    "act_patch", "answer_prob", "attribution_patch", "compare_attribution", "head_patch", "layer_inputs",
    "logit_diff", "normalised_score", "output_patch", "patch", "resid_patch", "run_patching", "screened_patch",
    "ssm_state_patch", "tl_patching",
]
