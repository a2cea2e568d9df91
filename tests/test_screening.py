"""Screened rankings, batched interventions and intervals.

Glossary
    screened     rank_heads(method="screened"): attribution estimate for every unit, exact ablation
                 of the top candidates and of a random control set
    exhaustive   rank_heads(method="exhaustive"): every unit ablated exactly
    circuit      the organisms' known units (tests/test_organisms.py; docs/results/organisms/):
                 Llama-kv / GPT-2-kv layer-0 movers on top, Mamba-2-kv and Zamba2-kv layer-0 heads
    replicas     units ablated in one forward, one per block of batch rows (ablate_heads_rows)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from analysis.ga.ranking import head_units, rank_heads
from analysis.intervals import clopper_pearson, paired_interval, separable
from analysis.interventions.ablation import ablate_heads, ablate_heads_rows
from analysis.tasks import token_kv as kv_task
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import kv_retrieval
from loaders.organisms import accuracy as card, available_for

sys.path.insert(0, str(Path(__file__).parent))
from test_ga import _model, _same_rows  # noqa: E402  (the tiny random models of every family)

ARCHS = ["gpt2", "llama", "mamba", "mamba2", "zamba2"]


# ----------------------------------------------------------------------------------- intervals
@pytest.mark.parametrize("k, n, lo, hi", [(0, 10, 0.0, 0.30850), (5, 10, 0.18709, 0.81291),
                                          (9, 16, 0.29878, 0.80247), (16, 16, 0.79409, 1.0), (1, 1, 0.025, 1.0)])
def test_clopper_pearson_matches_tables(k, n, lo, hi):
    got = clopper_pearson(k, n)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor([lo, hi], dtype=torch.float64),
                               rtol=0, atol=2e-5)


def test_paired_interval_and_separability():
    diff = torch.full((20,), 0.5)
    assert paired_interval(diff) == pytest.approx((0.5, 0.5))
    yes, (lo, hi) = separable(torch.ones(30), torch.zeros(30))
    assert yes and lo == pytest.approx(1.0)
    noisy = torch.tensor([1.0, -1.0] * 10)
    no, (lo, hi) = separable(noisy, torch.zeros(20))
    assert not no and lo < 0 < hi
    with pytest.raises(ValueError, match=r"clopper_pearson: k=3: must be in \[0, 2\]"):
        clopper_pearson(3, 2)


# ------------------------------------------------------------------------- batched ablations
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_row_ablation_equals_one_ablation_per_forward(arch, mode):
    model = _model(arch)
    scorer = ChoiceScorer(model, kv_retrieval(3, 5, seed=2), batch_size=8)
    units = head_units(model, channel_group=8)
    groups = [units[0].specs(), units[-1].specs() + units[1].specs(), []]
    mean_cache = None
    if mode == "mean":
        _, mean_cache = model.run_with_cache(scorer.batches[0].tokens, scorer.batches[0].attention_mask)
    with ablate_heads_rows(model, groups, mode=mode, mean_cache=mean_cache):
        batched = scorer.scores(replicas=len(groups))
    for g, group in enumerate(groups):
        with ablate_heads(model, group, mode=mode, mean_cache=mean_cache):
            alone = scorer.scores()
        torch.testing.assert_close(batched[g], alone, rtol=0, atol=1e-6)
    assert not torch.equal(batched[0], batched[2])  # the ablations differ (the test can fail)


@pytest.mark.parametrize("arch", ["llama", "mamba2", "zamba2"])
def test_rank_heads_batched_equals_sequential(arch):
    model = _model(arch)
    examples = kv_retrieval(3, 6, seed=1)
    units = head_units(model, channel_group=8)
    seq = rank_heads(model, examples, units, batch_size=8, pairs_top_k=3, progress=False, replicas=1)
    bat = rank_heads(model, examples, units, batch_size=8, pairs_top_k=3, progress=False, replicas=5)
    assert [r["unit"] for r in seq.rows] == [r["unit"] for r in bat.rows]
    for a, b in zip(seq.rows, bat.rows):
        assert a["accuracy"] == b["accuracy"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-6)


def test_rows_must_split_evenly():
    model = _model("llama")
    tokens = torch.zeros(3, 4, dtype=torch.long)
    with ablate_heads_rows(model, [[(0, 0)], [(0, 1)]]), pytest.raises(ValueError, match="equal blocks"):
        model(tokens)


# ------------------------------------------------------------------------- gradient path
@pytest.mark.parametrize("arch, hook", [("mamba", "blocks.0.mixer.hook_h"), ("mamba2", "blocks.1.mixer.hook_h"),
                                        ("mamba2", "blocks.0.mixer.hook_kernel"), ("llama", "blocks.1.attn.hook_result")])
def test_identity_hook_with_grad_keeps_values_and_the_gradient_path(arch, hook):
    """A lazy quantity returned unchanged but on its own gradient path: same logits (1e-6), and d logits
    / d quantity exists and is nonzero (no one-ulp nudge)."""
    model = _model(arch)
    tokens = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
    seen = {}

    def grab(act, hook):
        seen["x"] = act.detach().clone().requires_grad_(True)
        return seen["x"]

    with torch.enable_grad(), model.hooks(fwd_hooks=[(hook, grab)]):
        logits = model(tokens)
        (grad,) = torch.autograd.grad(logits[:, -1].logsumexp(-1).sum(), [seen["x"]], allow_unused=True)
    torch.testing.assert_close(logits.detach(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    assert grad is not None and grad.abs().max() > 0


# ----------------------------------------------------------------------------- screened rankings
def test_screened_ranking_marks_what_it_verified():
    model = _model("llama")
    examples = kv_retrieval(3, 8, seed=1)
    units = head_units(model)
    ex = rank_heads(model, examples, units, batch_size=8, pairs_top_k=2, progress=False)
    sc = rank_heads(model, examples, units, method="screened", verify_top=3, n_control=2, batch_size=8,
                    pairs_top_k=2, progress=False)
    verified = [r for r in sc.rows if r["verified"]]
    assert 3 <= len(verified) == sc.screen["n_verified"] <= 3 * 3 + 2 and len(sc.rows) == len(units)
    assert sum(r["control"] for r in sc.rows) == 2 and all(r["verified"] for r in sc.rows if r["control"])
    assert all(r["drop"] != r["drop"] for r in sc.rows if not r["verified"])  # NaN: estimate only
    exact = {r["unit"]: r for r in ex.rows}
    for r in verified:  # a verified unit's exact numbers are the exhaustive ones
        assert r["accuracy"] == exact[r["unit"]]["accuracy"]
        assert r["logprob"] == pytest.approx(exact[r["unit"]]["logprob"], abs=1e-6)  # tiling rounds differently
    assert sc.rows[: len(verified)] == verified  # verified first
    with pytest.raises(ValueError, match="method"):
        rank_heads(model, examples, units, method="fast", progress=False)


def test_screen_that_would_verify_every_unit_ranks_exhaustively(monkeypatch):
    import analysis.ga.screening as screening

    model = _model("llama")
    examples = kv_retrieval(3, 8, seed=1)
    units = head_units(model)
    monkeypatch.setattr(screening, "estimate_effects", lambda *a, **k: pytest.fail("estimated what it verifies"))
    sc = rank_heads(model, examples, units, method="screened", verify_top=len(units), batch_size=8, pairs_top_k=2,
                    progress=False)
    ex = rank_heads(model, examples, units, batch_size=8, pairs_top_k=2, progress=False)
    assert sc.method == "exhaustive" and sc.screen["n_units"] == len(units) and "exhaustive" in sc.screen
    assert [r["unit"] for r in sc.rows] == [r["unit"] for r in ex.rows]
    assert [r["accuracy"] for r in sc.rows] == [r["accuracy"] for r in ex.rows]


def _shipped(name: str) -> bool:
    return name in available_for("kv") and card(name)["accuracy"].get(8, 0.0) >= 0.8


# Known circuits (docs/results/organisms/*/ranking.csv, 200 prompts): the exhaustive top units, which
# the screened ranking must return with identical exact numbers.
CIRCUITS = {
    "llama-kv": dict(top=3, layer0=3),  # key and value movers then a layer-0 head; the readers via pairs
    "gpt2-kv": dict(top=4, layer0=1),  # key mover first, value movers within the top 4
    "mamba2-kv": dict(top=2, layer0=4),  # layer-0 SSM heads 0, 1, 4, 2 (then 5, 3; 6, 7 and layer 1 write nothing)
    "zamba2-kv": dict(top=3, layer0=3),  # layer-0 Mamba-2 heads L0H0, L0H1, L0H5
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(not _shipped(n), reason=f"{n} not shipped"))
                                  for n in CIRCUITS])
def test_screened_ranking_finds_the_organism_circuit_exactly(name, organism):
    model = organism(name)
    examples = kv_task.examples(8, 80, seed=31, fmt=card(name)["fmt"])
    expect = CIRCUITS[name]
    k = expect["top"]
    readers = []
    if name in ("llama-kv", "gpt2-kv"):  # the layer-1 readers: the two best aggregate scorers, paired
        from analysis.ga.scores import ga_scores

        scores = ga_scores(model, examples[:40])
        readers = sorted(scores, key=lambda u: -scores[u]["aggregate"])[:2]
    ex = rank_heads(model, examples, batch_size=40, pairs_top_k=k, progress=False, pair_with=readers)
    sc = rank_heads(model, examples, method="screened", verify_top=4, n_control=1, batch_size=40, pairs_top_k=k,
                    progress=False, prescreen_n=20, pair_with=readers)
    assert sc.top(k) == ex.top(k), (sc.rows[:k], ex.rows[:k])
    _same_rows(sc.rows[:k], [{**r, **{key: s[key] for key in s if key.startswith(("est_", "pre_", "stage"))
                                     or key == "control"}} for r, s in zip(ex.rows[:k], sc.rows[:k])])  # exact numbers
    assert {r["layer"] for r in sc.rows[:expect["layer0"]]} == {0}
    assert sc.screen["n_verified"] <= 4 * 4 + 1 + len(readers)
    _same_rows(sc.pairs, ex.pairs)
    if readers:  # the readers are redundant alone, and together take retrieval to chance, in both rankings
        pair = next(p for p in sc.pairs if set(p["pair"].split("+")) == set(readers))
        assert all(r.startswith("L1") for r in readers) and pair["accuracy"] < 0.3, (readers, pair)


def test_info_flow_rows_carry_the_log_prob_change_with_its_interval():
    from analysis.info_flow import InfoFlowResult, mean_interval

    changes = torch.tensor([[[-50.0, 0.0]], [[-75.0, 10.0]], [[0.0, -10.0]]], dtype=torch.float64)  # [fact source window]
    result = InfoFlowResult(1, ("last",), [0, 1], [1, 2], [{}] * 3, changes)
    row = result.summary()[0]
    logp = torch.log(1 + changes[:, 0, 0] / 100)
    assert (row["logprob_change"], row["logprob_ci_low"], row["logprob_ci_high"]) == pytest.approx(mean_interval(logp))
    assert row["logprob_change"] == pytest.approx((torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25))).item() / 3)


@pytest.mark.parametrize("arch, template, over", [("llama", "blocks.{layer}.attn.hook_z", ("layer", "head")),
                                                  ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "pos")),
                                                  ("mamba", "blocks.{layer}.mixer.hook_gated", ("layer", "pos"))])
def test_screened_patch_verifies_exactly_what_act_patch_gives(arch, template, over):
    from analysis.interventions.patching import act_patch, logit_diff, screened_patch

    model = _model(arch)
    g = torch.Generator().manual_seed(3)
    clean, corrupt = torch.randint(0, 100, (2, 6), generator=g), torch.randint(0, 100, (2, 6), generator=g)
    head, _, tail = template.partition("{layer}")
    _, cache = model.run_with_cache(clean, names_filter=lambda n: n.startswith(head) and n.endswith(tail))
    metric = logit_diff(3, 5)
    out = screened_patch(model, corrupt, cache, metric, template, over, verify_top=3, n_control=2)
    full = act_patch(model, corrupt, cache, metric, template, over)
    v = out["verified"]
    assert int(v.sum()) == 5 and int(out["control"].sum()) == 2 and out["estimate"].shape == full.shape
    torch.testing.assert_close(out["exact"][v], full[v], rtol=0, atol=1e-5)
    assert out["exact"][~v].isnan().all()


def test_batching_rule_tiles_small_cpu_forwards_only():
    from analysis.ga.ranking import replicas_for

    model = _model("llama")  # d_model 32
    small = ChoiceScorer(model, kv_retrieval(3, 4, seed=1), batch_size=4)
    big = ChoiceScorer(model, kv_retrieval(40, 64, seed=1), batch_size=64)
    rows = max(len(b.tokens) for b in small.batches)
    width = max(b.tokens.shape[1] for b in small.batches)
    assert replicas_for(model, small) == min(32, 2**17 // (rows * width * 32)) > 1
    assert replicas_for(model, big) == 1 and replicas_for(model, small, limit=2) == 2


@pytest.mark.parametrize("method", ["screened", "exhaustive"])
def test_ga_report_states_method_intervals_separability_and_timing(method, tmp_path):
    from analysis.ga.report import ga_report

    model = _model("llama")
    summary = ga_report(model, tmp_path, [3, 4], n=6, rank_n=6, batch_size=8, pairs_top_k=2, progress=False,
                        n_random=1, method=method, verify_top=2, n_control=1)
    assert summary["method"] == method and summary["separability_statement"].startswith("Of the top")
    assert {"accuracy_lo", "accuracy_hi", "logprob_lo", "logprob_hi"} <= set(summary["sizes"][0])
    assert summary["sizes"][0]["accuracy_lo"] <= summary["sizes"][0]["accuracy"] <= summary["sizes"][0]["accuracy_hi"]
    top = summary["top"][0]
    assert top["verified"] and top["drop_lo"] <= top["drop"] <= top["drop_hi"]
    assert set(summary["timing"]) >= {"rank_heads", "accuracy_by_size", "total"}
    assert bool(summary["screen"]) == (method == "screened")
    assert (tmp_path / "est_logprob_drop_heatmap.png").exists() == (method == "screened")
