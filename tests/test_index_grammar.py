"""The index grammar (hooked/validate/indices.py) at every public entry point that takes an index, a
count or a metric: each bad input of issue 39's list as a named case, and a property test that drives
legal and illegal indices through every entry point.

Glossary
    named case   one bad input of the issue, its call and the message it now gets (the argument named)
    grammar case an entry point and one index argument: its legal range [lo, hi), how a legal value maps to
                 its non-negative equivalent (TL's meaning: -1 is the last), and the call
    property     a legal negative index gives exactly what its non-negative equivalent gives; every
                 illegal value (out of range, float, bool, string, None) is refused with the argument named,
                 the model unchanged and no hook left behind
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_families import tiny

from analysis.circuits import (cut_token_edges, edge_attribution, edge_effects, faithfulness_curve, prune, rescore,
                               verify_token_edges)
from analysis.circuits.metrics import AnswerDiff
from analysis.intervals import clopper_pearson
from analysis.interventions import ablate_experts, ablate_heads, decay_norms, knockout, patch, skip_layers
from analysis.kernel_rows import kernel_rows
from tests.test_sae import TinySAE

TOKENS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [4, 5, 6, 7, 8, 9, 10, 11]])  # 8 positions
CORRUPT = TOKENS.flip(-1)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def llama():
    from loaders import from_pretrained

    return from_pretrained("organism/llama-kv")  # 2 layers, 4 heads, d_vocab 101


@pytest.fixture(scope="module")
def scores(llama):
    return edge_attribution(llama, TOKENS, CORRUPT, AnswerDiff([9, 10], [10, 11]), token_edges=True)


@pytest.fixture(scope="module")
def mamba():
    return tiny("mamba")


@pytest.fixture(scope="module")
def jamba():
    return tiny("jamba")  # a mixture of experts: mlp.hook_chosen holds int64 expert ids


def unchanged(model, reference):
    assert torch.equal(model(TOKENS), reference)
    assert not any(p.has_hooks for p in model.hook_dict.values())


# ------------------------------------------------------------------------------------- metrics
def constant(logits):
    return torch.tensor(1.0)


def through_argmax(logits):
    return logits.argmax(-1).float().mean()


def per_prompt(logits):
    return logits[:, -1, 9] - logits[:, -1, 10]


def two_numbers(logits):
    return logits[:, -1, 9].mean(), logits[:, -1, 10].mean()


def _n(scores) -> int:
    return len(scores)


# ---------------------------------------------------------------------------------- named cases
NAMED: dict[str, tuple[Callable[[Any, Any], Any], type, str]] = {  # case -> (call(model, scores), error, message)
    "EdgeScores.top(-1)": (lambda m, s: s.top(-1), ValueError, r"top: n=-1: must be >= 0"),
    "EdgeScores.top(2.5)": (lambda m, s: s.top(2.5), TypeError, r"top: n: expected an integer >= 0, got 2.5"),
    "prune(threshold=nan)": (lambda m, s: prune(s, threshold=math.nan), ValueError,
                             r"prune: threshold=nan: must be a finite number >= 0"),
    "faithfulness_curve(sizes=[-1])": (lambda m, s: faithfulness_curve(m, s, TOKENS, CORRUPT, AnswerDiff([9, 10]), [-1]),
                                       ValueError, r"faithfulness_curve: sizes\[0\]=-1: must be in \[0, {n}\]"),
    "faithfulness_curve(sizes=[n_edges + 5])": (
        lambda m, s: faithfulness_curve(m, s, TOKENS, CORRUPT, AnswerDiff([9, 10]), [len(s) + 5]), ValueError,
        r"faithfulness_curve: sizes\[0\]={n5}: must be in \[0, {n}\]"),
    "rescore(shortlist=-1)": (lambda m, s: rescore(m, s, TOKENS, CORRUPT, AnswerDiff([9, 10]), -1), ValueError,
                              r"rescore: shortlist=-1: must be in \[0, {n}\]"),
    "edge_attribution(batch_size=0)": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([9, 10]), batch_size=0),
                                       ValueError, r"edge_attribution: batch_size=0: must be >= 1"),
    "edge_attribution(batch_size=-1)": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([9, 10]),
                                                                      batch_size=-1),
                                        ValueError, r"edge_attribution: batch_size=-1: must be >= 1"),
    "edge_attribution(batch_size=1.5)": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([9, 10]),
                                                                       batch_size=1.5),
                                         TypeError, r"edge_attribution: batch_size: expected an integer >= 1 or None, "
                                                    r"got 1.5"),
    "edge_attribution(batch_size=True)": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([9, 10]),
                                                                        batch_size=True),
                                          TypeError, r"edge_attribution: batch_size: expected an integer >= 1 or None, "
                                                     r"got True"),
    "AnswerDiff(right=[-1])": (lambda m, s: AnswerDiff([-1]), ValueError,
                               r"AnswerDiff: right: token ids outside \[0, d_vocab\) \(negative ids\): \[-1\]"),
    "AnswerDiff(right=[101]) on 101 ids": (
        lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([101, 3])), ValueError,
        r"AnswerDiff: right: token ids outside the vocabulary \[0, 101\): \[101\]"),
    "AnswerDiff(pos=8) on 8 positions": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, AnswerDiff([9, 10], pos=8)),
                                         IndexError, r"AnswerDiff: pos=8: must be in \[-8, 8\)"),
    "token edge source -1 after target 5": (
        lambda m, s: verify_token_edges(m, TOKENS, [("L1H0", 5, -1)], AnswerDiff([9, 10])), ValueError,
        r"token edge L1H0\[5<--1\]: source -1 \(position 7\) is after target 5 \(position 5\)"),
    "token edge source 6 after target 5": (
        lambda m, s: cut_token_edges(m, [("L1H0", 5, 6)]).__enter__(), ValueError,
        r"token edge L1H0\[5<-6\]: source 6 is after target 5: no such edge"),
    "token edge target 100": (lambda m, s: verify_token_edges(m, TOKENS, [("L1H0", 100, 0)], AnswerDiff([9, 10])),
                              IndexError, r"token edge L1H0\[100<-0\]: target=100: must be in \[-8, 8\)"),
    "token edge target 1.5": (lambda m, s: verify_token_edges(m, TOKENS, [("L1H0", 1.5, 0)], AnswerDiff([9, 10])),
                              TypeError, r"edges\[0\]: target: expected an integer, got 1.5"),
    "metric that does not depend on the logits": (
        lambda m, s: edge_attribution(m, TOKENS, CORRUPT, constant), ValueError,
        r"metric constant has no gradient with respect to the logits"),
    "metric with no gradient (argmax)": (
        lambda m, s: edge_attribution(m, TOKENS, CORRUPT, through_argmax), ValueError,
        r"metric through_argmax has no gradient with respect to the logits"),
    "metric returning [batch]": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, per_prompt), ValueError,
                                 r"metric per_prompt must return one number per run \(a scalar\), got a tensor of shape \(2,\)"),
    "metric returning a tuple": (lambda m, s: edge_attribution(m, TOKENS, CORRUPT, two_numbers), TypeError,
                                 r"metric two_numbers must return one number per run \(a scalar\), got tuple"),
    "SAE positions=[1.5]": (lambda m, s: m.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", positions=[1.5]),
                            TypeError, r"positions"),
    "SAE positions=[0, 1, 1, 0] (a 0/1 list)": (
        lambda m, s: m.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", positions=[0, 1, 1, 0]), ValueError,
        r"add_sae: positions=\[0, 1, 1, 0\] repeats positions 0 and 1"),
    "SAE head=99": (lambda m, s: m.add_sae(TinySAE(16, 8), "blocks.0.attn.hook_z", head=99), IndexError,
                    r"add_sae: head=99: must be in \[-4, 4\) \(the 4 heads\)"),
    "SAE positions=[8] on 8 positions": (
        lambda m, s: (m.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", positions=[8]), m(TOKENS)), IndexError,
        r"add_sae: positions=8: must be in \[-8, 8\)"),
    "hook_shape(filter) matching two shapes": (
        lambda m, s: m.hook_shape(lambda n: n.endswith("hook_resid_pre") or n.endswith("hook_pattern")), ValueError,
        r"hook_shape: name: the filter matches hooks of 2 shapes: \[1, 1, 64\] .*\[1, 4, 1, 1\]"),
    "hook_shape(filter) matching nothing": (lambda m, s: m.hook_shape(lambda n: False), ValueError,
                                            r"hook_shape: name: the filter matches no hook"),
    "clopper_pearson(confidence=1.5)": (lambda m, s: clopper_pearson(3, 10, confidence=1.5), ValueError,
                                        r"clopper_pearson: confidence=1.5: must be in \(0, 1\)"),
    "start_at_layer=3 on 2 layers": (lambda m, s: m(TOKENS, start_at_layer=3), IndexError,
                                     r"start_at_layer=3: must be in \[-2, 2\] \(a slice bound"),
    "accumulated_resid(layer=3) on 2 layers": (
        lambda m, s: m.run_with_cache(TOKENS)[1].accumulated_resid(3), IndexError,
        r"layer=3: must be in \[0, 2\], or -1 / None for the final residual"),
}


@pytest.mark.parametrize("case", list(NAMED))
def test_named_case_is_refused_by_name(llama, scores, case):
    call, error, message = NAMED[case]
    reference = llama(TOKENS)
    try:
        with pytest.raises(error, match=message.format(n=len(scores), n5=len(scores) + 5)):
            call(llama, scores)
    finally:
        llama.reset_saes()
    unchanged(llama, reference)


def test_named_top_past_the_edge_count_is_every_edge(scores):
    """top(n) is "at most n" (a slice's meaning); a curve or a shortlist past the edge count is refused above."""
    every = scores.top(len(scores) + 5)
    assert len(every) == len(scores) and every == scores.top(len(scores))
    assert len(scores.token.top(len(scores.token) + 1)) == len(scores.token)


def test_named_sae_on_int64_expert_ids_is_refused(jamba):
    with pytest.raises(ValueError, match=r"add_sae: hook_name='blocks.0.mlp.hook_chosen' holds int64 indices"):
        jamba.add_sae(TinySAE(2, 8), "blocks.0.mlp.hook_chosen")
    assert not jamba.acts_to_saes


def test_named_sae_bool_mask_splices_only_its_true_positions(llama):
    """positions=[False, False, False, True] is a mask: position 3 only (it was read as ids 0, 0, 0, 1)."""
    name = "blocks.0.hook_resid_post"
    _, plain = llama.run_with_cache(TOKENS[:, :4], names_filter=name)
    outs = {}
    for key, positions in (("mask", [False, False, False, True]), ("index", [3]), ("last", [-1])):
        llama.add_sae(TinySAE(64, 8, seed=1), name, positions=positions)
        _, cache = llama.run_with_cache(TOKENS[:, :4], names_filter=[name, f"{name}.sae.hook_sae_output"])
        outs[key] = cache[f"{name}.sae.hook_sae_output"]
        llama.reset_saes()
    torch.testing.assert_close(outs["mask"][:, :3], plain[name][:, :3], rtol=0, atol=0)
    assert not torch.allclose(outs["mask"][:, 3], plain[name][:, 3])
    assert torch.equal(outs["mask"], outs["index"]) and torch.equal(outs["mask"], outs["last"])


def test_named_token_edge_target_minus_one_is_the_last_position(llama):
    """target -1 is legal (the last position): the same cut and value as target 7 on 8 positions."""
    metric = AnswerDiff([9, 10], [10, 11])
    by_end = verify_token_edges(llama, TOKENS, [("L1H0", -1, 2), ("L0H3", -1, -3)], metric)
    by_start = verify_token_edges(llama, TOKENS, [("L1H0", 7, 2), ("L0H3", 7, 5)], metric)
    assert by_end == by_start and by_end["exact"] != 0.0


# ------------------------------------------------------------------------ the grammar, property
@dataclass(frozen=True)
class GrammarCase:
    """An entry point's index argument: legal integers in [lo, hi) (functions of the model), `canonical`
    maps a legal one to its non-negative equivalent, `call(model, value)` returns what is compared."""
    arg: str
    model: str
    lo: Callable[[Any], int]
    hi: Callable[[Any], int]
    call: Callable[[Any, Any], Any]
    canonical: Callable[[int, Any], int] = lambda v, n: v
    none_ok: bool = False  # None is legal too (every position, the metadata's head, all layers)


def _knockout(**kw):
    def run(m, v):
        args = {"sources": [0], "targets": [-1], "layers": [0]} | {k: f(v) for k, f in kw.items()}
        with knockout(m, **args):
            return m(TOKENS)
    return run


def _ablated(layer_head):
    def run(m, v):
        with ablate_heads(m, [layer_head(v)]):
            return m(TOKENS)
    return run


def _cache(**kw):
    def run(m, v):
        return m.run_with_cache(TOKENS, names_filter="blocks.1.hook_resid_pre", **{k: f(v) for k, f in kw.items()})[1][
            "blocks.1.hook_resid_pre"]
    return run


def _sae(**kw):
    def run(m, v):
        try:
            m.add_sae(TinySAE(16, 8, seed=2), "blocks.0.attn.hook_z", **{k: f(v) for k, f in kw.items()})
            return m(TOKENS)
        finally:
            m.reset_saes()
    return run


def _within(context, m):
    with context:
        return m(TOKENS)


def _patched(m, v):
    clean = m.run_with_cache(CORRUPT, names_filter="blocks.0.attn.hook_z")[1]
    return patch(m, TOKENS, clean, "blocks.0.attn.hook_z", index={"pos": v, "head": 1})


def _token_edge(j, i):
    def run(m, v):
        return verify_token_edges(m, TOKENS, [("L1H2", j(v), i(v))], AnswerDiff([9, 10], [10, 11]))
    return run


POS = lambda m: TOKENS.shape[1]  # noqa: E731
NEG_POS = lambda m: -TOKENS.shape[1]  # noqa: E731
LAYERS = lambda m: m.cfg.n_layers  # noqa: E731
NEG_LAYERS = lambda m: -m.cfg.n_layers  # noqa: E731
HEADS = lambda m: m.cfg.n_heads  # noqa: E731
WRAP_POS = lambda v, m: v % TOKENS.shape[1]  # noqa: E731
WRAP_LAYER = lambda v, m: v % m.cfg.n_layers  # noqa: E731
ZERO = lambda m: 0  # noqa: E731

GRAMMAR: dict[str, GrammarCase] = {
    "knockout layers": GrammarCase("layers", "llama", NEG_LAYERS, LAYERS, _knockout(layers=lambda v: [v]), WRAP_LAYER),
    "knockout sources": GrammarCase("sources", "llama", NEG_POS, POS, _knockout(sources=lambda v: [v]), WRAP_POS),
    "knockout targets": GrammarCase("targets", "llama", NEG_POS, POS, _knockout(targets=lambda v: [v]), WRAP_POS),
    "knockout channels": GrammarCase("channels", "mamba", lambda m: -m.cfg.d_inner, lambda m: m.cfg.d_inner,
                                     _knockout(channels=lambda v: [v]), lambda v, m: v % m.cfg.d_inner),
    "ablate_heads layer": GrammarCase("layer", "llama", NEG_LAYERS, LAYERS, _ablated(lambda v: (v, 1)), WRAP_LAYER),
    "ablate_heads head": GrammarCase("head", "llama", lambda m: -m.cfg.n_heads, HEADS, _ablated(lambda v: (1, v)),
                                     lambda v, m: v % m.cfg.n_heads),
    "patch index pos": GrammarCase("pos", "llama", NEG_POS, POS, _patched, WRAP_POS),
    "kernel_rows rows": GrammarCase("rows", "mamba", NEG_POS, POS,
                                    lambda m, v: kernel_rows(m, TOKENS, [v])["blocks.0.mixer"], WRAP_POS),
    "decay_norms layer": GrammarCase("layer", "mamba", NEG_LAYERS, LAYERS, lambda m, v: decay_norms(m, v), WRAP_LAYER),
    "run_with_cache pos_slice": GrammarCase("pos_slice", "llama", NEG_POS, POS, _cache(pos_slice=lambda v: v), WRAP_POS,
                                            none_ok=True),
    "add_sae positions": GrammarCase("positions", "llama", NEG_POS, POS, _sae(positions=lambda v: [v]), WRAP_POS),
    "add_sae head": GrammarCase("head", "llama", lambda m: -m.cfg.n_heads, HEADS, _sae(head=lambda v: v),
                                lambda v, m: v % m.cfg.n_heads, none_ok=True),
    "AnswerDiff pos": GrammarCase("pos", "llama", NEG_POS, POS,
                                  lambda m, v: AnswerDiff([9, 10], [10, 11], pos=v)(m(TOKENS)), WRAP_POS),
    "AnswerDiff right": GrammarCase("right", "llama", ZERO, lambda m: m.cfg.d_vocab,
                                    lambda m, v: AnswerDiff([v, v])(m(TOKENS))),
    "token edge target": GrammarCase("target", "llama", NEG_POS, POS, _token_edge(lambda v: v, lambda v: 0), WRAP_POS),
    "token edge source": GrammarCase("source", "llama", NEG_POS, POS, _token_edge(lambda v: -1, lambda v: v), WRAP_POS),
    "forward stop_at_layer": GrammarCase("stop_at_layer", "llama", NEG_LAYERS, lambda m: m.cfg.n_layers + 1,
                                         lambda m, v: m(TOKENS, stop_at_layer=v),
                                         lambda v, m: v + m.cfg.n_layers if v < 0 else v, none_ok=True),
    "skip_layers layers": GrammarCase("layers", "llama", NEG_LAYERS, LAYERS, lambda m, v: _within(skip_layers(m, v), m),
                                      WRAP_LAYER),
    "ablate_experts expert": GrammarCase("expert", "jamba", lambda m: -4, lambda m: 4,
                                         lambda m, v: _within(ablate_experts(m, [(1, v)]), m), lambda v, m: v % 4),
    "ablate_experts layer": GrammarCase("layer", "jamba", NEG_LAYERS, LAYERS,
                                        lambda m, v: _within(ablate_experts(m, [(v, 1)]), m), WRAP_LAYER),
    "get_neuron_results neuron_slice": GrammarCase(
        "neuron_slice", "llama", lambda m: -m.cfg.d_mlp, lambda m: m.cfg.d_mlp,
        lambda m, v: m.run_with_cache(TOKENS)[1].get_neuron_results(1, neuron_slice=[v]), lambda v, m: v % m.cfg.d_mlp),
    "accumulated_resid layer": GrammarCase("layer", "llama", lambda m: -1, lambda m: m.cfg.n_layers + 1,
                                           lambda m, v: m.run_with_cache(TOKENS)[1].accumulated_resid(v),
                                           lambda v, m: m.cfg.n_layers if v == -1 else v, none_ok=True),
    "edge_effects edge numbers": GrammarCase("edge", "llama", lambda m: -_n(_graph(m)), lambda m: _n(_graph(m)),
                                             lambda m, v: edge_effects(m, [v], TOKENS, CORRUPT, AnswerDiff([9, 10])),
                                             lambda v, m: v % _n(_graph(m))),
}


def _graph(m):
    from analysis.circuits import graph_of

    return graph_of(m)


def _models(request) -> dict[str, Any]:
    return {name: request.getfixturevalue(name) for name in ("llama", "mamba", "jamba")}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("case", list(GRAMMAR))
def test_legal_negative_indices_mean_what_tl_means(request, case):
    """A legal index counted from the end gives exactly what its non-negative equivalent gives."""
    c = GRAMMAR[case]
    model = _models(request)[c.model]
    lo, hi = c.lo(model), c.hi(model)

    @SETTINGS
    @given(st.integers(lo, hi - 1))
    def run(v):
        with torch.no_grad():
            assert _same(c.call(model, v), c.call(model, c.canonical(v, model)))

    run()


ILLEGAL_TYPES = st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none())


@pytest.mark.parametrize("case", list(GRAMMAR))
def test_illegal_indices_are_refused_by_name(request, case):
    """Out of range (just past each end and anywhere past it), a float, a bool, a string, None: refused with the
    argument's name, the model's logits unchanged and no hook left."""
    c = GRAMMAR[case]
    model = _models(request)[c.model]
    lo, hi = c.lo(model), c.hi(model)
    reference = model(TOKENS)
    values = st.one_of(st.sampled_from([lo - 1, hi]), st.integers(max_value=lo - 1), st.integers(min_value=hi),
                       ILLEGAL_TYPES)

    @SETTINGS
    @given(values)
    def run(v):
        if c.none_ok and v is None:
            return
        with pytest.raises((TypeError, ValueError, IndexError)) as info:
            with torch.no_grad():
                c.call(model, v)
        assert re.search(rf"(?<![\w-]){re.escape(c.arg)}(?![\w-])", str(info.value)), f"{c.arg}={v!r}: {info.value}"

    run()
    unchanged(model, reference)
