"""The public entry points and the rules of their arguments, as documented: the table the property
tests draw from (tests/test_entry_points.py), kept apart from the code's own rules (hooked.validate)
so that each checks the other.

Glossary
    spec        what an argument may be: `Int(lo, hi)` (integers in [lo, hi); hi None: no bound; a
                str bound names a model field, e.g. "d_vocab"; a callable one is a function of the
                model, e.g. its graph's edge count), `Real(lo, hi, lo_open, hi_open)`
                (finite reals), `Flag()` (True / False), `Choice(*values)`, `Text()` (a non-empty
                string); `none=True` allows None too
    legal(s)    a hypothesis strategy of values the spec allows (numpy integers too)
    illegal(s)  a strategy of values it refuses: out of range, NaN and infinities, bools for
                numbers, numbers for flags, strings for numbers, None where None is not allowed
    ENTRY_POINTS  {qualified function name: {argument: spec}}: every argument the function checks
    CLI         {command: {option: spec}}: every option `hooked COMMAND` checks before loading a model
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

JUNK = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=2), min_size=1, max_size=2), st.just(object()))


@dataclass(frozen=True)
class Int:
    lo: int | str | None = None
    hi: int | str | None = None  # exclusive
    none: bool = False
    text: bool = False  # a str is legal too (a token id given as its one-token string)

    def bounds(self, model: Any = None) -> tuple[int | None, int | None]:
        get = lambda b: getattr(model.cfg, b) if isinstance(b, str) else b(model) if callable(b) else b  # noqa: E731
        return get(self.lo), get(self.hi)

    def legal(self, model: Any = None) -> st.SearchStrategy:
        lo, hi = self.bounds(model)
        lo = -50 if lo is None else lo
        hi = lo + 50 if hi is None else min(hi, lo + 50)
        ints = st.integers(lo, hi - 1)
        values = st.one_of(ints, ints.map(np.int64))
        return st.one_of(values, st.none()) if self.none else values

    def illegal(self, model: Any = None) -> st.SearchStrategy:
        lo, hi = self.bounds(model)
        out = [st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.just(""), st.just(object())]
        if not self.text:
            out.append(JUNK)
        if lo is not None:  # just past the bound, and anywhere past it
            out += [st.sampled_from([lo - 1, lo - 2]), st.integers(max_value=lo - 1)]
        if hi is not None:
            out += [st.sampled_from([hi, hi + 1]), st.integers(min_value=hi)]
        if not self.none:
            out.append(st.none())
        return st.one_of(out)


@dataclass(frozen=True)
class Real:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    none: bool = False

    def legal(self, model: Any = None) -> st.SearchStrategy:
        lo = -1e6 if self.lo is None else self.lo
        hi = 1e6 if self.hi is None else self.hi
        values = st.floats(lo, hi, exclude_min=self.lo_open, exclude_max=self.hi_open)
        return st.one_of(values, st.none()) if self.none else values

    def illegal(self, model: Any = None) -> st.SearchStrategy:
        out = [st.sampled_from([math.nan, math.inf, -math.inf]), st.booleans(), JUNK]
        if self.lo is not None:  # just past the bound, near it, and anywhere past it
            edge = [math.nextafter(self.lo, -math.inf), self.lo - 0.5] + ([self.lo] if self.lo_open else [])
            below = st.floats(max_value=self.lo, allow_nan=False, allow_infinity=False)
            out += [st.sampled_from(edge), below.filter(lambda x: x <= self.lo if self.lo_open else x < self.lo)]
        if self.hi is not None:
            edge = [math.nextafter(self.hi, math.inf), self.hi + 0.5] + ([self.hi] if self.hi_open else [])
            above = st.floats(min_value=self.hi, allow_nan=False, allow_infinity=False)
            out += [st.sampled_from(edge), above.filter(lambda x: x >= self.hi if self.hi_open else x > self.hi)]
        if not self.none:
            out.append(st.none())
        return st.one_of(out)


@dataclass(frozen=True)
class Flag:
    none: bool = False

    def legal(self, model: Any = None) -> st.SearchStrategy:
        return st.one_of(st.booleans(), st.none()) if self.none else st.booleans()

    def illegal(self, model: Any = None) -> st.SearchStrategy:
        out = [st.integers(), st.text(max_size=4), st.floats()]
        return st.one_of(out if self.none else out + [st.none()])


class Choice:
    def __init__(self, *values: Any, none: bool = False) -> None:
        self.values, self.none = values, none

    def __repr__(self) -> str:
        return f"Choice({', '.join(map(repr, self.values))}, none={self.none})"

    def legal(self, model: Any = None) -> st.SearchStrategy:
        return st.sampled_from(self.values + ((None,) if self.none else ()))

    def illegal(self, model: Any = None) -> st.SearchStrategy:
        words = st.text(max_size=6).filter(lambda s: s not in self.values)
        return st.one_of([words, st.integers(), st.booleans()] + ([] if self.none else [st.none()]))


@dataclass(frozen=True)
class Text:
    none: bool = False

    def legal(self, model: Any = None) -> st.SearchStrategy:
        values = st.text(min_size=1, max_size=8)
        return st.one_of(values, st.none()) if self.none else values

    def illegal(self, model: Any = None) -> st.SearchStrategy:
        return st.one_of([st.just(""), st.integers(), st.floats()] + ([] if self.none else [st.none()]))


FLAG = Flag()
PROB = Real(0, 1, lo_open=True, hi_open=True)  # a confidence level
BATCH = Int(1, none=True)  # prompts per forward (circuits); None: all at once


def edges_and_one(model: Any) -> int:
    """One past the model's edge count: a count of edges is in [0, n_edges]."""
    from analysis.circuits import graph_of

    return len(graph_of(model)) + 1


ABLATION = {"intervention": Choice("patch", "zero", "mean"), "per_position": FLAG}  # circuits.verify's entry points

ENTRY_POINTS: dict[str, dict[str, Any]] = {
    "hooked.generate.generate": {
        "max_new_tokens": Int(0), "stop_at_eos": FLAG, "do_sample": FLAG, "top_k": Int(1, none=True),
        "top_p": Real(0, 1, lo_open=True, none=True), "temperature": Real(0), "freq_penalty": Real(0),
        "use_past_kv_cache": FLAG, "prepend_bos": Flag(none=True), "return_type": Choice("input", "str", "tokens"),
        "seed": Int(0, 2**63, none=True), "verbose": FLAG,
        "eos_token_id": Int(0, "d_vocab", none=True),  # or a non-empty list of them (TL's stop list)
        "input": None,  # a str, a non-empty list of str, or tokens: cases in test_bad_inputs.py
    },
    "hooked.models.base.HookedModel.generate": {"max_new_tokens": Int(0), "input": None},  # the rest: hooked.generate's
    "hooked.models.base.HookedModel.tokenize": {  # padding_side None: the model's default_padding_side
        "prepend_bos": Flag(none=True), "padding_side": Choice("left", "right", none=True), "move_to_device": FLAG,
        "text": None},  # a str or a non-empty list of str
    "hooked.models.base.HookedModel.to_tokens": {
        "prepend_bos": Flag(none=True), "padding_side": Choice("left", "right", none=True), "move_to_device": FLAG,
        "truncate": FLAG, "text": None},
    "hooked.models.base.HookedModel.to_single_token": {"string": Text()},
    "hooked.hook_points.HookedRootModule.run_with_cache": {
        "max_cache_bytes": Int(0, none=True), "remove_batch_dim": FLAG, "detach": FLAG, "incl_lazy": FLAG,
        "incl_bwd": FLAG, "device": None},  # a device this machine has: cases in test_bad_inputs.py
    "hooked.weights.ModelWeights.accumulated_bias": {
        "layer": Int(0, 3), "mlp_input": FLAG, "include_mlp_biases": FLAG},  # layer in [0, n_layers]: 2 layers here
    "hooked.processing.process_weights": {
        "fold_ln": FLAG, "center_writing_weights": FLAG, "center_unembed": FLAG, "fold_value_biases": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.accumulated_resid": {
        "incl_mid": FLAG, "apply_ln": FLAG, "mlp_input": FLAG, "return_labels": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.decompose_resid": {
        "mlp_input": FLAG, "apply_ln": FLAG, "incl_embeds": FLAG, "return_labels": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.stack_head_results": {
        "return_labels": FLAG, "incl_remainder": FLAG, "apply_ln": FLAG, "incl_shared": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.stack_neuron_results": {
        "return_labels": FLAG, "incl_remainder": FLAG, "apply_ln": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.get_full_resid_decomposition": {
        "mlp_input": FLAG, "expand_neurons": FLAG, "apply_ln": FLAG, "return_labels": FLAG},
    "hooked.cache_resid.ResidualStreamMethods.apply_ln_to_stack": {
        "mlp_input": FLAG, "has_batch_dim": Flag(none=True), "recompute_ln": FLAG},
    "hooked.utils.test_prompt": {
        "prompt": Text(), "prepend_space_to_answer": FLAG, "print_details": FLAG, "prepend_bos": Flag(none=True),
        "top_k": Int(1)},
    "loaders.load.from_pretrained": {"allow_pickle": FLAG, "revision": Text(none=True), "mmap": Flag(none=True)},
    "analysis.info_flow.info_flow": {
        "window": Int(1), "relation_includes_last": FLAG, "batch_size": Int(1), "n": Int(1, none=True),
        "require_correct": FLAG, "attention": Choice("scores", "pattern"), "cut_conv": FLAG, "reuse_prefix": FLAG,
        "confidence": PROB, "progress": FLAG, "replicas": Int(1, none=True),
        "sources": None,  # a non-empty list of source-set names
    },
    "analysis.interventions.knockout.knockout": {"cut_conv": FLAG},
    "analysis.interventions.ablation.ablate_heads": {"keep": FLAG, "mode": Choice("zero", "mean")},
    "analysis.tasks.text.kv_retrieval": {"seed": Int(0)},  # Python's random seeds -k as k
    "analysis.ga.settings.RankSettings": {  # rank_heads's and ga_report's settings (their loose keywords too)
        "method": Choice("exhaustive", "screened"), "batch_size": Int(1), "reuse_prefix": FLAG, "pairs_top_k": Int(0),
        "mode": Choice("zero", "mean"), "channel_group": Int(1, none=True), "progress": FLAG, "verify_top": Int(1),
        "n_control": Int(0), "seed": Int(0), "replicas": Int(1, none=True), "confidence": PROB,
        "prescreen_n": Int(1, none=True), "refine": Choice("none", "scores", "qk"), "stage_n": Int(1, none=True),
        "stage_keep": Int(1)},
    "analysis.ga.ranking.rank_heads": {"examples": None},  # a non-empty list
    "analysis.ga.scores.ga_scores": {"batch_size": Int(1), "channel_group": Int(1, none=True), "examples": None},
    "analysis.ga.report.ga_report": {
        "n": Int(1), "rank_n": Int(1, none=True), "n_random": Int(1),
        "sizes": None,  # a non-empty list of integers >= 1
    },
    "analysis.intervals.clopper_pearson": {"n": Int(1), "k": Int(0, 3), "confidence": PROB},  # k in [0, n]; n = 2 here
    "analysis.intervals.mean_interval": {"confidence": PROB},
    "analysis.intervals.paired_interval": {"confidence": PROB, "draws": Int(1)},
    "analysis.circuits.eap.EdgeScores.top": {"n": Int(0), "absolute": FLAG},  # past n_edges: every edge
    "analysis.circuits.eap.edge_attribution": {
        "method": Choice("eap", "eap-ig", "eap-ig-activations", "clean-corrupted"), "steps": Int(1),
        "token_edges": FLAG, "batch_size": BATCH, "attention": Choice("scores", "pattern"),
        "attention_mask": None,  # a tensor: the padding (prompts.py)
        "intervention": Choice("patch", "zero", "mean"), "per_position": FLAG,
        "steps_at": Choice("mid", "left", "right")},
    "analysis.circuits.verify.prune": {"top_n": Int(0, none=True), "threshold": Real(0, none=True)},
    "analysis.circuits.verify.rescore": {"shortlist": Int(0, edges_and_one), "batch_size": BATCH, "attention_mask": None,
                                         **ABLATION},
    "analysis.circuits.verify.circuit_metric": {"batch_size": BATCH, "attention_mask": None, **ABLATION},
    "analysis.circuits.verify.verify_circuit": {"batch_size": BATCH, "attention_mask": None, **ABLATION},
    "analysis.circuits.verify.faithfulness_curve": {"batch_size": BATCH, "attention_mask": None, **ABLATION,
                                                    "sizes": None},  # each in [0, n_edges]: tests/test_index_grammar.py
    "analysis.circuits.verify.edge_effects": {"batch_size": BATCH, "replicas": Int(1, none=True), "attention_mask": None,
                                              **ABLATION},
    "analysis.circuits.metrics.AnswerDiff.__init__": {"pos": Int()},  # its range: at the call (the logits' positions)
    "analysis.circuits.metrics.KL.__init__": {"pos": Int()},
    "analysis.circuits.token_edges.TokenEdgeScores.top": {"n": Int(0), "absolute": FLAG},
    "analysis.circuits.token_edges.verify_token_edges": {"attention": Choice("scores", "pattern"),
                                                         "attention_mask": None, "batch_size": BATCH},
    "analysis.circuits.nodes.NodeScores.top": {"n": Int(0), "absolute": FLAG},
    "analysis.circuits.neurons.NeuronScores.top": {"n": Int(0), "absolute": FLAG},
    "analysis.circuits.neurons.neuron_attribution": {
        "method": Choice("eap", "eap-ig"), "steps": Int(1), "batch_size": BATCH, "attention_mask": None, **ABLATION,
        "steps_at": Choice("mid", "left", "right"),
        "kinds": None},  # a list of "mlp", "ssm", "attn": tests/test_circuit_nodes.py
    "analysis.circuits.neurons.verify_neurons": {"batch_size": BATCH, "attention_mask": None, **ABLATION,
                                                 "kinds": None},
    "analysis.circuits.positions.PositionScores.top": {"n": Int(0)},
    "analysis.circuits.positions.position_attribution": {
        "method": Choice("eap", "eap-ig"), "steps": Int(1), "token_edges": FLAG, "batch_size": BATCH,
        "attention": Choice("scores", "pattern"), "attention_mask": None, **ABLATION,
        "steps_at": Choice("mid", "left", "right")},
    "analysis.circuits.positions.position_effects": {"attention": Choice("scores", "pattern"), "batch_size": BATCH,
                                                     "attention_mask": None, **ABLATION},
    "analysis.circuits.positions.verify_positions": {"attention": Choice("scores", "pattern"), "batch_size": BATCH,
                                                     "attention_mask": None, **ABLATION},
    "analysis.circuits.paths.path_patch": {"batch_size": BATCH, "attention_mask": None, **ABLATION},
    "analysis.circuits.paths.path_patch_sweep": {"batch_size": BATCH, "attention_mask": None, **ABLATION},
    "analysis.circuits.select.select": {"top_n": Int(0, none=True), "threshold": Real(0, none=True),
                                        "greedy": Int(0, none=True), "absolute": FLAG},  # exactly one rule
}

# Methods and functions checked by explicit calls (no decorator): argument -> spec, for the same tests.
EXPLICIT: dict[str, dict[str, Any]] = {
    "get_act_name": {"layer": Int(0, none=True)},
    "tokens_to_residual_directions": {"tokens": Int(0, "d_vocab", text=True)},
}

CLI: dict[str, dict[str, Any]] = {  # options whose value argparse does not already restrict
    "hooks": {"--prompt": Text()},
    "parity": {"--tol": Real(0)},
    "knockout": {"--n": Int(1, none=True), "--screen": Int(1, none=True), "--window": Int(1),
                 "--batch-size": Int(1)},
    "ga": {"--n": Int(1), "--seed": Int(0), "--rank-n": Int(1, none=True), "--batch-size": Int(1), "--top-k": Int(1),
           "--channel-group": Int(1, none=True), "--random-draws": Int(1), "--verify-top": Int(1),
           "--controls": Int(0), "--stage-n": Int(1), "--stage-keep": Int(1), "--replicas": Int(1, none=True)},
    "circuit": {"--pairs": Int(2), "--n": Int(1), "--steps": Int(1), "--top": Int(1),
                "--batch-size": Int(1, none=True)},
}
