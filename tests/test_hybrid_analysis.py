"""Analysis on the hybrid families: expert ablation (== HF with the expert's down_proj zeroed; renormalised
== a brute-force reweighting), expert units in rank_heads, and knockout / ablate_heads / info_flow /
ga_scores / rank_heads running on every family (Bamba, Granite 4, Falcon-H1, NemotronH, Jamba).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from analysis.ga import expert_units, ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_experts, ablate_heads, knockout, moe_layout
from analysis.tasks.known_facts import load_facts
from analysis.tasks.scoring import accuracy, answer_logprob, score_choices
from analysis.tasks.text import char_tokenizer, kv_retrieval
from hooked import backends
from loaders.load import from_hf
from tests.hybrid_checks import perturbed

V = 128
SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=512)
MAMBA2 = dict(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
FAMILIES = {
    "bamba": lambda: transformers.BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=24,
                                              **MAMBA2, **SMALL),
    "granite": lambda: transformers.GraniteMoeHybridConfig(layer_types=["mamba", "attention", "mamba"],
                                                           num_hidden_layers=3, num_local_experts=4,
                                                           num_experts_per_tok=3, intermediate_size=12,
                                                           shared_intermediate_size=20, position_embedding_type="rope",
                                                           **MAMBA2, **SMALL),
    "falcon_h1": lambda: transformers.FalconH1Config(num_hidden_layers=2, mamba_d_ssm=32, intermediate_size=24,
                                                     ssm_multipliers=[0.5, 1.2, 0.8, 1.5, 0.7], **MAMBA2, **SMALL),
    "nemotron_h": lambda: transformers.NemotronHConfig(hybrid_override_pattern="M*E", head_dim=4, mamba_num_heads=4,
                                                       mamba_head_dim=8, n_groups=1, ssm_state_size=8, chunk_size=16,
                                                       intermediate_size=24, n_routed_experts=4,
                                                       num_experts_per_tok=2, moe_intermediate_size=12,
                                                       moe_shared_expert_intermediate_size=10, **SMALL),
    "jamba": lambda: transformers.JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                              mamba_d_state=8, intermediate_size=24, num_experts=4, **SMALL),
}


def family(name: str):
    config = FAMILIES[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    cls = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))
    hf = perturbed(cls(config), scale=0.1)
    model = from_hf(hf)
    model.tokenizer = char_tokenizer()
    return hf, model


def hf_experts(hf, layer: int):
    mod = hf.model.layers[layer]
    for attr in ("block_sparse_moe", "feed_forward", "mixer"):
        if hasattr(getattr(mod, attr, None), "experts"):
            return getattr(mod, attr).experts
    raise AssertionError(f"layer {layer} has no experts")


# ---------------------------------------------------------------------------------- experts
@pytest.mark.parametrize("name,layer,experts", [("granite", 2, [1]), ("granite", 0, [0, 3]),
                                                ("nemotron_h", 2, [2]), ("jamba", 1, [0, 1])])
def test_ablate_experts_equals_hf_with_their_down_proj_zeroed(name, layer, experts):
    hf, model = family(name)
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens)
        with ablate_experts(model, [(layer, e) for e in experts]):
            ours = model(tokens)
        assert torch.equal(model(tokens), plain), "hooks removed on exit"
        for e in experts:
            hf_experts(hf, layer).down_proj[e].zero_()
        ref = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    assert not torch.allclose(ours, plain, atol=1e-4)


@pytest.mark.parametrize("name,layer", [("granite", 0), ("jamba", 1)])
def test_renormalised_ablation_rescales_the_remaining_weights(name, layer):
    _, model = family(name)
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    site = f"blocks.{layer}.mlp"
    names = [f"{site}.hook_chosen", f"{site}.hook_routing_weights", f"{site}.hook_expert_out", "blocks.0.hook_resid_pre"]
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, names_filter=names)
        chosen, w = clean[names[0]], clean[names[1]]
        cut = chosen == 1
        kept = w.masked_fill(cut, 0)
        expected = kept * w.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True)  # brute force, per token
        with ablate_experts(model, [(layer, 1)], renormalise=True):
            _, cache = model.run_with_cache(tokens, names_filter=names)
    assert cut.any()
    torch.testing.assert_close(cache[names[1]], expected)
    if name == "granite":  # its router renormalises over the top k: the rescaled weights are softmax over the rest
        logits = model.get_submodule(site)
        with torch.no_grad():
            _, c2 = model.run_with_cache(tokens, names_filter=[f"{site}.hook_router_logits"])
        top = c2[f"{site}.hook_router_logits"].gather(-1, chosen).masked_fill(cut, -torch.inf)
        torch.testing.assert_close(cache[names[1]], top.softmax(-1))
        assert logits.n_experts == 4


def test_expert_specs_are_checked():
    _, model = family("granite")
    assert moe_layout(model) == {f"blocks.{l}.mlp": 4 for l in range(3)}
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        with ablate_experts(model, [("blocks.1.attn", 0)]):
            pass
    with pytest.raises(ValueError, match=r"expert \(0, 4\) is 4: must be in \[-4, 4\)"):
        with ablate_experts(model, [(0, 4)]):
            pass
    _, dense = family("bamba")
    with pytest.raises(ValueError, match="MoE layers: none"):
        with ablate_experts(dense, [(0, 0)]):
            pass


def test_rank_heads_with_expert_units():
    _, model = family("granite")
    examples = kv_retrieval(2, 3, seed=1)
    units = expert_units(model)
    assert [u.label for u in units[:5]] == ["L0E0", "L0E1", "L0E2", "L0E3", "L1E0"] and len(units) == 12
    ranking = rank_heads(model, examples, head_units(model)[:3] + units, batch_size=4, pairs_top_k=3, progress=False)
    row = next(r for r in ranking.rows if r["unit"] == "L2E1")
    assert row["kind"] == "expert"
    with ablate_experts(model, [(2, 1)]):
        scores = score_choices(model, examples, batch_size=4)
    assert row["accuracy"] == accuracy(scores, examples)
    assert row["logprob"] == pytest.approx(answer_logprob(scores, examples), abs=1e-9)
    assert ranking.matrix().shape[0] >= 1 and len(ranking.pairs) == 3


# ------------------------------------------------------------------- every family runs the tools
@pytest.mark.parametrize("name", list(FAMILIES))
def test_interventions_and_ga_run_on_every_family(name):
    _, model = family(name)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    kinds = {type(b).__name__ for b in model.blocks}
    units = head_units(model, channel_group=8)
    assert {u.module.rsplit(".", 1)[1] for u in units} >= ({"mixer"} if name == "nemotron_h" else {"attn", "mixer"})
    with torch.no_grad():
        with backends.use(attention="eager"):  # knockout's layers run eager: so does plain
            plain = model(tokens)
        with knockout(model, sources=[1, 2], targets=[-1], layers=range(model.cfg.n_layers)):
            cut = model(tokens)
        with ablate_heads(model, [units[0].specs()[0], units[-1].specs()[0]]):
            ablated = model(tokens)
    assert not torch.allclose(cut[:, -1], plain[:, -1]) and torch.equal(cut[:, :-1], plain[:, :-1])
    assert not torch.allclose(ablated, plain)
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()
    assert kinds


def test_parallel_layers_label_their_ssm_heads_apart():
    from analysis.interventions import parse_head

    _, model = family("falcon_h1")
    units = head_units(model)
    labels = [u.label for u in units]
    assert len(labels) == len(set(labels)) == 2 * (4 + 4)
    assert "L0H1" in labels and "L0M1" in labels
    by_label = {u.label: u for u in units}
    assert by_label["L0M1"].module == "blocks.0.mixer" and by_label["L0H1"].module == "blocks.0.attn"
    assert parse_head("L0M1") == ("blocks.0.mixer", 1) and parse_head("L0H1") == (0, 1)
