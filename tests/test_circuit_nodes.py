"""Node and neuron scores equal grad x diff taken by hand; node and neuron patching equal the same done by hand.

In float64 on attention (GPT-2, GQA Llama) and SSM (Mamba-1, Mamba-2) families. By hand: one corrupt run
cached, one clean run whose token embedding is a leaf, gradients taken at the hooks where each node's write
is linear in what the hook holds (a head's hook_z, a Mamba-2 head's channels of hook_gated, a whole
sublayer's hook_*_out, embed's resid_pre), and node patching as those hooks set to the corrupt values.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import (edge_attribution, graph_of, neuron_attribution, node_attribution, node_scores,
                               verify_neurons, verify_nodes)
from analysis.circuits.neurons import neuron_sites
from hooked.models.model_map import model_map

FAMILIES = ["gpt2", "llama", "mamba", "mamba2"]


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    return request.param, model, clean, corrupt


def node_hooks(model):
    """{node label: (hook name, feature slice or None)}: where each node's write is linear in the hook."""
    out = {"embed": ("blocks.0.hook_resid_pre", None)}
    units = set()
    for site in model_map(model).mixers():
        if site.width > 1:  # heads (attention, Mamba-2); Mamba-1's channels are one node, the mixer
            for h, lab in enumerate(site.labels()):
                units.add(site.layer)
                feat = slice(h * site.width, (h + 1) * site.width)
                out[lab] = (site.hook, (h, slice(None)) if site.hook.endswith("hook_z") else feat)
    for l in range(model.cfg.n_layers):
        for kind in ("mlp", "mixer"):
            out[f"{kind}{l}"] = (f"blocks.{l}.hook_{kind}_out", None)
    return out


def pick(x, where):
    return x if where is None else x[(Ellipsis, *where)] if isinstance(where, tuple) else x[..., where]


def by_hand_grads(model, clean, corrupt, names):
    _, cache = model.run_with_cache(corrupt, names_filter=lambda n: n in names)
    seen = {}

    def leaf(x, hook):
        return x.detach().requires_grad_(True)

    def keep(x, hook):
        seen[hook.name] = x

    hooks = [("hook_embed", leaf)] + [(n, keep) for n in names]
    logits = model.run_with_hooks(clean, fwd_hooks=hooks)
    value = metric(logits)
    grads = dict(zip(names, torch.autograd.grad(value, [seen[n] for n in names], allow_unused=True)))
    return {n: (cache[n] - seen[n].detach(), grads[n]) for n in names}


def test_node_scores_equal_grad_x_diff_by_hand(run):
    name, model, clean, corrupt = run
    where = node_hooks(model)
    graph = graph_of(model)
    names = sorted({where[s][0] for s in graph.senders})
    hand = by_hand_grads(model, clean, corrupt, names)
    scores = node_attribution(model, clean, corrupt, metric)
    for s in graph.senders:
        hook, feat = where[s]
        diff, grad = hand[hook]
        expected = float((pick(diff, feat) * pick(grad, feat)).sum())
        assert abs(scores[s] - expected) <= 1e-10 * max(1.0, abs(expected)), (name, s, scores[s], expected)
    assert scores.top(1)[0][0] in graph.senders


def test_node_scores_are_edge_scores_summed_per_sender(run):
    _, model, clean, corrupt = run
    edges = edge_attribution(model, clean, corrupt, metric, method="eap-ig", steps=2)
    nodes = node_scores(edges)
    for s in ["embed", edges.graph.senders[-1]]:
        total = sum(e.score for e in edges.edges() if e.sender == s)
        assert nodes[s] == pytest.approx(total, abs=1e-12)
    assert nodes.method == "eap-ig"


def test_neuron_scores_equal_grad_x_diff_and_sum_to_their_node(run):
    name, model, clean, corrupt = run
    sites = neuron_sites(model)
    names = [s.name for s in sites]
    hand = by_hand_grads(model, clean, corrupt, names)
    scores = neuron_attribution(model, clean, corrupt, metric)
    for s in sites:
        diff, grad = hand[s.name]
        expected = (diff * grad).reshape(-1, len(s.units) * s.width).sum(0).reshape(len(s.units), s.width)
        torch.testing.assert_close(scores.scores[s.name], expected, rtol=0, atol=1e-10)
    nodes = node_attribution(model, clean, corrupt, metric)
    units = scores.units()
    for s in sites:  # the node's write is linear in its neurons: their scores sum to its score
        layer = int(s.name.split(".")[1])
        if s.width > 1:  # a Mamba-2 head's channels
            groups = {u: [u] for u in s.units}
        else:  # an MLP's neurons, a Mamba-1 mixer's channels
            groups = {f"{'mlp' if s.kind == 'mlp' else 'mixer'}{layer}": list(s.units)}
        for node, members in groups.items():
            total = sum(units[u] for u in members)
            assert abs(total - nodes[node]) <= 1e-10 * max(1.0, abs(total)), (name, node, total, nodes[node])


def test_neuron_eap_ig_with_one_step_is_the_midpoint_gradient(run):
    name, model, clean, corrupt = run
    sites = neuron_sites(model)
    mid = neuron_attribution(model, clean, corrupt, metric, method="eap-ig", steps=1)
    # by hand: the embedding halfway from corrupt to clean
    _, cache = model.run_with_cache(corrupt, names_filter=lambda n: n == "hook_embed" or n in {s.name for s in sites})
    _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in {s.name for s in sites})
    seen = {}

    def halfway(x, hook):
        return (cache["hook_embed"] + 0.5 * (x.detach() - cache["hook_embed"])).requires_grad_(True)

    def keep(x, hook):
        seen[hook.name] = x

    value = metric(model.run_with_hooks(clean, fwd_hooks=[("hook_embed", halfway)] + [(s.name, keep) for s in sites]))
    grads = torch.autograd.grad(value, [seen[s.name] for s in sites])
    for s, g in zip(sites, grads):
        expected = ((cache[s.name] - clean_cache[s.name]) * g).reshape(-1, len(s.units) * s.width).sum(0)
        torch.testing.assert_close(mid.scores[s.name].reshape(-1), expected, rtol=0, atol=1e-10)


def test_verify_nodes_equals_node_patching_by_hand(run):
    name, model, clean, corrupt = run
    where = node_hooks(model)
    graph = graph_of(model)
    gen = torch.Generator().manual_seed(5)
    keep = [s for s in graph.senders if torch.rand((), generator=gen) < 0.5] or ["embed"]
    names = sorted({where[s][0] for s in graph.senders})
    _, cache = model.run_with_cache(corrupt, names_filter=lambda n: n in names)
    outside: dict[str, list] = {}
    for s in graph.senders:
        if s not in keep:
            hook, feat = where[s]
            outside.setdefault(hook, []).append(feat)

    def patch(x, hook):
        x = x.clone()
        for feat in outside[hook.name]:
            if feat is None:
                x = cache[hook.name].clone()
            elif isinstance(feat, tuple):
                x[(Ellipsis, *feat)] = cache[hook.name][(Ellipsis, *feat)]
            else:
                x[..., feat] = cache[hook.name][..., feat]
        return x

    with torch.no_grad():
        expected = float(metric(model.run_with_hooks(clean, fwd_hooks=[(h, patch) for h in outside])))
    got = verify_nodes(model, keep, clean, corrupt, metric)
    assert abs(got["circuit"] - expected) <= 1e-10 * max(1.0, abs(expected)), (name, keep, got, expected)
    assert got["n_nodes"] == len(keep)
    every = verify_nodes(model, graph.senders, clean, corrupt, metric)
    assert every["faithfulness"] == pytest.approx(1.0, abs=1e-10)


def test_verify_neurons_with_none_kept_is_every_sublayer_corrupt(run):
    """Every MLP neuron and SSM channel at its corrupt value = every MLP (or SSM) node patched: two
    mechanisms (hooks on neurons, the edge patcher) agree."""
    name, model, clean, corrupt = run
    graph = graph_of(model)
    sites = neuron_sites(model)
    got = verify_neurons(model, [], clean, corrupt, metric)
    corrupted = {s for s in graph.senders if s.startswith(("mlp", "mixer"))}
    corrupted |= {lab for site in model_map(model).mixers() if site.kind == "ssm" for lab in site.labels()}
    nodes = verify_nodes(model, [s for s in graph.senders if s not in corrupted], clean, corrupt, metric)
    assert abs(got["circuit"] - nodes["circuit"]) <= 1e-10 * max(1.0, abs(nodes["circuit"]))
    assert got["n_neurons"] == 0
    kept_all = verify_neurons(model, [n for n in neuron_attribution(model, clean, corrupt, metric).neurons()],
                              clean, corrupt, metric)
    assert kept_all["faithfulness"] == pytest.approx(1.0, abs=1e-10)
    assert len(sites) >= model.cfg.n_layers


def test_bad_inputs_are_named():
    model = tiny("gpt2")
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="nodes"):
        verify_nodes(model, ["L9H9"], tokens, tokens + 1, metric)
    with pytest.raises(ValueError, match="neurons"):
        verify_neurons(model, ["L0N999"], tokens, tokens + 1, metric)
    with pytest.raises(ValueError, match="kinds"):
        neuron_attribution(model, tokens, tokens + 1, metric, kinds=["ssm"])
    with pytest.raises(ValueError, match="kinds"):
        neuron_attribution(model, tokens, tokens + 1, metric, kinds=["heads"])
    with pytest.raises(KeyError, match="L9H9"):
        node_attribution(model, tokens, tokens + 1, metric)["L9H9"]
