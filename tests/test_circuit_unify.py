"""Every circuit entry point takes edge_attribution's arguments: padded prompts, zero / mean interventions.

In float64 on an attention family (GPT-2) and an SSM family (Mamba-2), prompts of lengths 5, 3, 7, 4 given as
lists of 1-D token tensors, each clean prompt with a corrupt of its length, run in chunks of 3 (so the second
chunk is trimmed to its longest prompt): position_attribution (EAP, EAP-IG, token edges), position_effects,
verify_positions (with a token edge cut), neuron_attribution (EAP, EAP-IG), verify_neurons,
verify_token_edges, path_patch and path_patch_sweep each equal the per-prompt runs (batches of one,
unpadded) combined as the metric combines them, a mean over prompts (1e-10). Positions are the padded
batch's columns: prompt b's own position q is column q + width - length_b, and a column that is padding for
a prompt changes nothing there. With metrics.KL (reading each chunk's clean logits) and zero / mean
interventions (the mean over a padded reference), the padded batch equals the per-prompt runs too.

Zero and mean ablations equal the same ablation by hand with the model's own hooks: the per-position circuit
missing the logits' edges at the last column (the final residual there set to 0, or to the reference's mean
final residual), the position edge embed -> logits at the last column (its estimate: the central difference
of the scaled ablation), the path embed -> logits (every position), and the neurons (the sites' features set
to 0 or to their reference means; the neuron scores: the central difference of the scaled ablation; the
fully ablated run: the final residual at its baseline).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import (graph_of, neuron_attribution, path_patch, path_patch_sweep, position_attribution,
                               position_effects, verify_neurons, verify_positions, verify_token_edges)
from analysis.circuits.metrics import KL, AnswerDiff
from analysis.circuits.neurons import neuron_sites
from analysis.circuits.positions import PositionEdge
from analysis.circuits.token_edges import TokenEdge

TOL = 1e-10
LENGTHS = (5, 3, 7, 4)
WIDTH = max(LENGTHS)
KINDS = {"gpt2": ("mlp", "attn"), "mamba2": ("ssm",)}
UNIT = {"gpt2": "L1H0", "mamba2": "L1H0"}


def _prompts(seed, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (n,), generator=gen) for n in lengths]


def _one(metric, k):
    return metric.rows(slice(k, k + 1))


def _mean(values):
    return sum(values) / len(values)


def _close(a, b, what=""):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item()), what


@pytest.fixture(scope="module", params=["gpt2", "mamba2"])
def case(request):
    model = copy.deepcopy(tiny(request.param)).double()
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    return request.param, model, _prompts(1), _prompts(2), metric


def _pairs(case):
    _, _, clean, corrupt, metric = case
    return [([c], [x], _one(metric, k), WIDTH - len(c)) for k, (c, x) in enumerate(zip(clean, corrupt))]


# ------------------------------------------------------------------------------- padded == per prompt
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_position_scores_are_the_per_prompt_ones_at_their_columns(case, method):
    name, model, clean, corrupt, metric = case
    batch = position_attribution(model, clean, corrupt, metric, method=method, steps=2, batch_size=3)
    want = torch.zeros_like(batch.scores)
    token = {site: torch.zeros_like(s) for site, (_, s) in batch.token.sites.items()}
    values = []
    for c, x, m, lo in _pairs(case):
        one = position_attribution(model, c, x, m, method=method, steps=2)
        want[:, lo:] += one.scores / len(clean)
        for site, (_, s) in one.token.sites.items():
            token[site][:, lo:, lo:] += s / len(clean)
        values.append((one.clean_metric, one.corrupt_metric))
    _close(batch.scores, want, name)
    for site, (_, s) in batch.token.sites.items():
        _close(s, token[site], site)
    _close([batch.clean_metric, batch.corrupt_metric], torch.tensor(values, dtype=torch.float64).mean(0))
    assert batch.settings["lengths"] == list(LENGTHS) and batch.settings["method"] == method


def test_position_effects_and_circuits_are_the_per_prompt_ones(case):
    name, model, clean, corrupt, metric = case
    unit = UNIT[name]
    # columns from the end (every prompt has them) and column 1 (padding for every prompt but the longest)
    resid = [("embed", "logits", WIDTH - 1), ("embed", "logits", 1), ("L0H1", f"{unit}.x" if name == "mamba2"
                                                                     else f"{unit}.v", WIDTH - 2)]
    token = TokenEdge(unit, WIDTH - 1, WIDTH - 2)
    effects = position_effects(model, [PositionEdge(*resid[0]), *resid[1:], token], clean, corrupt, metric,
                               batch_size=3)
    keep = [("embed", "logits", WIDTH - 1), ("embed", "logits", 1), ("L0H0", "logits", WIDTH - 1)]
    cut = TokenEdge(unit, WIDTH - 1, WIDTH - 3)
    circuit = verify_positions(model, keep, clean, corrupt, metric, cut=[cut], batch_size=3)
    per_effects, per_circuit = [], []
    for c, x, m, lo in _pairs(case):
        live = [k for k, (_, _, p) in enumerate(resid) if p >= lo]  # a padding column changes nothing
        own = [(s, r, p - lo) for s, r, p in (resid[k] for k in live)]
        got = position_effects(model, own + [TokenEdge(unit, token.target - lo, token.source - lo)], c, x, m)
        row = torch.zeros(len(resid) + 1, dtype=torch.float64)
        row[live + [len(resid)]] = got
        per_effects.append(row)
        kept = [(s, r, p - lo) for s, r, p in keep if p >= lo]
        per_circuit.append(verify_positions(model, kept, c, x, m, cut=[TokenEdge(unit, cut.target - lo,
                                                                                 cut.source - lo)]))
    _close(effects, _mean(per_effects), name)
    for key in ("circuit", "clean", "corrupt"):
        _close(circuit[key], _mean([p[key] for p in per_circuit]), key)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_neuron_scores_and_verification_are_the_per_prompt_ones(case, method):
    name, model, clean, corrupt, metric = case
    kinds = KINDS[name]
    batch = neuron_attribution(model, clean, corrupt, metric, method=method, steps=2, kinds=kinds, batch_size=3)
    kept = batch.top(10)
    circuit = verify_neurons(model, kept, clean, corrupt, metric, kinds=kinds, batch_size=3)
    alone = [(neuron_attribution(model, c, x, m, method=method, steps=2, kinds=kinds),
              verify_neurons(model, kept, c, x, m, kinds=kinds)) for c, x, m, _ in _pairs(case)]
    for site in batch.scores:
        _close(batch.scores[site], _mean([a.scores[site] for a, _ in alone]), site)
    ends = [torch.tensor([a.clean_metric, a.corrupt_metric], dtype=torch.float64) for a, _ in alone]
    _close([batch.clean_metric, batch.corrupt_metric], _mean(ends))
    for key in ("circuit", "clean", "corrupt"):
        _close(circuit[key], _mean([v[key] for _, v in alone]), key)


def test_token_edge_cuts_and_path_patching_are_the_per_prompt_ones(case):
    name, model, clean, corrupt, metric = case
    unit = UNIT[name]
    edges = [TokenEdge(unit, WIDTH - 1, WIDTH - 2), TokenEdge(unit, WIDTH - 2, 2)]  # column 2: padding for two
    cut = verify_token_edges(model, clean, edges, metric, batch_size=3)
    senders, receivers = ["embed", "L0H1"], ["logits", unit]  # unit: all of its parts
    one = path_patch(model, clean, corrupt, metric, ["L0H0"], ["logits"], batch_size=3)
    grid = path_patch_sweep(model, clean, corrupt, metric, senders, receivers, batch_size=3)
    per_cut, per_one, per_grid = [], [], []
    for c, x, m, lo in _pairs(case):
        own = [TokenEdge(e.unit, e.target - lo, e.source - lo) for e in edges if e.source >= lo]
        per_cut.append(verify_token_edges(model, c, own, m))
        per_one.append(path_patch(model, c, x, m, ["L0H0"], ["logits"]))
        per_grid.append(path_patch_sweep(model, c, x, m, senders, receivers))
    for key in ("clean", "exact"):
        _close(cut[key], _mean([p[key] for p in per_cut]), key)
    _close(one, _mean(per_one))
    _close(grid.nan_to_num(), _mean(per_grid).nan_to_num())


@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_kl_and_ablations_on_padded_prompts_are_the_per_prompt_ones(case, kind):
    """KL reads the clean logits (of each chunk's own clean run); the mean is over a padded reference."""
    name, model, clean, _, _ = case
    unit, kinds, kl = UNIT[name], KINDS[name], KL()
    kw = dict(intervention=kind, reference=_prompts(5, (4, 6)) if kind == "mean" else None)
    keep = [("embed", "logits", WIDTH - 1), ("L0H0", "logits", WIDTH - 1)]
    scores = position_attribution(model, clean, None, kl, token_edges=False, batch_size=3, **kw)
    circuit = verify_positions(model, keep, clean, None, kl, batch_size=3, **kw)
    neurons = neuron_attribution(model, clean, None, kl, kinds=kinds, batch_size=3, **kw)
    path = path_patch(model, clean, None, kl, ["embed"], ["logits"], batch_size=3, **kw)
    cut = verify_token_edges(model, clean, [TokenEdge(unit, WIDTH - 1, WIDTH - 2)], kl, batch_size=3)
    want, per = torch.zeros_like(scores.scores), []
    for c in clean:
        lo = WIDTH - len(c)
        want[:, lo:] += position_attribution(model, [c], None, kl, token_edges=False, **kw).scores / len(clean)
        per.append((verify_positions(model, [(s, r, p - lo) for s, r, p in keep], [c], None, kl, **kw)["circuit"],
                    neuron_attribution(model, [c], None, kl, kinds=kinds, **kw),
                    path_patch(model, [c], None, kl, ["embed"], ["logits"], **kw),
                    verify_token_edges(model, [c], [TokenEdge(unit, len(c) - 1, len(c) - 2)], kl)["exact"]))
    _close(scores.scores, want, name)
    _close(circuit["circuit"], _mean([p[0] for p in per]))
    for site in neurons.scores:
        _close(neurons.scores[site], _mean([p[1].scores[site] for p in per]), site)
    _close(neurons.corrupt_metric, _mean([p[1].corrupt_metric for p in per]))
    _close(path, _mean([p[2] for p in per]))
    _close(cut["exact"], _mean([p[3] for p in per]))


# ------------------------------------------------------------------------------- zero / mean by hand
def _last(logits):
    return logits[:, -1, 3].mean() - logits[:, -1].logsumexp(-1).mean()  # nonlinear in the logits


@pytest.fixture(scope="module", params=["gpt2", "mamba2"])
def small(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(7)
    clean, reference = (torch.randint(1, 64, (n, 5), generator=gen) for n in (2, 3))
    return request.param, model, clean, reference


def _run(model, tokens, hooks):
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model(tokens)


def _cache(model, tokens, names):
    with torch.no_grad():
        return model.run_with_cache(tokens, names_filter=list(names))[1]


def _kw(kind, reference, per_position=False):
    return dict(intervention=kind, reference=reference if kind == "mean" else None, per_position=per_position)


def _baseline_of(kind, reference_acts, per_position):
    """The hand baseline of an activation [b p ...]: 0, or its reference mean (whole or per position)."""
    if kind == "zero":
        return torch.zeros_like(reference_acts[:1, :1])
    return reference_acts.mean((0,) if per_position else (0, 1), keepdim=True)


KINDS_BY_HAND = [("zero", False), ("mean", False), ("mean", True)]


@pytest.mark.parametrize("kind,per_position", KINDS_BY_HAND)
def test_position_ablations_equal_the_ablation_by_hand(small, kind, per_position):
    name, model, clean, reference = small
    final, embed = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", "blocks.0.hook_resid_pre"
    acts = _cache(model, clean, [final, embed])
    ref = _cache(model, reference, [final, embed])
    base_final, base_embed = (_baseline_of(kind, ref[n], per_position) for n in (final, embed))
    clean_value = _last(model(clean)).item()

    def set_last(to):
        def fn(x, hook):
            x = x.clone()
            x[:, -1] = to.expand_as(x)[:, -1]
            return x
        return fn

    # every position edge kept but the logits' edges at the last column: the final residual there at its baseline
    keep = [(e.sender, e.receiver, p) for e in graph_of(model).edges() for p in range(5)
            if not (e.receiver == "logits" and p == 4)]
    got = verify_positions(model, keep, clean, None, _last, **_kw(kind, reference, per_position))
    want = _last(_run(model, clean, [(final, set_last(base_final))])).item()
    assert abs(got["circuit"] - want) < TOL, name
    whole = _last(_run(model, clean, [(final, lambda x, hook: base_final.expand_as(x).clone())])).item()
    assert abs(got["corrupt"] - whole) < TOL and abs(got["clean"] - clean_value) < TOL

    # the position edge embed -> logits at the last column: exact, and its estimate's derivative
    delta = (base_embed.expand_as(acts[embed]) - acts[embed])[:, -1]

    def shifted(t):
        def fn(x, hook):
            x = x.clone()
            x[:, -1] += t * delta
            return x
        return fn

    effect = position_effects(model, ["embed->logits@4"], clean, None, _last, **_kw(kind, reference, per_position))
    assert abs(effect.item() - (_last(_run(model, clean, [(final, shifted(1.0))])).item() - clean_value)) < TOL
    score = position_attribution(model, clean, None, _last, token_edges=False, **_kw(kind, reference, per_position))
    h = 1e-5
    up, down = (_last(_run(model, clean, [(final, shifted(t))])) for t in (h, -h))
    fd = (up - down) / (2 * h)
    assert abs(score["embed->logits@4"] - fd.item()) <= 1e-6 * max(abs(fd.item()), 1e-8), name

    # the path embed -> logits, every position
    def path(x, hook):
        return x + base_embed.expand_as(acts[embed]) - acts[embed]

    want = _last(_run(model, clean, [(final, path)])).item()
    assert abs(path_patch(model, clean, None, _last, ["embed"], ["logits"], **_kw(kind, reference, per_position))
               - want) < TOL


@pytest.mark.parametrize("kind,per_position", KINDS_BY_HAND)
def test_neuron_ablations_equal_the_ablation_by_hand(small, kind, per_position):
    name, model, clean, reference = small
    kinds = KINDS[name]
    sites = [s.name for s in neuron_sites(model, kinds)]
    final = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    acts, ref = _cache(model, clean, sites), _cache(model, reference, sites + [final])
    flat = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731
    base = {s: _baseline_of(kind, flat(ref[s]), per_position) for s in sites}
    scores = neuron_attribution(model, clean, None, _last, kinds=kinds, **_kw(kind, reference, per_position))
    kept = scores.top(6)

    def set_outside(keep):
        def fn(x, hook):
            f = flat(x).clone()
            mask = torch.ones(f.shape[-1], dtype=torch.bool)
            mask[[n.index for n in keep if n.hook == hook.name]] = False
            f[..., mask] = base[hook.name].expand_as(f)[..., mask]
            return f.reshape(x.shape)
        return fn

    got = verify_neurons(model, kept, clean, None, _last, kinds=kinds, **_kw(kind, reference, per_position))
    want = _last(_run(model, clean, [(s, set_outside(kept)) for s in sites])).item()
    assert abs(got["circuit"] - want) < TOL, name
    whole = _last(_run(model, clean, [(final, lambda x, hook: _baseline_of(kind, ref[final], per_position)
                                       .expand_as(x).clone())])).item()
    assert abs(got["corrupt"] - whole) < TOL and abs(scores.corrupt_metric - whole) < TOL

    h = 1e-5
    for n in kept[:3]:  # each score: d/dt metric(the neuron moved t of the way to its baseline), central differences
        def moved(t, n=n):
            def fn(x, hook):
                f = flat(x).clone()
                b, a = base[hook.name].expand_as(f)[..., n.index], flat(acts[hook.name])[..., n.index]
                f[..., n.index] += t * (b - a)
                return f.reshape(x.shape)
            return [(n.hook, fn)]
        fd = (_last(_run(model, clean, moved(h))) - _last(_run(model, clean, moved(-h)))).item() / (2 * h)
        assert abs(n.score - fd) <= 1e-6 * max(abs(fd), 1e-8), (name, n.label)
