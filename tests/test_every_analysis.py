"""Every analysis on every family of tests/tiny_families.py, each check one that can fail (issue 41).

One float64 copy of each family's tiny model (tiny_families.tiny) runs every analysis of analysis/; a family
added to tiny_families.CONFIGS is covered here with no edit. The analyses reach the family through the model
map and the mixer protocol only, so what holds here holds for any family built on them. Checks (float64,
within 1e-10 of the largest magnitude unless said):

    patching     patching the clean cache into the clean run is the clean run; the last hook_resid_post patched
                 into the corrupt run is the clean run; an act_patch sweep over hook_resid_pre, and one over a
                 state-bearing mixer's hook_h by position (states set, the recurrence continuing from them),
                 equal patches made by hand, and the corrupt run before the corrupted position
    ablation     ablate_units with one unit of every token-mixer site == zeroing those units' slices of the
                 write hooks by hand; per site, the ablated unit's write (the site's `writes`) is zero and the
                 other units' writes are the clean ones; ablate_heads(keep=True) == zeroing every other unit;
                 an expert's ablation zeroes its term of the mixture's output and keeps the others
    G&A          ga_scores == the gather / aggregate scores computed from the cached dense matrices
                 (hook_pattern; |hook_kernel| row-normalised) by analysis/ga/scores.py's definitions;
                 rank_heads' accuracy and log-prob drops of a unit == score_choices with it ablated by hand
    knockout     a knockout with no source is the clean run; edges cut in every layer == the cut entries of
                 every mixer's dense matrix zeroed (attention="pattern"), or its scores set to -inf
                 ("scores"; recurrent mixers have no scores: their kernel entries are zeroed, and the row
                 rescaled to its sum where the mixer says its cut renormalises: RWKV); a knockout
                 restricted to unit 0 of the recurrent mixers == zeroing only unit 0's kernel entries (every head's
                 of an attention in the same block); info_flow's change for one (fact, window) == the same
                 knockout by hand; decay_norms gives one positive number per unit
    rows         kernel_rows / kernel_cols == hook_kernel's rows / columns on every recurrent mixer (refused
                 by name on a family without one); the G&A weight rows == every mixer's matrix rows (the
                 pattern's for attention)
    circuits     EAP gives one finite score per edge of graph_of; verify_circuit(every edge) == 1, and
                 verify_circuit(no edge) == 0 where receivers read a sum of senders (not MiniMax: its stream
                 is renormalised at every step, tests/test_minimax_analysis.py)
    SAE          an SAE with its error term leaves the logits bit-identical; without, the run equals
                 splicing decode(encode(x)) by hand (at a block's resid_post and at a mixer's write hook)
    attribution  the logit attributions of the full residual decomposition sum to the logits
    refusals     what a family has nothing for is refused by name: kernel rows and a channel-restricted
                 knockout without a recurrent mixer, decay norms where nothing decays (attention, a short
                 convolution), expert ablation without experts
"""

from __future__ import annotations

import copy
import math
import string
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_sae import TinySAE
from tiny_families import FAMILIES, tiny

from analysis.circuits import edge_attribution, graph_of, verify_circuit
from analysis.ga import ga_scores, head_units, rank_heads
from analysis.ga.scores import weight_rows_hooks
from analysis.info_flow import info_flow
from analysis.interventions import ablate_experts, ablate_heads, act_patch, decay_norms, knockout, patch
from analysis.interventions.ablation import ablate_units
from analysis.interventions.experts import ablate_expert_units
from analysis.kernel_rows import kernel_cols, kernel_rows
from analysis.tasks.known_facts import load_facts, prepare_facts
from analysis.tasks.scoring import accuracy, answer_logprob, score_choices
from analysis.tasks.text import Example, char_tokenizer, encode_prompts
from hooked.models.model_map import model_map

TOL = 1e-10
POS, C = 8, 4  # prompt length; the position the corrupt prompt changes
ALPHABET = string.ascii_lowercase + string.digits + " :'\n.,?"  # char_tokenizer ids 4..46 (others: <unk>, 3)


def kv_example(pairs: list[tuple[str, str]], asked: int) -> Example:
    """kv_retrieval's task in few characters (GPT-2's tiny n_ctx is 64): `key:value` lines, then `key?`."""
    prompt, segments = "", []
    for key, value in pairs:
        segments.append((len(prompt), len(prompt) + len(key) + len(value) + 2))
        prompt += f"{key}:{value}\n"
    return Example(prompt + pairs[asked][0] + "?", [v for _, v in pairs], asked, segments)


EXAMPLES = [kv_example([("ox", "12"), ("fig", "34"), ("yak", "5")], 1), kv_example([("elm", "67"), ("ox", "8")], 0)]
SOURCES, TARGETS = [1, 3], [3, 5, 7]  # every target keeps an uncut key (no row is cut whole)


@dataclass
class Run:
    name: str
    model: Any
    clean: torch.Tensor
    corrupt: torch.Tensor
    logits: torch.Tensor
    cache: Any


@pytest.fixture(scope="module", params=FAMILIES)
def run(request) -> Run:
    model = copy.deepcopy(tiny(request.param)).double()
    model.tokenizer = char_tokenizer(ALPHABET)
    top = min(model.cfg.d_vocab, 64)  # ids 0..3: special tokens
    clean = torch.randint(4, top, (2, POS), generator=torch.Generator().manual_seed(1))
    corrupt = clean.clone()
    corrupt[:, C] = (clean[:, C] - 4 + 7) % (top - 4) + 4
    with torch.no_grad():
        logits, cache = model.run_with_cache(clean)
    return Run(request.param, model, clean, corrupt, logits, cache)


def close(a, b, what: str = "", tol: float = TOL) -> None:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


def unit_slices(site, units) -> Any:
    """A hook zeroing `units` of `site` at its write hook by hand: [.. pos n width] or [.. pos n * width]."""
    def hook(act, hook):
        act = act.clone()
        for u in units:
            if act.ndim == 4 and act.shape[-2] == site.n:
                act[..., u, :] = 0
            else:
                act[..., u * site.width:(u + 1) * site.width] = 0
        return act
    return hook


def reads_of(model, site, tokens) -> dict:
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[h.name for h in site.reads])
    return cache.cache_dict


# ---------------------------------------------------------------------------------- patching
def position_patch(source: torch.Tensor, t: int):
    """A hook setting position t of its activation to `source`'s, by hand."""
    def hook(act, hook):
        act = act.clone()
        act[:, t] = source[:, t]
        return act
    return hook


def test_patching(run):
    model, clean, corrupt, cache = run.model, run.clean, run.corrupt, run.cache
    n = model.cfg.n_layers
    with torch.no_grad():
        close(patch(model, clean, cache, f"blocks.{n - 1}.hook_resid_pre"), run.logits, "self-patch")
        close(patch(model, corrupt, cache, f"blocks.{n - 1}.hook_resid_post"), run.logits, "last resid_post patched")
        sweep = act_patch(model, corrupt, cache, metric, "blocks.{layer}.hook_resid_pre")
        plain = metric(model(corrupt))
        assert sweep.shape == (n, POS)
        close(sweep[:, :C], plain.expand(n, C), "positions before the change")
        for layer, t in {(0, C), (n - 1, POS - 1), (n // 2, C + 1)}:
            name = f"blocks.{layer}.hook_resid_pre"
            by_hand = metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, position_patch(cache[name], t))]))
            close(sweep[layer, t], by_hand, f"{name} at {t}")
        assert not torch.isclose(sweep[0, C], plain)


def test_patching_states_by_position(run):
    """The last state-bearing mixer's hook_h patched position by position (each a state SET there, from which
    the recurrence continues: hooked/state_edit.py) == the same patches by hand; the states before the
    corrupted position are the clean ones already."""
    model, clean, corrupt = run.model, run.clean, run.corrupt
    states = [s.module.hook_h for s in model_map(model).mixers() if s.recurrent and hasattr(s.module, "hook_h")]
    if not states:
        pytest.skip("no state hook: attention, or a short convolution (its window is its state)")
    name = states[-1].name
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=[name])
        sweep = act_patch(model, corrupt, cache, metric, name, over=("pos",))
        plain = metric(model(corrupt))
        close(sweep[:C], plain.expand(C), f"{name} before the change")
        for t in (C, POS - 1):
            by_hand = metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, position_patch(cache[name], t))]))
            close(sweep[t], by_hand, f"{name} at {t}")
        assert (sweep[C:] - plain).abs().max() > 1e-9  # small where the states decay fast (Mamba-1), not 0


# ---------------------------------------------------------------------------------- ablation
def test_ablating_units_zeroes_their_writes(run):
    model, clean = run.model, run.clean
    mp = model_map(model)
    sites = mp.mixers()
    assert sites and {u.module for u in head_units(model)} == {s.path for s in sites}
    last = {s.path: s.units()[-1] for s in sites}  # one unit of every site (a Mamba-1 channel group)
    with torch.no_grad():
        with ablate_units(model, last.values()):
            ours = model(clean)
        ref = model.run_with_hooks(clean, fwd_hooks=[(s.hook, unit_slices(s, last[s.path].heads)) for s in sites])
    close(ours, ref, "ablate_units vs write-hook slices zeroed by hand")
    assert not torch.allclose(ours, run.logits)
    for site in sites:
        clean_writes = site.writes_from(reads_of(model, site, clean))
        unit = last[site.path]
        with ablate_units(model, [unit]):
            writes = site.writes_from(reads_of(model, site, clean))
        others = [i for i in range(site.n) if i not in unit.heads]
        assert writes[..., list(unit.heads), :].abs().max() == 0, site.path
        close(writes[..., others, :], clean_writes[..., others, :], f"{site.path}: the other units' writes")
    first = sites[0]
    with torch.no_grad():
        with ablate_heads(model, [(first.path, 0)], keep=True):
            kept = model(clean)
        ref = model.run_with_hooks(clean, fwd_hooks=[(first.hook, unit_slices(first, range(1, first.n)))])
    close(kept, ref, "keep=True vs every other unit zeroed")


def test_ablating_an_expert_zeroes_its_term(run):
    model, clean = run.model, run.clean
    experts = model_map(model).experts()
    if not experts:
        with pytest.raises(ValueError, match="not a mixture-of-experts MLP"), ablate_experts(model, [(0, 0)]):
            pass
        return
    unit = experts[1]
    site = unit.placed()
    clean_writes = site.writes_from(reads_of(model, site, clean))
    with ablate_expert_units(model, [unit]):
        writes = site.writes_from(reads_of(model, site, clean))
        with torch.no_grad():
            ours = model(clean)
    assert writes[..., 1, :].abs().max() == 0 and clean_writes[..., 1, :].abs().max() > 0
    close(writes[..., [0, *range(2, site.n)], :], clean_writes[..., [0, *range(2, site.n)], :], "other experts")
    with torch.no_grad(), ablate_experts(model, [(site.path, 1)]):
        close(model(clean), ours, "ablate_experts by (module, e)")
    assert not torch.allclose(ours, run.logits)


# ------------------------------------------------------------------------------------- G & A
def test_ga_scores_equal_the_dense_matrices(run):
    model = run.model
    sites = model_map(model).mixers()
    units = head_units(model)
    scores = ga_scores(model, EXAMPLES[:1], units)
    batch = encode_prompts(model, EXAMPLES[:1])
    names = [s.mixing().matrix.name for s in sites]
    with torch.no_grad():
        _, cache = model.run_with_cache(batch.tokens, names_filter=names)
    query, spans = batch.tokens.shape[1] - 1, batch.segments[0]
    by_site = {}
    for site, name in zip(sites, names):
        m = cache[name][0]  # [n q k]
        w = m.abs() / m.abs().sum(-1, keepdim=True) if site.recurrent else m
        gather = torch.stack([w[:, last, first:last].sum(-1) for first, last in spans]).mean(0)
        aggregate = torch.stack([w[:, query, last] for _, last in spans]).sum(0)
        by_site[site.path] = gather, aggregate
    assert set(scores) == {u.label for u in units}
    for u in units:
        gather, aggregate = by_site[u.module]
        close(scores[u.label]["gather"], gather[list(u.heads)].mean(), f"{u.label} gather")
        close(scores[u.label]["aggregate"], aggregate[list(u.heads)].mean(), f"{u.label} aggregate")


def test_rank_heads_drops_equal_ablations_by_hand(run):
    model = run.model
    units = head_units(model)
    picked = [units[0], units[-1]]
    ranking = rank_heads(model, EXAMPLES, picked, batch_size=2, pairs_top_k=0, progress=False)
    rows = {r["unit"]: r for r in ranking.rows}
    assert set(rows) == {u.label for u in picked}
    with torch.no_grad():
        base = score_choices(model, EXAMPLES)
        for u in picked:
            with ablate_units(model, [u]):
                ablated = score_choices(model, EXAMPLES)
            close(rows[u.label]["logprob_drop"], answer_logprob(base, EXAMPLES) - answer_logprob(ablated, EXAMPLES),
                  f"{u.label} log-prob drop", 1e-8)
            assert rows[u.label]["drop"] == accuracy(base, EXAMPLES) - accuracy(ablated, EXAMPLES)


# ---------------------------------------------------------------------------------- knockout
CUT = torch.zeros(POS, POS, dtype=torch.bool)
CUT[torch.tensor(TARGETS)[:, None], torch.tensor(SOURCES)] = True


def cut_by_hand(site, mode: str = "pattern", unit: int | None = None) -> tuple[str, Any]:
    """(hook, fn) cutting the (TARGETS, SOURCES) entries of the site's dense matrix (of `unit` only, if given):
    -inf on attention's scores ("scores"), else zeros on the matrix, the row rescaled to its sum where the
    mixer's cut renormalises (Mixing.renormalised: RWKV)."""
    m = site.mixing()
    if mode == "scores" and m.scores is not None:
        return m.scores.name, lambda x, hook: x.masked_fill(CUT, -math.inf)
    cut = CUT if unit is None else CUT & (torch.arange(site.n) == unit)[:, None, None]

    def hook(x, hook):
        assert x.shape[1] == site.n, (hook.name, x.shape, site.n)
        kept = x.masked_fill(cut, 0.0)
        return kept * (x.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True)) if m.renormalised else kept
    return m.matrix.name, hook


@pytest.mark.parametrize("mode", ["pattern", "scores"])
def test_knockout_equals_the_dense_matrices_cut(run, mode):
    model, clean = run.model, run.clean
    layers = range(model.cfg.n_layers)
    with torch.no_grad():
        with knockout(model, sources=[], targets=TARGETS, layers=layers, attention=mode):
            close(model(clean), run.logits, "a knockout cutting nothing")
        with knockout(model, sources=SOURCES, targets=TARGETS, layers=layers, attention=mode):
            ours = model(clean)
        ref = model.run_with_hooks(clean, fwd_hooks=[cut_by_hand(s, mode) for s in model_map(model).mixers()])
    close(ours, ref, "knockout vs the dense matrices cut by hand")
    close(ours[:, :TARGETS[0]], run.logits[:, :TARGETS[0]], "before the first target")
    assert not torch.allclose(ours, run.logits)


def test_info_flow_equals_the_knockout_by_hand(run):
    model = run.model
    n = model.cfg.n_layers
    facts = load_facts()[:2]
    result = info_flow(model, facts, window=1, sources=("last", "first"), batch_size=1, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 2, n) and torch.isfinite(result.changes).all()
    prompt = prepare_facts(model.tokenizer, facts)[0][1]
    tokens = torch.tensor([prompt.ids])
    with torch.no_grad():
        p = model(tokens)[0, -1].softmax(-1)[prompt.answer]
        with knockout(model, sources=[-1], targets=[-1], layers=[n - 1]):
            p_ko = model(tokens)[0, -1].softmax(-1)[prompt.answer]
    close(result.changes[1, 0, n - 1], 100 * (p_ko - p) / p, "info_flow's change by hand", 1e-8)


# -------------------------------------------------------------------------------------- rows
def test_kernel_and_pattern_rows_equal_the_dense_matrices(run):
    model, clean = run.model, run.clean
    sites = model_map(model).mixers()
    names = [s.mixing().matrix.name for s in sites]
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=names)
    rows, cols = [7, 2], [0, 5]
    recurrent = [s.path for s in sites if s.recurrent]
    if recurrent:
        by_row, by_col = kernel_rows(model, clean, rows), kernel_cols(model, clean, cols)
        assert set(by_row) == set(by_col) == set(recurrent)
        for s in recurrent:
            close(by_row[s], cache[f"{s}.hook_kernel"][:, :, rows], f"{s} kernel rows")
            close(by_col[s], cache[f"{s}.hook_kernel"][..., cols], f"{s} kernel columns")
    else:
        with pytest.raises(ValueError, match="no state-space mixer"):
            kernel_rows(model, clean, rows)
    got = {}
    hooks = [h for s in sites
             for h in weight_rows_hooks(s, torch.tensor(rows), lambda x, s=s: got.setdefault(s.path, x))]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(clean)
    for site, name in zip(sites, names):
        close(got[site.path], cache[name][:, :, rows], f"{site.path} matrix rows")


# ---------------------------------------------------------------------------------- circuits
def test_circuits(run):
    model, clean, corrupt = run.model, run.clean, run.corrupt
    graph = graph_of(model)
    scores = edge_attribution(model, clean, corrupt, metric)
    assert len(scores) == len(graph) > 0
    assert torch.isfinite(scores.scores).all() and scores.scores.abs().max() > 0
    close(verify_circuit(model, list(graph.edges()), clean, corrupt, metric), 1.0, "every edge")
    if not any(block.stream_norms() for block in model.blocks):
        close(verify_circuit(model, [], clean, corrupt, metric), 0.0, "no edge", 1e-8)
    assert math.isfinite(verify_circuit(model, scores.top(3), clean, corrupt, metric))


# --------------------------------------------------------------------------------------- SAE
def test_saes(run):
    model, clean = run.model, run.clean
    for name in ("blocks.0.hook_resid_post", model_map(model).mixers()[-1].hook):
        act = run.cache[name]
        sae = TinySAE(math.prod(act.shape[2:]), 24).double()
        with torch.no_grad():
            plain = model(clean)  # no hook listens: SDPA attention (run.logits, cached: eager, 1e-16 apart)
            model.add_sae(sae, name, use_error_term=True)
            try:
                assert torch.equal(model(clean), plain), name
                model.add_sae(sae, name, use_error_term=False)
                ours = model(clean)
            finally:
                model.reset_saes()
            ref = model.run_with_hooks(clean, fwd_hooks=[(name, lambda x, hook: sae.decode(sae.encode(
                x.flatten(2))).view_as(x))])
        close(ours, ref, f"SAE at {name} vs decode(encode(x)) by hand")
        assert not torch.allclose(ours, run.logits)


# ------------------------------------------------------------------------------- attribution
def test_logit_attributions_sum_to_the_logits(run):
    model, clean, cache = run.model, run.clean, run.cache
    stack = cache.get_full_resid_decomposition()
    target = clean[:, 1:]
    attrs = cache.logit_attrs(stack[:, :, :-1], target, pos_slice=slice(0, -1))
    pre_cap = cache["unembed.softcap.hook_in"] if "unembed.softcap.hook_in" in cache.cache_dict else run.logits
    expected = pre_cap[:, :-1].gather(-1, target[..., None])[..., 0]
    if getattr(model.ln_final, "bias", None) is not None:  # LayerNorm's bias is no component's
        expected = expected - model.unembed.scale * (model.unembed.weight[target] @ model.ln_final.bias)
    close(attrs.sum(0), expected, "logit attributions")


# ------------------------------------------------------------------- decay and channel knockouts
def test_channel_knockouts_and_decay_norms_or_their_refusals(run):
    """A knockout restricted to unit 0 of the recurrent mixers == cutting the entries of their kernels' unit 0 by
    hand (and of every head of an attention beside them); decay norms per unit, or refused where nothing decays."""
    model, clean = run.model, run.clean
    recurrent = [s for s in model_map(model).mixers() if s.recurrent]
    if not recurrent:
        with pytest.raises(ValueError, match="channels restricts the cut of SSM mixers"):
            with knockout(model, sources=[1], targets=[3], layers=[0], channels=[0]):
                pass
        with pytest.raises(TypeError, match="has no state-space mixer"):
            decay_norms(model, 0)
        return
    layer = recurrent[0].layer
    hooks = [cut_by_hand(s, unit=0 if s.recurrent else None) for s in model_map(model).layer_sites(layer)
             if s.mixes_tokens]
    with torch.no_grad():
        with knockout(model, sources=SOURCES, targets=TARGETS, layers=[layer], channels=[0], attention="pattern"):
            ours = model(clean)
        ref = model.run_with_hooks(clean, fwd_hooks=hooks)
    close(ours, ref, f"layer {layer}: channel 0 cut vs its kernel entries zeroed")
    assert not torch.allclose(ours, run.logits)
    for site in recurrent:
        try:
            norms = decay_norms(model, site.layer)
        except TypeError as e:  # a short convolution keeps no decaying state
            assert "has no state decay" in str(e), e
            continue
        assert norms.shape == (site.n,) and torch.isfinite(norms).all() and (norms > 0).all(), site.path
