"""Per-position graphs (analysis/circuits/positions.py): estimates and exact verification by position.

On attention (Llama), Mamba-2 and a delta-rule family (Qwen3-Next), float64 tiny models: the position scores
summed over positions are edge_attribution's (EAP and EAP-IG, 1e-10); each estimate equals the central finite
difference of its position edge scaled by +-eps (1e-4 relative); a patch with one weight per edge at every
position is the edge-level patched run (1e-12); exact position edges equal a brute force with hooks (a
norm's input changed at one position by the sender's corrupt-minus-clean activation, read from the model's
own hooks); keeping every position edge is the clean run and keeping one graph edge at every position is
verify_circuit's circuit; a token edge cut with every position edge kept is verify_token_edges' cut. On the
gpt2-kv organism (one prompt) the per-position circuit names the queried pair's key, value and newline
positions: L0H3 moves the key (position k) into its newline (k + 3), a value mover reads the value (k + 2)
there, and L1H0 reads that newline from the query; its top 12 position edges keep >= 0.95 of the metric. On
mamba2-kv (an SSM) the key enters B at its own position and head L0H1 reads the value position from the last
token; its top 4 position edges keep >= 0.95.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import circuit_metric, edge_attribution, graph_of, verify_token_edges
from analysis.circuits.positions import (PositionEdge, PositionScores, position_attribution, position_effects,
                                         position_index, verify_positions)
from analysis.circuits.runs import patched, record
from analysis.circuits.token_edges import TokenEdge

EPS = 1e-4
FAMILIES = ["llama", "mamba2", "qwen3_next"]
OUT_HOOK = {"llama": "blocks.0.hook_attn_out", "mamba2": "blocks.0.hook_mixer_out",
            "qwen3_next": "blocks.0.hook_mixer_out"}


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    return request.param, model, clean, corrupt


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_position_scores_sum_to_the_edge_scores(run, method):
    name, model, clean, corrupt = run
    pos = position_attribution(model, clean, corrupt, metric, method=method, steps=2, token_edges=True)
    edges = edge_attribution(model, clean, corrupt, metric, method=method, steps=2, token_edges=True)
    assert pos.scores.shape == (len(edges), clean.shape[1])
    assert _rel(pos.scores.sum(1), edges.scores) < 1e-10, name
    assert pos.scores.abs().max() > 0
    for unit in ("L0H0", "L1H1"):  # the token edges are edge_attribution's
        assert _rel(pos.token.of(unit), edges.token.of(unit)) < 1e-12
    assert pos.clean_metric == pytest.approx(edges.clean_metric) and pos.corrupt_metric == pytest.approx(
        edges.corrupt_metric)


def test_a_weight_per_position_constant_over_positions_is_the_edge_patch(run):
    _, model, clean, corrupt = run
    graph = graph_of(model)
    _, src = record(model, graph, corrupt)
    gen = torch.Generator().manual_seed(5)
    coef = (torch.rand(2, len(graph), generator=gen) < 0.5).double() * torch.tensor([[1.0], [0.4]]).double()
    by_edge = patched(model, graph, clean, src, coef)
    by_position = patched(model, graph, clean, src, coef[:, :, None].expand(-1, -1, clean.shape[1]).contiguous())
    assert _rel(by_position, by_edge) < 1e-12
    with torch.no_grad():
        assert _rel(by_edge, model(clean).repeat(2, 1, 1)) > 1e-6


def test_every_estimate_is_the_finite_difference_of_its_position_edge(run):
    name, model, clean, corrupt = run
    graph = graph_of(model)
    scores = position_attribution(model, clean, corrupt, metric, token_edges=False)
    _, src = record(model, graph, corrupt)
    picks = scores.position_edges(12) + scores.position_edges()[-4:]  # the largest and some near zero
    coef = torch.zeros(2 * len(picks), len(graph), clean.shape[1], dtype=torch.float64)
    for k, e in enumerate(picks):
        i, p = scores.index(e)
        coef[k, i, p], coef[len(picks) + k, i, p] = EPS, -EPS
    logits = patched(model, graph, clean, src, coef)
    b = clean.shape[0]
    values = torch.stack([metric(logits[k * b:(k + 1) * b]) for k in range(coef.shape[0])])
    fd = (values[:len(picks)] - values[len(picks):]) / (2 * EPS)
    assert _rel(fd, torch.tensor([e.score for e in picks])) < 1e-4, name


def _activation(model, tokens, hook_name):
    seen = {}
    model.run_with_hooks(tokens, fwd_hooks=[(hook_name, lambda x, hook: seen.__setitem__("x", x.detach()))])
    return seen["x"]


def _by_hand(model, clean, norm, delta, p):
    """The clean run with the input of `norm` changed at position p by delta[:, p] (a forward pre-hook)."""
    def pre(module, args):
        x = args[0].clone()
        x[:, p] += delta[:, p]
        return (x,) + tuple(args[1:])

    handle = norm.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return metric(model(clean))
    finally:
        handle.remove()


@pytest.mark.parametrize("p", [0, 3, 5])
def test_exact_position_edges_equal_a_brute_force_with_hooks(run, p):
    """embed -> logits @ p; embed -> every receiver of block 1's first step @ p; block 0's first sublayer's
    senders -> those receivers @ p: each the clean run with one norm's input changed at p by hand."""
    name, model, clean, corrupt = run
    graph = graph_of(model)
    with torch.no_grad():
        clean_value = float(metric(model(clean)))
    emb = _activation(model, corrupt, "blocks.0.hook_resid_pre") - _activation(model, clean, "blocks.0.hook_resid_pre")
    out = _activation(model, corrupt, OUT_HOOK[name]) - _activation(model, clean, OUT_HOOK[name])
    first = [g for g in graph.receiver_groups if g.layer == 1][0]  # block 1's first step reads ln1
    readers = [graph.receivers[i] for i in range(*graph.receiver_slices[graph.receiver_groups.index(first)].indices(
        len(graph.receivers)))]
    writers = [s for g in graph.sender_groups if g.layer == 0 and g.stage == 0 for s in g.labels]
    cases = [([("embed", "logits", p)], model.ln_final, emb),
             ([("embed", r, p) for r in readers], model.blocks[1].ln1, emb),
             ([(s, r, p) for s in writers for r in readers], model.blocks[1].ln1, out)]
    for edges, norm, delta in cases:
        keep_all_but = [e for e in _all(graph, clean.shape[1]) if e not in set(edges)]
        exact = verify_positions(model, keep_all_but, clean, corrupt, metric)["circuit"]
        hand = float(_by_hand(model, clean, norm, delta, p))
        assert abs(exact - hand) <= 1e-10 * max(1.0, abs(hand)), (name, edges[0])
        if norm is not model.ln_final or p == clean.shape[1] - 1:  # the metric reads the last position's logits
            assert abs(hand - clean_value) > 1e-8  # the patch changes the metric
    single = position_effects(model, [("embed", "logits", p)], clean, corrupt, metric)
    assert abs(float(single[0]) - (float(_by_hand(model, clean, model.ln_final, emb, p)) - clean_value)) < 1e-10


def _all(graph, n_pos):
    return [(e.sender, e.receiver, p) for e in graph.edges() for p in range(n_pos)]


def test_verification_spans_the_clean_run_and_the_edge_level_circuit(run):
    name, model, clean, corrupt = run
    graph = graph_of(model)
    whole = verify_positions(model, _all(graph, clean.shape[1]), clean, corrupt, metric)
    assert whole["faithfulness"] == pytest.approx(1.0, abs=1e-10) and whole["fraction"] == 1.0
    chosen = [graph.edge(i) for i in (0, len(graph) // 2, len(graph) - 1)]
    at_every_position = [(e.sender, e.receiver, p) for e in chosen for p in range(clean.shape[1])]
    by_position = verify_positions(model, at_every_position, clean, corrupt, metric)
    by_edge = circuit_metric(model, chosen, clean, corrupt, metric)
    assert abs(by_position["circuit"] - by_edge["circuit"]) < 1e-10 * max(1.0, abs(by_edge["circuit"])), name


def test_cutting_token_edges_in_the_verified_run(run):
    name, model, clean, corrupt = run
    graph = graph_of(model)
    cut = [TokenEdge("L1H0", 5, 2), TokenEdge("L0H1", 4, 4)]
    kept = verify_positions(model, _all(graph, clean.shape[1]), clean, corrupt, metric, cut=cut)
    by_knockout = verify_token_edges(model, clean, cut, metric)
    assert abs(kept["circuit"] - (by_knockout["clean"] + by_knockout["exact"])) < 1e-10, name
    assert abs(by_knockout["exact"]) > 1e-10
    effects = position_effects(model, cut[:1], clean, corrupt, metric)
    assert abs(float(effects[0]) - verify_token_edges(model, clean, cut[:1], metric)["exact"]) < 1e-12


def test_bad_edges_are_refused_by_name():
    model = tiny("llama")
    clean = torch.randint(1, 60, (1, 5))
    graph = graph_of(model)
    with pytest.raises(TypeError, match="token edge"):
        verify_positions(model, [TokenEdge("L1H0", 3, 1)], clean, clean.flip(1), metric)
    with pytest.raises(ValueError, match="sender->receiver@pos"):
        position_index(graph, 5, "embed->logits", "edges[0]")
    with pytest.raises(IndexError, match="positions"):
        position_index(graph, 5, ("embed", "logits", 5), "edges[0]")
    with pytest.raises(KeyError, match="no node"):
        position_index(graph, 5, "embed->nothing@1", "edges[0]")
    with pytest.raises(TypeError, match="cut\\[0\\]"):
        verify_positions(model, [], clean, clean.flip(1), metric, cut=["L1H0[3<-1]"])
    assert position_index(graph, 5, PositionEdge("embed", "logits", -1), "e") == position_index(
        graph, 5, "embed->logits@4", "e")


def test_scores_are_saved_and_drawn(run, tmp_path):
    name, model, clean, corrupt = run
    if name != "llama":
        pytest.skip("one family")
    scores = position_attribution(model, clean, corrupt, metric)
    data = json.loads(scores.to_json(tmp_path / "pos.json").read_text())
    assert len(data["position_edges"]) == len(scores.graph) * clean.shape[1]
    first = data["position_edges"][0]
    assert first["score"] == scores[(first["sender"], first["receiver"], first["pos"])]
    assert isinstance(scores, PositionScores) and "PositionScores" in repr(scores)
    import matplotlib.image

    image = matplotlib.image.imread(scores.plot(12, tmp_path / "pos.png"))
    assert image.shape[0] > 100 and image.std() > 0.01


def test_gpt2_kv_per_position_circuit_names_the_key_and_value_positions(organism):
    from analysis.circuits.tasks import kv_pairs
    from analysis.tasks import token_kv as kv

    model = organism("gpt2-kv")
    clean, corrupt, metric_ = kv_pairs(8, 1, 0, "?k", "swap")
    pair = int(kv.prompts(8, 1, 0, "?k").answer[0])
    key, value, newline, last = 1 + 4 * pair, 3 + 4 * pair, 4 + 4 * pair, clean.shape[1] - 1
    scores = position_attribution(model, clean, corrupt, metric_, method="eap-ig", steps=8)
    top = [str(e) for e in scores.top(8)]
    assert f"L0H3[{newline}<-{key}]" in top  # the key mover: the queried key into its newline
    assert f"L1H0[{last}<-{newline}]" in top  # the aggregate head reads that newline from the query
    assert f"embed->L0H3.v@{key}" in top and f"L0H3->L1H0.k@{newline}" in top and f"L1H0->logits@{last}" in top
    movers = [e for e in scores.token.top(12) if e.target == newline and e.source == value]
    assert movers, "a layer-0 head moves the value into its newline"
    faith = verify_positions(model, scores.position_edges(12), clean, corrupt, metric_)["faithfulness"]
    assert faith >= 0.95


def test_mamba2_kv_per_position_circuit_reads_the_key_into_B_and_the_value_from_the_kernel(organism):
    """An SSM organism: the queried key enters B at its own position (the conv carries it to the value's
    state update), and the aggregate head L0H1 reads the value position from the last token."""
    from analysis.circuits.tasks import kv_pairs
    from analysis.tasks import token_kv as kv

    model = organism("mamba2-kv")
    clean, corrupt, metric_ = kv_pairs(8, 1, 0, "k?", "swap")
    pair = int(kv.prompts(8, 1, 0, "k?").answer[0])
    key, value, last = 1 + 4 * pair, 3 + 4 * pair, clean.shape[1] - 1
    scores = position_attribution(model, clean, corrupt, metric_, method="eap-ig", steps=8)
    top = [str(e) for e in scores.top(5)]
    assert f"embed->L0Hg0.B@{key}" in top and f"L0H1->logits@{last}" in top
    reads = [e.source for e in scores.token.top(3) if e.unit == "L0H1" and e.target == last]
    assert value in reads
    assert verify_positions(model, scores.position_edges(4), clean, corrupt, metric_)["faithfulness"] >= 0.95
