"""TL's get_act_patch_* names (analysis.interventions.tl_patching) give TL 3.9's grids on the same weights."""

from __future__ import annotations

import pytest
import torch

from analysis.interventions import tl_patching
from tests.tl_oracle import pair

CASES = [  # (function, archs): k / v on the GQA model have n_kv_heads columns in TL too
    ("get_act_patch_resid_pre", ["gpt2", "llama_gqa"]),
    ("get_act_patch_resid_mid", ["gpt2"]),
    ("get_act_patch_attn_out", ["gpt2"]),
    ("get_act_patch_mlp_out", ["llama_gqa"]),
    ("get_act_patch_attn_head_out_by_pos", ["gpt2", "llama_gqa"]),
    ("get_act_patch_attn_head_q_by_pos", ["llama_gqa"]),
    ("get_act_patch_attn_head_pattern_by_pos", ["gpt2"]),
    ("get_act_patch_attn_head_pattern_dest_src_pos", ["gpt2"]),
    ("get_act_patch_attn_head_all_pos_every", ["gpt2", "llama_gqa"]),
    ("get_act_patch_attn_head_by_pos_every", ["gpt2", "llama_gqa"]),  # the demos' DO_SLOW_RUNS sweeps
    ("get_act_patch_block_every", ["gpt2"]),
]
_RUNS: dict = {}


def run(arch: str):
    if arch not in _RUNS:
        ours, theirs, _, _ = pair(arch)
        gen = torch.Generator().manual_seed(7)
        clean = torch.randint(4, 48, (2, 6), generator=gen)
        corrupted = clean.clone()
        corrupted[:, 2] = torch.randint(4, 48, (2,), generator=gen)
        answer = clean[:, -1]

        def metric(logits):
            return logits[torch.arange(2), -1, answer].mean()

        with torch.no_grad():
            _, c_ours = ours.run_with_cache(clean)
            _, c_tl = theirs.run_with_cache(clean)
        _RUNS[arch] = (ours, theirs, corrupted, c_ours, c_tl, metric)
    return _RUNS[arch]


@pytest.mark.parametrize("name,arch", [(n, a) for n, archs in CASES for a in archs])
def test_tl_patching_grids_equal_tls(name, arch) -> None:
    from transformer_lens import patching as tl

    ours, theirs, corrupted, c_ours, c_tl, metric = run(arch)
    mine = getattr(tl_patching, name)(ours, corrupted, c_ours, metric)
    with torch.no_grad():
        theirs_grid = getattr(tl, name)(theirs, corrupted, c_tl, metric)
    assert mine.shape == theirs_grid.shape and mine.dtype == theirs_grid.dtype
    torch.testing.assert_close(mine, theirs_grid, rtol=1e-4, atol=1e-5)
