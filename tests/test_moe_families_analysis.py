"""Every analysis on Mixtral, OLMoE, Qwen3-MoE and GPT-OSS (issue 42), with no analysis/ edit for them.

Tiny random models of tests/tiny_families.py's configs (vocabulary widened for the char tokenizer),
float64: knockout == zeroing the cut entries of hook_pattern ("scores" too: a -inf score, GPT-OSS's
sink keeps its share of the row); ablate_heads == zeroing the head's o_proj columns; ablate_experts ==
zeroing the experts' down projections (and GPT-OSS's down biases); patching the clean cache into the same
run is the clean run; fold_ln (and TL's other processing) keeps the log-probabilities; an SAE with its
error term leaves the logits bit-identical; each expert is a term of the residual decomposition. Then
rank_heads, ga_scores and info_flow run. Circuits (EAP, verify, token edges), attribution sums, hook axes,
backends and decoding cover these families through tiny_families in their own test files.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import build_tiny_hf
from test_sae import TinySAE
from tiny_families import CONFIGS

from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, act_patch, knockout, patch
from analysis.interventions.experts import ablate_experts, moe_layout
from analysis.tasks.known_facts import load_facts
from analysis.tasks.text import char_tokenizer, kv_retrieval
from hooked import backends
from loaders.load import from_hf

FAMILIES = ["mixtral", "olmoe", "qwen3_moe", "gpt_oss"]
V = 128  # the char tokenizer's ids fit
TOL = 1e-12


def model_of(name: str, dtype: torch.dtype = torch.float64, **processing):
    cls, config = CONFIGS[name]()
    config.vocab_size = V
    hf = build_tiny_hf(config, cls, perturb=0.1, dtype=dtype)
    sinks = pytest.warns(UserWarning, match="sinks") if name == "gpt_oss" and processing.get(
        "fold_value_biases") else contextlib.nullcontext()
    with sinks:
        model = from_hf(hf, **processing)
    model.tokenizer = char_tokenizer()
    return model


def tokens(n: int = 2, pos: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, (n, pos), generator=torch.Generator().manual_seed(seed))


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("mode", ["pattern", "scores"])
def test_knockout_equals_editing_the_cut_entries(name, mode):
    model, x = model_of(name), tokens()
    sources, targets, layer = [0, 2, 6], [3, 6, 9, 11], 1
    hook = f"blocks.{layer}.attn.hook_{'pattern' if mode == 'pattern' else 'attn_scores'}"

    def cut_entries(t, hook):
        t = t.clone()
        for j in targets:
            t[:, :, j, sources] = 0 if mode == "pattern" else -torch.inf
        return t

    with torch.no_grad():
        with backends.use(attention="eager"):
            plain = model(x)
        with knockout(model, sources=sources, targets=targets, layers=[layer], attention=mode):
            cut = model(x)
        ref = model.run_with_hooks(x, fwd_hooks=[(hook, cut_entries)])
    close(cut, ref, "knockout vs edited entries")
    assert not torch.allclose(cut, plain)
    # before the first target nothing moves (up to rounding: an expert's batch of rows changes with later ones)
    close(cut[:, :3], plain[:, :3], "positions before the first target")


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
def test_ablate_experts_equals_zeroing_their_down_projections(name):
    model, x = model_of(name), tokens()
    layout = moe_layout(model)
    assert layout and all(n == 4 for n in layout.values())
    prefix = next(iter(layout))
    with torch.no_grad():
        plain = model(x)
        with ablate_experts(model, [(prefix, 0), (prefix, 2)]):
            ours = model(x)
        moe = model.get_submodule(prefix)
        for param in ("down_proj", "down_bias"):
            if getattr(moe, param, None) is not None:
                getattr(moe, param)[[0, 2]] = 0
        ref = model(x)
    close(ours, ref, "ablated vs zeroed experts")
    assert not torch.allclose(ours, plain)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_expert_is_a_term_of_the_decomposition(name):
    """Expert e's term (its routing weight times its output, over the slots that chose it) is what removing it
    from that layer's output removes: hook_mlp_out minus the term == the MoE output with e ablated."""
    model, x = model_of(name), tokens()
    layer = int(next(iter(moe_layout(model))).split(".")[1])
    with torch.no_grad():
        _, cache = model.run_with_cache(x)
        stack, labels = cache.get_full_resid_decomposition(return_labels=True)
        with ablate_experts(model, [(layer, 1)]):
            _, ablated = model.run_with_cache(x, names_filter=[f"blocks.{layer}.hook_mlp_out"])
    term = stack[labels.index(f"L{layer}E1")]
    close(cache[f"blocks.{layer}.hook_mlp_out"] - term, ablated[f"blocks.{layer}.hook_mlp_out"], "mlp_out - term")
    assert term.abs().max() > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_patching_and_processing(name):
    """Patching the clean cache into the same run is the clean run; a sweep's entries differ where a
    corrupted run's activation goes in; TL's processing keeps log-probabilities; an SAE with the error
    term keeps the logits bit-identical."""
    model, x = model_of(name), tokens()
    corrupt = x.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 7) % V
    with torch.no_grad():
        clean_logits, clean = model.run_with_cache(x)
        close(patch(model, x, clean, "blocks.1.hook_resid_pre"), clean_logits, "self-patch")
        sweep = act_patch(model, corrupt, clean, lambda logits: logits[:, -1, 5].sum(), "blocks.{layer}.hook_resid_pre")
        plain_metric = model(corrupt)[:, -1, 5].sum()
        assert sweep.shape == (model.cfg.n_layers, x.shape[1])
        close(sweep[:, :2], plain_metric.expand(model.cfg.n_layers, 2), "positions before the change")
        assert not torch.allclose(sweep[0, 2], plain_metric)
        with pytest.warns(UserWarning, match="center_writing_weights skipped"):  # RMSNorm models, as TL
            processed = model_of(name, fold_ln=True, center_writing_weights=True, center_unembed=True,
                                 fold_value_biases=True)
        close(processed(x).log_softmax(-1), clean_logits.log_softmax(-1), "processed log-probs")
        plain = model(x)  # SDPA where no hook listens (clean_logits: eager, 1e-16 apart)
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
