"""Every analysis on MiniMax (lightning attention, softmax attention, MoE, the stream through its norms), with
no analysis/ edit for it.

Tiny random model of tests/tiny_families.py's config (vocabulary widened for the char tokenizer), float64:
ablate_heads on a lightning layer == zeroing the head's out_proj columns (its norm reads every head, so the
columns after it); knockout on every layer kind runs and, on the lightning layers, removes exactly the cut
kernel terms; patching the clean cache into the same run is the clean run, and an act_patch sweep over
hook_h by position equals patches by hand; an SAE with its error term leaves the logits bit-identical;
kernel_rows / kernel_cols equal hook_kernel's slices; the head units of both kinds rank, G&A scores, info_flow
and EAP / verify_circuit run and give finite numbers. The residual decompositions (carried through each step's
renormalisation, hooked/cache_resid.py) sum exactly in tests/test_attribution_exact.py and test_model_map.py;
"every edge patched == the corrupt run" is not asked of this family (tests/test_circuits_exact.py): each
step renormalises the stream (norm_residual.py), so a receiver reads no sum of senders.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_hf
from test_sae import TinySAE
from tiny_families import CONFIGS

from analysis.circuits import edge_attribution, verify_circuit
from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, act_patch, knockout, patch
from analysis.kernel_rows import kernel_cols, kernel_rows, ssm_sites
from analysis.tasks.known_facts import load_facts
from analysis.tasks.text import char_tokenizer, kv_retrieval
from loaders.load import from_hf

V = 128  # the char tokenizer's ids fit
TOL = 1e-12


def model_of(dtype: torch.dtype = torch.float64):
    cls, config = CONFIGS["minimax"]()
    config.vocab_size = V
    model = from_hf(build_tiny_hf(config, cls, perturb=0.1, dtype=dtype))
    model.tokenizer = char_tokenizer()
    return model


def tokens(n: int = 2, pos: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, (n, pos), generator=torch.Generator().manual_seed(seed))


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("keep", [False, True])
def test_ablate_lightning_heads_equals_zeroing_out_proj_columns(keep):
    model, x = model_of(), tokens()
    mixer = model.blocks[0].mixer
    listed = [1, 3]
    with torch.no_grad():
        plain = model(x)
        with ablate_heads(model, [("blocks.0.mixer", h) for h in listed], keep=keep):
            ours = model(x)
        for h in range(mixer.n_heads):
            if (h in listed) != keep:
                mixer.out_proj.weight[:, h * mixer.d_head:(h + 1) * mixer.d_head] = 0
        ref = model(x)
    close(ours, ref, "ablated vs zeroed columns")
    assert not torch.allclose(ours, plain)


def test_knockout_on_every_layer_kind():
    model, x = model_of(), tokens()
    sources, targets = [0, 2, 6], [3, 6, 9, 11]
    cut = torch.zeros(12, 12, dtype=torch.bool)
    cut[torch.tensor(targets)[:, None], torch.tensor(sources)] = True

    def zero(kernel, hook):
        return kernel.masked_fill(cut, 0.0)
    with torch.no_grad():
        plain = model(x)
        with knockout(model, sources=sources, targets=targets, layers=[0, 2]):
            lightning = model(x)
        ref = model.run_with_hooks(x, fwd_hooks=[(f"blocks.{l}.mixer.hook_kernel", zero) for l in (0, 2)])
        with knockout(model, sources=sources, targets=targets, layers=range(3), attention="pattern"):
            every = model(x)
    close(lightning, ref, "lightning knockout vs zeroed kernel entries")
    close(lightning[:, :3], plain[:, :3], "before the first target")
    assert not torch.allclose(every, lightning) and torch.isfinite(every).all()


def test_patching_and_saes():
    model, x = model_of(), tokens()
    corrupt = x.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 7) % V
    hook = "blocks.0.mixer.hook_h"
    with torch.no_grad():
        clean_logits, clean = model.run_with_cache(x, names_filter=lambda n: n == hook or "resid_pre" in n)
        close(patch(model, x, clean, "blocks.1.hook_resid_pre"), clean_logits, "self-patch")
        sweep = act_patch(model, corrupt, clean, lambda logits: logits[:, -1, 5].sum(), "blocks.{layer}.mixer.hook_h",
                          over=("layer", "pos"), layers=[0])
        for t in (1, 2, 7):
            def one(h, hook, t=t):
                h = h.clone()
                h[:, t] = clean[hook.name][:, t]
                return h
            by_hand = model.run_with_hooks(corrupt, fwd_hooks=[(hook, one)])[:, -1, 5].sum()
            close(sweep[0, t], by_hand, f"act_patch over hook_h at {t}")
        plain = model(x)
        model.add_sae(TinySAE(model.cfg.d_model, 24).double(), "blocks.0.hook_resid_post", use_error_term=True)
        try:
            assert torch.equal(model(x), plain)
        finally:
            model.reset_saes()


def test_kernel_rows_and_cols_equal_hook_kernel_slices():
    model, x = model_of(), tokens()
    sites = ssm_sites(model)
    assert sites == ["blocks.0.mixer", "blocks.2.mixer"]
    rows, cols = kernel_rows(model, x, [11, 4]), kernel_cols(model, x, [0, 5])
    with torch.no_grad():
        _, cache = model.run_with_cache(x, names_filter=[f"{s}.hook_kernel" for s in sites])
    for s in sites:
        close(rows[s], cache[f"{s}.hook_kernel"][:, :, [11, 4]], f"{s} rows")
        close(cols[s], cache[f"{s}.hook_kernel"][..., [0, 5]], f"{s} cols")


def test_ga_info_flow_and_circuits_run():
    model = model_of(torch.float32)
    units = head_units(model)
    kinds = {u.module.rsplit(".", 1)[1] for u in units}
    assert kinds == {"mixer", "attn"} and len(units) == model.cfg.n_layers * model.cfg.n_heads
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:3], batch_size=2, pairs_top_k=0, progress=False)
    assert len(ranking.rows) == 3
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()
    clean, corrupt = tokens(seed=2), tokens(seed=3)

    def metric(logits):
        return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()
    edges = edge_attribution(model, clean, corrupt, metric)
    assert len(edges) > 0 and torch.isfinite(edges.scores).all() and edges.scores.abs().max() > 0
    assert torch.isfinite(torch.tensor(verify_circuit(model, edges.top(5), clean, corrupt, metric)))
