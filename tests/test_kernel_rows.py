"""analysis.kernel_rows: kernel rows and columns of every SSM family == slices of hook_kernel.

Mamba-1, FalconMamba, Mamba-2 and Zamba2 (its Mamba layers, hybrid ones included), float64 within
1e-10, with padding; edits of dt are seen; positions are checked; non-SSM sites are refused.
"""

from __future__ import annotations

import pytest
import torch

from analysis.kernel_rows import kernel_cols, kernel_rows, ssm_sites
from hooked.models.mamba import MambaConfig
from hooked.models.mamba2 import Mamba2Config
from hooked.models.zamba2 import Zamba2Config
from hooked.models.families import build

EXACT = dict(atol=1e-10, rtol=1e-10)
POS = 23
MODELS = {
    "mamba": lambda: build(MambaConfig(n_layers=2, d_model=8, d_vocab=23, d_inner=12, d_state=4, dt_rank=3)),
    "falcon": lambda: build(MambaConfig(n_layers=2, d_model=8, d_vocab=23, d_state=5, mixer_rms_eps=1e-6)),
    "mamba2": lambda: build(Mamba2Config(n_layers=2, d_model=16, n_heads=4, d_head=8, d_state=8, n_groups=2,
                                                chunk_size=8, d_vocab=23)),
    "zamba2": lambda: build(Zamba2Config(n_layers=3, layer_types=("mamba", "hybrid", "mamba"), d_model=16,
                                                d_vocab=23, n_heads=4, d_state=8, n_groups=2, chunk_size=8,
                                                n_attn_heads=4, d_mlp=24)),
}


def make(name: str):
    torch.manual_seed(0)
    model = MODELS[name]().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def inputs():
    tokens = torch.randint(0, 23, (2, POS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, POS, dtype=torch.long)
    mask[1, :5] = 0  # left padding on the second row
    return tokens, mask


@pytest.mark.parametrize("name", MODELS)
def test_rows_and_cols_equal_hook_kernel_slices(name):
    model = make(name)
    tokens, mask = inputs()
    sites = ssm_sites(model)
    assert len(sites) == model.cfg.n_layers  # every layer has one SSM mixer in these configs
    _, cache = model.run_with_cache(tokens, mask, names_filter=lambda n: n.endswith("hook_kernel"))
    picked = [POS - 1, 3, -5, 3, 0]  # unsorted, a repeat, a negative
    idx = torch.tensor([p % POS for p in picked])
    rows, cols = kernel_rows(model, tokens, picked, attention_mask=mask), kernel_cols(model, tokens, picked,
                                                                                       attention_mask=mask)
    assert set(rows) == set(cols) == set(sites)
    for site in sites:
        full = cache[f"{site}.hook_kernel"]
        torch.testing.assert_close(rows[site], full[:, :, idx], **EXACT)
        torch.testing.assert_close(cols[site], full[:, :, :, idx], **EXACT)


def test_rows_see_an_edit_of_dt():
    model = make("mamba2")
    tokens, _ = inputs()
    site = ssm_sites(model)[0]
    double_dt = [(f"{site}.hook_dt", lambda x, hook: 2 * x)]
    with model.hooks(fwd_hooks=double_dt):
        _, cache = model.run_with_cache(tokens, names_filter=f"{site}.hook_kernel")
        rows = kernel_rows(model, tokens, [-1], sites=[site])
    torch.testing.assert_close(rows[site], cache[f"{site}.hook_kernel"][:, :, [POS - 1]], **EXACT)
    plain = kernel_rows(model, tokens, [-1], sites=[site])
    assert (rows[site] - plain[site]).abs().max() > 1e-3


def test_rows_see_an_edit_of_the_kernel():
    """With a hook on hook_kernel the slices come from the (edited) kernel itself."""
    model = make("mamba")
    tokens, _ = inputs()
    site = ssm_sites(model)[1]
    halve = [(f"{site}.hook_kernel", lambda x, hook: x / 2)]
    plain = kernel_rows(model, tokens, [-1, 4], sites=[site])[site]
    with model.hooks(fwd_hooks=halve):
        edited = kernel_rows(model, tokens, [-1, 4], sites=[site])[site]
        cols = kernel_cols(model, tokens, [2], sites=[site])[site]
    torch.testing.assert_close(edited, plain / 2, **EXACT)
    torch.testing.assert_close(cols, kernel_cols(model, tokens, [2], sites=[site])[site] / 2, **EXACT)


def test_bad_positions_and_sites_are_refused():
    model = make("mamba")
    tokens, _ = inputs()
    with pytest.raises(IndexError, match=f"rows={POS}: must be in \\[-{POS}, {POS}\\) \\(the {POS} positions\\)"):
        kernel_rows(model, tokens, [POS])
    with pytest.raises(TypeError, match="cols: expected an integer index .* got 1.5"):
        kernel_cols(model, tokens, [1.5])
    with pytest.raises(ValueError, match="not SSM mixers: \\['blocks.0.ln1'\\]"):
        kernel_rows(model, tokens, [0], sites=["blocks.0.ln1"])
