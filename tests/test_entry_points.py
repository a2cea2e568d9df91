"""Property tests over the entry-point table (tests/entry_points.py): random illegal values are refused
with the argument named; random legal values give what an independent recomputation gives.

The table is the documented rule of each argument, written apart from the code's rules
(hooked.validate.RULES); the first test keeps the two listing the same arguments.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import analysis.circuits  # noqa: F401  (imports register the rules)
import analysis.ga.ranking  # noqa: F401
import analysis.ga.report  # noqa: F401
import analysis.ga.scores  # noqa: F401
import analysis.ga.settings  # noqa: F401
import analysis.info_flow  # noqa: F401
import analysis.intervals  # noqa: F401
import hooked.cache_resid  # noqa: F401
import hooked.generate  # noqa: F401
import hooked.processing  # noqa: F401
import hooked.utils  # noqa: F401
import loaders.load  # noqa: F401
from analysis.circuits import circuit_metric, edge_attribution, edge_effects, faithfulness_curve, prune, rescore
from analysis.circuits import verify_circuit, verify_token_edges
from analysis.circuits import neuron_attribution, node_scores, select, verify_neurons
from analysis.circuits import path_patch, path_patch_sweep
from analysis.circuits.positions import position_attribution, position_effects, verify_positions
from analysis.circuits.metrics import KL, AnswerDiff
from analysis.interventions import ablate_heads, knockout
from analysis.tasks.text import kv_retrieval
from hooked.validate import RULES
from tests.entry_points import CLI, ENTRY_POINTS, EXPLICIT, Choice, Flag, Int, Real
from tests.test_cache_budget import MODELS

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FAMILIES = ["llama_gqa", "mamba", "mamba2", "zamba2"]
TOKENS = torch.tensor([[3, 4, 5, 6, 7, 8]])


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """An organism with a tokenizer, its cache, G&A examples and an output directory."""
    from analysis.tasks.text import kv_retrieval
    from loaders import from_pretrained

    model = from_pretrained("organism/llama-kv")
    _, cache = model.run_with_cache(TOKENS)

    class Ctx:
        pass

    c = Ctx()
    c.model, c.cache, c.examples, c.out = model, cache, kv_retrieval(2, 2, seed=0), tmp_path_factory.mktemp("out")
    c.stack = cache.accumulated_resid()
    c.clean, c.corrupt = TOKENS, TOKENS.flip(-1)
    c.metric = AnswerDiff([9], [10])
    c.scores = edge_attribution(model, c.clean, c.corrupt, c.metric, token_edges=True)
    c.neurons = neuron_attribution(model, c.clean, c.corrupt, c.metric)
    c.positions = position_attribution(model, c.clean, c.corrupt, c.metric)
    return c


@pytest.fixture(scope="module")
def families():
    made = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        made[name] = model
    return made


def _within(context) -> None:
    with context:
        pass


def _cache_call(method: str):
    return lambda c, **kw: getattr(c.cache, method)(**kw)


CALLS = {  # entry point -> call with one argument given (every other one legal)
    "hooked.generate.generate": lambda c, **kw: c.model.generate(TOKENS, **{"max_new_tokens": 1, **kw}),
    "hooked.models.base.HookedModel.generate": lambda c, **kw: c.model.generate(TOKENS, **kw),
    "hooked.models.base.HookedModel.tokenize": lambda c, **kw: c.model.tokenize(**{"text": "K03", **kw}),
    "hooked.models.base.HookedModel.to_tokens": lambda c, **kw: c.model.to_tokens(**{"text": "K03", **kw}),
    "hooked.models.base.HookedModel.to_single_token": lambda c, **kw: c.model.to_single_token(**kw),
    "hooked.hook_points.HookedRootModule.run_with_cache": lambda c, **kw: c.model.run_with_cache(TOKENS, **kw),
    "hooked.weights.ModelWeights.accumulated_bias": lambda c, **kw: c.model.accumulated_bias(**{"layer": 1, **kw}),
    "hooked.processing.process_weights": lambda c, **kw: __import__("hooked.processing").processing.process_weights(
        copy.deepcopy(c.model), **kw),
    "hooked.cache_resid.ResidualStreamMethods.accumulated_resid": _cache_call("accumulated_resid"),
    "hooked.cache_resid.ResidualStreamMethods.decompose_resid": _cache_call("decompose_resid"),
    "hooked.cache_resid.ResidualStreamMethods.stack_head_results": _cache_call("stack_head_results"),
    "hooked.cache_resid.ResidualStreamMethods.stack_neuron_results": lambda c, **kw: c.cache.stack_neuron_results(1, **kw),
    "hooked.cache_resid.ResidualStreamMethods.get_full_resid_decomposition": _cache_call("get_full_resid_decomposition"),
    "hooked.cache_resid.ResidualStreamMethods.apply_ln_to_stack": lambda c, **kw: c.cache.apply_ln_to_stack(c.stack, **kw),
    "hooked.utils.test_prompt": lambda c, **kw: hooked.utils.test_prompt(
        **{"prompt": "K03", "answer": "V12", "model": c.model, "print_details": False, **kw}),
    "loaders.load.from_pretrained": lambda c, **kw: loaders.load.from_pretrained("organism/llama-kv", **kw),
    "analysis.interventions.knockout.knockout": lambda c, **kw: _within(knockout(c.model, [0], [-1], [0], **kw)),
    "analysis.interventions.ablation.ablate_heads": lambda c, **kw: _within(ablate_heads(c.model, [(0, 1)], **kw)),
    "analysis.tasks.text.kv_retrieval": lambda c, **kw: kv_retrieval(2, 2, **kw),
    "analysis.info_flow.info_flow": lambda c, **kw: analysis.info_flow.info_flow(c.model, [], **kw),
    "analysis.ga.ranking.rank_heads": lambda c, **kw: analysis.ga.ranking.rank_heads(
        c.model, c.examples, **{"progress": False, **kw}),
    "analysis.ga.scores.ga_scores": lambda c, **kw: analysis.ga.scores.ga_scores(c.model, c.examples, **kw),
    "analysis.ga.report.ga_report": lambda c, **kw: analysis.ga.report.ga_report(
        c.model, c.out, [2], **{"n": 2, "progress": False, **kw}),
    "analysis.ga.settings.RankSettings": lambda c, **kw: analysis.ga.settings.RankSettings(**kw),
    "analysis.intervals.clopper_pearson": lambda c, **kw: analysis.intervals.clopper_pearson(**{"k": 1, "n": 2, **kw}),
    "analysis.intervals.mean_interval": lambda c, **kw: analysis.intervals.mean_interval(torch.tensor([1.0, 2.0]), **kw),
    "analysis.intervals.paired_interval": lambda c, **kw: analysis.intervals.paired_interval(
        torch.tensor([1.0, 2.0]), **kw),
    "analysis.circuits.eap.EdgeScores.top": lambda c, **kw: c.scores.top(**{"n": 1, **kw}),
    "analysis.circuits.eap.edge_attribution": lambda c, **kw: edge_attribution(c.model, c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.verify.prune": lambda c, **kw: prune(c.scores, **({} if "threshold" in kw else {"top_n": 1}), **kw),
    "analysis.circuits.verify.rescore": lambda c, **kw: rescore(
        c.model, c.scores, c.clean, c.corrupt, c.metric, **{"shortlist": 1, **kw}),
    "analysis.circuits.verify.circuit_metric": lambda c, **kw: circuit_metric(c.model, [0], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.verify.verify_circuit": lambda c, **kw: verify_circuit(c.model, [0], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.verify.faithfulness_curve": lambda c, **kw: faithfulness_curve(
        c.model, c.scores, c.clean, c.corrupt, c.metric, **{"sizes": [1], **kw}),
    "analysis.circuits.verify.edge_effects": lambda c, **kw: edge_effects(c.model, [0], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.metrics.AnswerDiff.__init__": lambda c, **kw: AnswerDiff([1], **kw),
    "analysis.circuits.metrics.KL.__init__": lambda c, **kw: KL(**kw),
    "analysis.circuits.token_edges.TokenEdgeScores.top": lambda c, **kw: c.scores.token.top(**{"n": 1, **kw}),
    "analysis.circuits.token_edges.verify_token_edges": lambda c, **kw: verify_token_edges(
        c.model, c.clean, [], c.metric, **kw),
    "analysis.circuits.nodes.NodeScores.top": lambda c, **kw: node_scores(c.scores).top(**{"n": 1, **kw}),
    "analysis.circuits.neurons.NeuronScores.top": lambda c, **kw: c.neurons.top(**{"n": 1, **kw}),
    "analysis.circuits.neurons.neuron_attribution": lambda c, **kw: neuron_attribution(
        c.model, c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.neurons.verify_neurons": lambda c, **kw: verify_neurons(
        c.model, [], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.positions.PositionScores.top": lambda c, **kw: c.positions.top(**{"n": 1, **kw}),
    "analysis.circuits.positions.position_attribution": lambda c, **kw: position_attribution(
        c.model, c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.positions.position_effects": lambda c, **kw: position_effects(
        c.model, [("embed", "logits", -1)], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.positions.verify_positions": lambda c, **kw: verify_positions(
        c.model, [], c.clean, c.corrupt, c.metric, **kw),
    "analysis.circuits.paths.path_patch": lambda c, **kw: path_patch(
        c.model, c.clean, c.corrupt, c.metric, ["embed"], ["logits"], **kw),
    "analysis.circuits.paths.path_patch_sweep": lambda c, **kw: path_patch_sweep(
        c.model, c.clean, c.corrupt, c.metric, ["embed"], ["logits"], **kw),
    "analysis.circuits.select.select": lambda c, **kw: select(
        c.scores, **({} if {"threshold", "greedy"} & set(kw) else {"top_n": 1}), **kw),
}
EXPLICIT_CALLS = {
    "get_act_name": lambda c, **kw: hooked.utils.get_act_name("resid_pre", **kw),
    "tokens_to_residual_directions": lambda c, **kw: c.model.tokens_to_residual_directions(**kw),
}


def _names(arg: str) -> str:
    return rf"(?<![\w-]){re.escape(arg)}(?![\w-])"


def refused_by_name(call, c, arg: str, value) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        call(c, **{arg: value})
    assert re.search(_names(arg), str(info.value)), f"{arg}={value!r}: {info.value}"


# ------------------------------------------------------------------------------- the table
def test_the_table_lists_every_checked_argument():
    checked = {name: set(rules) for name, rules in RULES.items() if not name.startswith("tests.")}
    table = {name: set(args) for name, args in ENTRY_POINTS.items()}
    assert checked == table


def test_the_cli_table_lists_every_checked_option():
    from analysis.cli import COMMANDS
    from analysis.validate import CommaInts, ExistingFile, WritableDir
    from hooked.validate import Seq

    for command, (_, arguments, _) in COMMANDS.items():
        ruled = {flags[0] for flags, _, rule in arguments
                 if rule is not None and flags[0].startswith("--") and not isinstance(rule, (WritableDir, CommaInts, Seq, ExistingFile))}
        assert ruled == set(CLI.get(command, {})), command


CASES = [(e, a) for e, args in ENTRY_POINTS.items() for a, spec in args.items() if spec is not None]


@pytest.mark.parametrize("entry, arg", CASES, ids=[f"{e.rsplit('.', 1)[-1]}-{a}" for e, a in CASES])
def test_illegal_values_are_refused_by_name(ctx, entry, arg):
    spec = ENTRY_POINTS[entry][arg]

    @SETTINGS
    @given(spec.illegal(ctx.model))
    def run(value):
        refused_by_name(CALLS[entry], ctx, arg, value)

    run()


EXPLICIT_CASES = [(e, a) for e, args in EXPLICIT.items() for a in args]


@pytest.mark.parametrize("entry, arg", EXPLICIT_CASES, ids=[f"{e}-{a}" for e, a in EXPLICIT_CASES])
def test_illegal_values_of_explicitly_checked_arguments(ctx, entry, arg):
    spec = EXPLICIT[entry][arg]

    @SETTINGS
    @given(spec.illegal(ctx.model))
    def run(value):
        refused_by_name(EXPLICIT_CALLS[entry], ctx, arg, value)

    run()


CLI_CASES = [(cmd, opt) for cmd, opts in CLI.items() for opt in opts]


@pytest.mark.parametrize("command, option", CLI_CASES, ids=[f"{c}{o}" for c, o in CLI_CASES])
def test_cli_refuses_illegal_options_before_loading(command, option, tmp_path, capsys):
    from analysis.cli import main

    spec = CLI[command][option]
    values = (st.integers(max_value=spec.lo - 1) if isinstance(spec, Int) else
              st.floats(max_value=spec.lo, allow_nan=False, allow_infinity=False).filter(lambda x: x < spec.lo)
              if isinstance(spec, Real) else st.just(""))

    @SETTINGS
    @given(values)
    def run(value):
        out = ["--out", str(tmp_path / "out")] if command != "hooks" else []
        # the model does not exist: a refusal before loading names the option, not the missing model
        assert main([command, str(tmp_path / "no_model"), f"{option}={value}"] + out) == 2
        err = capsys.readouterr().err
        assert re.search(_names(option), err) and "no_model" not in err, err

    run()


# --------------------------------------------------------------- legal values, recomputed
def greedy_by_hand(model, tokens, steps: int, stops: list[int], pad: int | None):
    """Full forwards, argmax, TL's stop rule: a finished row emits the pad id."""
    out, finished = tokens, torch.zeros(tokens.shape[0], dtype=torch.bool)
    for _ in range(steps):
        with torch.no_grad():
            new = model(out)[:, -1].argmax(-1)
        if stops:
            new = torch.where(finished, torch.full_like(new, pad), new)
            finished |= torch.tensor([int(t) in stops for t in new])
        out = torch.cat([out, new[:, None]], 1)
        if stops and bool(finished.all()):
            break
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_legal_generate_arguments_give_the_greedy_recomputation(families, family):
    model = families[family]

    @SETTINGS
    @given(steps=st.integers(0, 4), cache=st.booleans(), greedy=st.sampled_from(["do_sample", "temperature"]),
           stops=st.one_of(st.none(), st.lists(st.integers(0, 49), min_size=1, max_size=3)),
           top_k=Int(1, none=True).legal(), top_p=Real(0, 1, lo_open=True, none=True).legal(),
           rows=st.integers(1, 2), seed=st.integers(0, 1000))
    def run(steps, cache, greedy, stops, top_k, top_p, rows, seed):
        tokens = torch.randint(0, 50, (rows, 4), generator=torch.Generator().manual_seed(seed))
        sampling = {"do_sample": False} if greedy == "do_sample" else {"temperature": 0.0}
        eos = {"stop_at_eos": False} if stops is None else {"eos_token_id": stops if len(stops) > 1 else stops[0]}
        out = model.generate(tokens, max_new_tokens=steps, use_past_kv_cache=cache, top_k=top_k, top_p=top_p,
                             **sampling, **eos)
        want = greedy_by_hand(model, tokens, steps, stops or [], None if stops is None else stops[0])
        assert torch.equal(out, want)

    run()


def filtered_by_hand(logits: np.ndarray, temperature: float, top_k, top_p, penalty: float, seen: np.ndarray):
    """TL's sampling distribution for one row, written with numpy loops: the probabilities."""
    x = logits.astype(np.float64) / temperature - penalty * np.bincount(seen, minlength=len(logits))
    keep = np.ones(len(x), dtype=bool)
    if top_k is not None:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        keep &= x >= kth
    if top_p is not None:
        order = np.argsort(-np.where(keep, x, -np.inf), kind="stable")
        p = np.exp(np.where(keep, x, -np.inf) - x[keep].max())
        p /= p.sum()
        total, chosen = 0.0, np.zeros(len(x), dtype=bool)
        for i in order:
            if total >= top_p or not keep[i]:
                break
            chosen[i], total = True, total + p[i]
        keep &= chosen
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return p / p.sum()


def test_legal_sampling_arguments_give_the_distribution_by_hand():
    from hooked.generate import next_token_logits

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(temperature=Real(0, lo_open=True).legal().filter(lambda t: 1e-2 < t < 1e3),
           top_k=Int(1, none=True).legal().map(lambda k: k if k is None else int(k)),
           top_p=Real(0, 1, lo_open=True, none=True).legal(), penalty=st.floats(0, 3), seed=st.integers(0, 10**6))
    def run(temperature, top_k, top_p, penalty, seed):
        g = torch.Generator().manual_seed(seed)
        logits, seen = torch.randn(2, 12, generator=g, dtype=torch.float64), torch.randint(0, 12, (2, 5), generator=g)
        ours = next_token_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, freq_penalty=penalty,
                                 seen=seen).softmax(-1)
        for row in range(2):
            want = filtered_by_hand(logits[row].numpy(), temperature, top_k, top_p, penalty, seen[row].numpy())
            np.testing.assert_allclose(ours[row].numpy(), want, atol=1e-9)

    run()


@pytest.mark.parametrize("family", FAMILIES)
def test_legal_pos_slices_give_the_full_cache_indexed(families, family):
    model = families[family]
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    names = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post"]
    with torch.no_grad():
        _, full = model.run_with_cache(tokens, names_filter=names)
    index = st.integers(-7, 6)
    slices = st.builds(slice, st.one_of(st.none(), index), st.one_of(st.none(), index),
                       st.one_of(st.none(), st.integers(1, 3), st.integers(-3, -1)))

    @SETTINGS
    @given(st.one_of(index, slices.filter(lambda s: len(range(7)[s]) > 0), st.lists(index, min_size=1, max_size=4)))
    def run(pos_slice):
        with torch.no_grad():
            _, part = model.run_with_cache(tokens, names_filter=names, pos_slice=pos_slice)
        positions = list(range(7))
        where = [positions[pos_slice]] if isinstance(pos_slice, int) else (  # an int keeps the axis (TL)
            positions[pos_slice] if isinstance(pos_slice, slice) else [positions[p] for p in pos_slice])
        for name in names:
            assert torch.equal(part[name], full[name][:, where])

    run()


def test_illegal_pos_slices_are_refused_by_name(families):
    model = families["llama_gqa"]
    tokens = torch.randint(0, 50, (1, 7))

    @SETTINGS
    @given(st.one_of(st.integers(min_value=7), st.integers(max_value=-8), st.booleans(), st.floats(),
                     st.text(max_size=3), st.builds(lambda a: slice(a, None), st.integers(7, 20)), st.lists(st.integers(7, 30), min_size=1)))
    def run(pos_slice):
        with pytest.raises((TypeError, ValueError), match="pos_slice"):
            model.run_with_cache(tokens, pos_slice=pos_slice)

    run()


@pytest.mark.parametrize("family", FAMILIES)
def test_legal_loss_inputs_give_the_cross_entropy_by_hand(families, family):
    model = families[family]

    @SETTINGS
    @given(length=st.integers(2, 9), rows=st.integers(1, 3), seed=st.integers(0, 1000))
    def run(length, rows, seed):
        tokens = torch.randint(0, 50, (rows, length), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            loss = model(tokens, return_type="loss")
            logits = model(tokens)
        by_hand = -sum(logits[b, p].log_softmax(-1)[tokens[b, p + 1]] for b in range(rows)
                       for p in range(length - 1)) / (rows * (length - 1))
        assert math.isclose(float(loss), float(by_hand), rel_tol=1e-5)

    run()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(torch.tensor([[1]]), return_type="loss")


def test_legal_token_positions_give_the_list_index(ctx):
    model = ctx.model

    @SETTINGS
    @given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.sampled_from(["first", "last"]),
           st.booleans())
    def run(ids, mode, batched):
        tokens = torch.tensor([ids]) if batched else torch.tensor(ids)
        token = ids[len(ids) // 2]
        want = ids.index(token) if mode == "first" else len(ids) - 1 - ids[::-1].index(token)
        assert model.get_token_position(token, tokens, mode=mode) == want

    run()
    with pytest.raises(TypeError, match=r"get_token_position: input .* shape \(1, 2, 3\)"):
        model.get_token_position(1, torch.zeros(1, 2, 3, dtype=torch.long))


def test_legal_confidences_give_the_t_interval(ctx):
    from scipy import stats

    from analysis.intervals import mean_interval

    @SETTINGS
    @given(Real(0, 1, lo_open=True, hi_open=True).legal().filter(lambda q: 1e-6 < q < 1 - 1e-9),
           st.lists(st.floats(-100, 100), min_size=2, max_size=20))
    def run(confidence, values):
        v = np.array(values)
        mean, lo, hi = mean_interval(torch.tensor(values), confidence)
        sem = v.std(ddof=1) / math.sqrt(len(v))
        if sem == 0:
            assert lo == hi == mean
            return
        want = stats.t.interval(confidence, len(v) - 1, loc=v.mean(), scale=sem)
        assert (lo, hi) == pytest.approx(want, rel=1e-7, abs=1e-7 * sem)

    run()


def test_legal_cache_budgets_give_the_unlimited_cache(ctx):
    model = ctx.model
    with torch.no_grad():
        _, full = model.run_with_cache(TOKENS)
    total = sum(t.nbytes for t in full.values())

    @SETTINGS
    @given(Int(total, none=True).legal().map(lambda b: b if b is None else int(b) * 1000))
    def run(budget):
        with torch.no_grad():
            _, cache = model.run_with_cache(TOKENS, max_cache_bytes=budget)
        assert cache.keys() == full.keys() and all(torch.equal(cache[k], full[k]) for k in full)

    run()


def test_legal_layers_and_tokens_of_the_tl_helpers(ctx):
    model = ctx.model

    @SETTINGS
    @given(st.integers(0, 40), st.lists(st.integers(0, model.cfg.d_vocab - 1), min_size=1, max_size=4))
    def run(layer, ids):
        assert hooked.utils.get_act_name("resid_pre", layer) == f"blocks.{layer}.hook_resid_pre"
        assert torch.equal(model.tokens_to_residual_directions(torch.tensor(ids)), model.W_U[:, ids].T)

    run()


@pytest.mark.parametrize("spec", [Choice("a", "b"), Flag(), Flag(none=True)], ids=repr)
def test_the_table_strategies_are_disjoint(spec):
    """A legal value is never drawn as an illegal one (the tests above would otherwise prove nothing)."""

    @SETTINGS
    @given(st.data())
    def run(data):
        bad = data.draw(spec.illegal())
        legal = spec.values if isinstance(spec, Choice) else ((True, False) + ((None,) if spec.none else ()))
        assert not any(type(bad) is type(v) and bad == v for v in legal)

    run()


# ------------------------------------------------------------------ the G&A settings, given loose
SETTINGS_FIELDS = list(ENTRY_POINTS["analysis.ga.settings.RankSettings"])
LOOSE = ["analysis.ga.ranking.rank_heads", "analysis.ga.report.ga_report"]


@pytest.mark.parametrize("entry", LOOSE, ids=["rank_heads", "ga_report"])
@pytest.mark.parametrize("field", SETTINGS_FIELDS)
def test_settings_given_as_loose_keywords_are_refused_in_the_entry_points_name(ctx, entry, field):
    """The old keyword call (`rank_heads(model, examples, batch_size=0)`) reaches RankSettings's rules and is
    refused as "rank_heads: batch_size=0: ..." (the entry point called, then the argument)."""
    spec = ENTRY_POINTS["analysis.ga.settings.RankSettings"][field]
    where = entry.rsplit(".", 1)[-1]

    @SETTINGS
    @given(spec.illegal(ctx.model))
    def run(value):
        with pytest.raises((TypeError, ValueError)) as info:
            CALLS[entry](ctx, **{field: value})
        assert re.match(rf"{where}: {re.escape(field)}[=:]", str(info.value)), f"{field}={value!r}: {info.value}"

    run()


def test_a_settings_object_ranks_as_the_loose_keywords_do(ctx):
    from analysis.ga.ranking import head_units, rank_heads
    from analysis.ga.report import task_for
    from analysis.ga.settings import RankSettings

    units, examples = head_units(ctx.model)[:3], task_for("organism/llama-kv")(2, 4, 0)
    loose = rank_heads(ctx.model, examples, units, batch_size=1, pairs_top_k=2, progress=False)
    given_ = rank_heads(ctx.model, examples, units, RankSettings(batch_size=1, pairs_top_k=2, progress=False))
    assert [r["unit"] for r in loose.rows] == [r["unit"] for r in given_.rows]
    assert [r["drop"] for r in loose.rows] == [r["drop"] for r in given_.rows] and loose.pairs == given_.pairs
    with pytest.raises(TypeError, match=r"rank_heads\(\) got unexpected keyword arguments \['batch'\]"):
        rank_heads(ctx.model, examples, units, batch=1)
    with pytest.raises(TypeError, match=r"rank_heads: settings: expected a RankSettings, got dict"):
        rank_heads(ctx.model, examples, units, {"batch_size": 1})
