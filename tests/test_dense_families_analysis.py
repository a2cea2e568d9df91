"""Every analysis on GPT-NeoX, Gemma, Phi-3, OLMo-2 and OLMo-3 (issue 42), with no analysis/ edit for them.

Tiny random models of tests/tiny_families.py's configs (vocabulary widened for the char tokenizer),
float64: knockout == zeroing the cut entries of hook_pattern (windows and the parallel block included);
ablate_heads == zeroing the head's o_proj columns; patching the clean cache into the same run is the
clean run; fold_ln (and TL's other processing) keeps the log-probabilities; an SAE with its error term
leaves the logits bit-identical. Then rank_heads, ga_scores and info_flow run. Circuits (EAP, verify,
token edges), attribution sums, hook axes, backends and decoding cover these families through
tiny_families in their own test files.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_hf
from test_sae import TinySAE
from tiny_families import CONFIGS

from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, act_patch, knockout, patch
from analysis.tasks.known_facts import load_facts
from analysis.tasks.text import char_tokenizer, kv_retrieval
from hooked import backends
from loaders.load import from_hf

FAMILIES = ["gpt_neox", "gemma", "phi3", "olmo2", "olmo3"]
V = 128  # the char tokenizer's ids fit
TOL = 1e-12


def model_of(name: str, dtype: torch.dtype = torch.float64, **processing):
    cls, config = CONFIGS[name]()
    config.vocab_size = V
    model = from_hf(build_tiny_hf(config, cls, perturb=0.1, dtype=dtype), **processing)
    model.tokenizer = char_tokenizer()
    return model


def tokens(n: int = 2, pos: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, (n, pos), generator=torch.Generator().manual_seed(seed))


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("layer", [0, 1])
def test_knockout_equals_zeroing_the_pattern_entries(name, layer):
    model, x = model_of(name), tokens()
    sources, targets = [0, 2, 6], [3, 6, 9, 11]

    def zero(p, hook):
        p = p.clone()
        for j in targets:
            for i in sources:
                p[:, :, j, i] = 0
        return p

    with torch.no_grad():
        with backends.use(attention="eager"):
            plain = model(x)
        with knockout(model, sources=sources, targets=targets, layers=[layer], attention="pattern"):
            cut = model(x)
        ref = model.run_with_hooks(x, fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", zero)])
    close(cut, ref, "knockout vs zeroed pattern")
    assert not torch.allclose(cut, plain)
    close(cut[:, :3], plain[:, :3], "before the first target")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("keep", [False, True])
def test_ablate_heads_equals_zeroing_o_proj_columns(name, keep):
    model, x = model_of(name), tokens()
    attn = model.blocks[1].attn
    listed = [0, attn.n_heads - 1]
    with torch.no_grad():
        with ablate_heads(model, [("blocks.1.attn", h) for h in listed], keep=keep):
            ours = model(x)
        for h in range(attn.n_heads):
            if (h in listed) != keep:
                attn.o_proj.weight[:, h * attn.d_head:(h + 1) * attn.d_head] = 0
        ref = model(x)
    close(ours, ref, "ablated vs zeroed columns")


@pytest.mark.parametrize("name", FAMILIES)
def test_patching_and_processing(name):
    """Patching the clean cache into the same run is the clean run; a sweep's entries differ where a
    corrupted run's activation goes in; TL's processing keeps log-probabilities; an SAE with the error
    term keeps the logits bit-identical."""
    model, x = model_of(name), tokens()
    corrupt = x.clone()
    corrupt[:, 9] = (corrupt[:, 9] + 7) % V  # within reach of the last token through Phi-3's window
    with torch.no_grad():
        clean_logits, clean = model.run_with_cache(x)
        close(patch(model, x, clean, "blocks.1.hook_resid_pre"), clean_logits, "self-patch")
        sweep = act_patch(model, corrupt, clean, lambda logits: logits[:, -1, 5].sum(), "blocks.{layer}.hook_resid_pre")
        plain_metric = model(corrupt)[:, -1, 5].sum()
        assert sweep.shape == (model.cfg.n_layers, x.shape[1])
        close(sweep[:, :9], plain_metric.expand(model.cfg.n_layers, 9), "positions before the change")
        assert not torch.allclose(sweep[0, 9], plain_metric)
        processed = model_of(name, fold_ln=True, center_writing_weights=True, center_unembed=True,
                             fold_value_biases=True)
        close(processed(x).log_softmax(-1), clean_logits.log_softmax(-1), "processed log-probs")
        plain = model(x)
        model.add_sae(TinySAE(model.cfg.d_model, 24), "blocks.0.hook_resid_post", use_error_term=True)
        try:
            assert torch.equal(model(x), plain)
        finally:
            model.reset_saes()


@pytest.mark.parametrize("name", FAMILIES)
def test_ga_and_info_flow_run(name):
    model = model_of(name, torch.float32)
    units = head_units(model)
    assert {u.module.rsplit(".", 1)[1] for u in units} == {"attn"}
    assert len(units) == model.cfg.n_layers * model.cfg.n_heads
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:3], batch_size=2, pairs_top_k=0, progress=False)
    assert len(ranking.rows) == 3
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()
