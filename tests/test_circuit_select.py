"""Circuit selection pruned to connected edges, saved and loaded scores, dot text and drawings.

Receivers' owners are checked by label on GQA attention and Mamba-2 groups; pruning equals the reference
library's node-removal fixpoint (written here) on random edge sets, drops an unconnected high-score edge, and
changes no exact metric (faithfulness before = after, float64); greedy equals a plain re-scan reference.
Scores round-trip through JSON bit for bit; dot text parses back to the same nodes and edges.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import (EdgeScores, circuit_metric, edge_attribution, graph_of, on_paths, select,
                               select_circuit, to_dot)
from analysis.circuits.select import greedy_mask

FAMILIES = ["gpt2", "llama", "mamba2", "zamba2", "granite", "falcon_h1"]


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


def random_scores(graph, seed):
    gen = torch.Generator().manual_seed(seed)
    return EdgeScores(graph, torch.randn(len(graph), generator=gen, dtype=torch.float64), "eap", 1.0, 0.0)


def test_owners_by_label():
    g = graph_of(tiny("llama"))  # 4 heads, 2 kv heads
    own = lambda r: [g.senders[s] for s in g.owners[g.receivers.index(r)]]  # noqa: E731
    assert own("L0H2.q") == ["L0H2"]
    assert own("L0H1.k") == own("L0H1.v") == ["L0H2", "L0H3"]
    assert own("mlp1") == ["mlp1"] and own("logits") == []
    g = graph_of(tiny("mamba2"))  # 4 heads, 2 groups of B and C, 2 groups of the gated norm
    own = lambda r: [g.senders[s] for s in g.owners[g.receivers.index(r)]]  # noqa: E731
    assert own("L1H3.x") == ["L1H2", "L1H3"]  # the norm's statistic over heads 2, 3 reads head 3's x
    assert own("L1Hg0.B") == own("L1Hg0.C") == ["L1H0", "L1H1"]
    assert own("L0Hg1.C") == ["L0H2", "L0H3"]
    g = graph_of(tiny("bamba"))  # one group: the norm's one statistic reads every head
    own = lambda r: [g.senders[s] for s in g.owners[g.receivers.index(r)]]  # noqa: E731
    assert own("L0H1.x") == own("L0Hg0.B") == ["L0H0", "L0H1", "L0H2", "L0H3"]
    g = graph_of(tiny("granite"))  # a mixture of experts: its input feeds every expert and the shared MLP
    own = lambda r: [g.senders[s] for s in g.owners[g.receivers.index(r)]]  # noqa: E731
    assert own("mlp0") == ["L0E0", "L0E1", "L0E2", "L0E3", "L0shared"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_receiver_but_the_logits_has_owners_in_its_layer(name):
    g = graph_of(tiny(name))
    layer = {lab: int(re.match(r"\D+(\d+)", lab).group(1)) for lab in g.senders + g.receivers if lab not in
             ("embed", "logits")}
    for r, owners in zip(g.receivers, g.owners):
        assert (r == "logits") == (len(owners) == 0), r
        assert all(layer[g.senders[s]] == layer[r] for s in owners), r


def library_prune(graph, keep):
    """hannamw/EAP-IG's Graph.prune on our graph: repeatedly drop nodes lacking an incoming (embed exempt) or
    outgoing edge, then edges whose sender or receiver's nodes are out, until nothing changes."""
    keep = keep.clone()
    nodes = set(range(len(graph.senders)))
    embed = graph.senders.index("embed")
    while True:
        outgoing = {int(s) for s, k in zip(graph.edge_sender, keep) if k}
        incoming = {o for r, k in zip(graph.edge_receiver, keep) if k for o in graph.owners[int(r)]} | {embed}
        new_nodes = outgoing & incoming
        new_keep = keep.clone()
        for e in range(len(graph)):
            if keep[e]:
                r = int(graph.edge_receiver[e])
                child_in = not graph.owners[r] or any(o in new_nodes for o in graph.owners[r])
                new_keep[e] = int(graph.edge_sender[e]) in new_nodes and child_in
        if new_nodes == nodes and bool((new_keep == keep).all()):
            return keep
        nodes, keep = new_nodes, new_keep


@pytest.mark.parametrize("name", ["llama", "mamba2", "zamba2", "granite"])
def test_on_paths_equals_the_library_prune(name):
    graph = graph_of(tiny(name))
    gen = torch.Generator().manual_seed(1)
    for density in (0.02, 0.05, 0.2):
        keep = torch.rand(len(graph), generator=gen) < density
        assert bool((on_paths(graph, keep) == library_prune(graph, keep)).all()), density


def test_an_unconnected_high_score_edge_is_dropped():
    graph = graph_of(tiny("gpt2"))
    values = torch.zeros(len(graph), dtype=torch.float64)
    for edge, score in [("L1H1->logits", 10.0),  # nothing feeds L1H1: unconnected from the input
                        ("embed->mlp1", 9.0),  # mlp1 writes nowhere in the circuit: a dead end
                        ("embed->L0H0.v", 5.0), ("L0H0->logits", -4.0)]:
        values[graph.index(edge)] = score
    scores = EdgeScores(graph, values, "eap", 1.0, 0.0)
    for chosen in (select(scores, top_n=4), select(scores, threshold=3.5)):
        assert chosen.n_selected == 4 and chosen.n_kept == 2
        assert [str(e) for e in chosen.edges] == ["embed->L0H0.v", "L0H0->logits"]
        assert chosen.nodes == ["embed", "L0H0", "logits"]
    greedy = select(scores, greedy=3)  # from the logits: L1H1 (10), L0H0 (-4), then into L0H0: embed->L0H0.v (5)
    assert greedy.n_selected == 3 and greedy.n_kept == 2  # L1H1->logits: nothing feeds L1H1
    assert [str(e) for e in greedy.edges] == ["embed->L0H0.v", "L0H0->logits"]


def plain_greedy(graph, values, n):
    """Re-scan every edge each step: the best among those whose receiver is the logits or owned by a chosen node."""
    chosen, nodes = [], set()
    for _ in range(n):
        best = None
        for e in range(len(graph)):
            owners = graph.owners[int(graph.edge_receiver[e])]
            if e not in chosen and (not owners or nodes & set(owners)):
                if best is None or abs(values[e]) > abs(values[best]):
                    best = e
        if best is None:
            break
        chosen.append(best)
        nodes.add(int(graph.edge_sender[best]))
    return sorted(chosen)


@pytest.mark.parametrize("name", ["llama", "mamba2", "zamba2"])
def test_greedy_equals_a_plain_rescan(name):
    graph = graph_of(tiny(name))
    scores = random_scores(graph, 7)
    for n in (1, 5, 17):
        assert greedy_mask(scores, n).nonzero()[:, 0].tolist() == plain_greedy(graph, scores.scores, n)


def scored(name):
    model = copy.deepcopy(tiny(name)).double()
    gen = torch.Generator().manual_seed(2)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    return name, model, clean, corrupt, edge_attribution(model, clean, corrupt, metric)


@pytest.fixture(scope="module", params=["gpt2", "llama", "mamba2", "zamba2"])
def run(request):
    return scored(request.param)


# bamba: one norm group over every Mamba-2 head; gemma2: post-norms; olmo2: a q/k norm over all heads;
# llamba: its in_proj order (x B C, z, dt)
@pytest.mark.parametrize("name", ["gpt2", "llama", "mamba2", "zamba2", "bamba", "gemma2", "olmo2", "llamba"])
def test_pruning_changes_no_exact_metric(name):
    """Dropped edges carry what the corrupt run carries anyway: faithfulness before = after pruning."""
    name, model, clean, corrupt, scores = scored(name)
    pruned_some = False
    for n in (len(scores) // 10, len(scores) // 4):
        rules = [dict(top_n=n), dict(threshold=float(scores.scores.abs().sort().values[-n])), dict(greedy=n)]
        for rule in rules:
            chosen = select_circuit(model, scores, clean, corrupt, metric, **rule)
            keep = greedy_mask(scores, n) if "greedy" in rule else (
                torch.zeros(len(scores), dtype=torch.bool).index_fill_(0, scores.order()[:n], True)
                if "top_n" in rule else scores.scores.abs() >= rule["threshold"])
            before = circuit_metric(model, keep.nonzero()[:, 0].tolist(), clean, corrupt, metric)
            assert chosen.n_selected == int(keep.sum()) and chosen.n_kept == len(chosen.edges) <= chosen.n_selected
            assert chosen.faithfulness == pytest.approx(before["faithfulness"], abs=1e-10), (name, rule)
            assert chosen.metric["n_edges"] == chosen.n_kept
            pruned_some |= chosen.n_kept < chosen.n_selected
    assert pruned_some, name


def test_save_and_load_round_trip(run, tmp_path):
    name, model, clean, corrupt, scores = run
    scores.settings.update({"steps": 3, "note": "kept"})
    path = scores.save(tmp_path / "scores.json")
    for loaded in (EdgeScores.load(path, model), EdgeScores.load(path)):
        assert torch.equal(loaded.scores, scores.scores)
        assert (loaded.method, loaded.settings) == (scores.method, scores.settings)
        assert (loaded.clean_metric, loaded.corrupt_metric) == (scores.clean_metric, scores.corrupt_metric)
        assert [str(e) for e in loaded.top(5)] == [str(e) for e in scores.top(5)]
        assert loaded.graph.owners == scores.graph.owners
        assert select(loaded, greedy=12).edges == select(scores, greedy=12).edges
    assert EdgeScores.load(path, model).graph.model is model
    other = tiny("mamba" if name != "mamba" else "gpt2")
    with pytest.raises(ValueError, match="model"):
        EdgeScores.load(path, other)
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="path"):
        EdgeScores.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="path"):
        EdgeScores.load(tmp_path / "missing.json")


NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)"\s*\[(.*)\];$')
EDGE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)"\s*->\s*"((?:[^"\\]|\\.)*)"\s*\[(.*)\];$')
ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\s]+)')


def parse_dot(text):
    """(nodes, {kind: [(tail, head, attrs)]}) of the dot text: a small reader for the statements to_dot writes."""
    lines = text.strip().splitlines()
    assert lines[0].startswith("digraph") and lines[-1] == "}"
    nodes, edges = {}, {}
    for line in lines[1:-1]:
        if m := EDGE.match(line):
            attrs = {k: v.strip('"') for k, v in ATTR.findall(m.group(3))}
            edges.setdefault(attrs["kind"], []).append((m.group(1), m.group(2), attrs))
        elif m := NODE.match(line):
            nodes[m.group(1)] = {k: v.strip('"') for k, v in ATTR.findall(m.group(2))}
    return nodes, edges


def test_dot_text_parses_back_to_the_same_graph(run):
    name, model, clean, corrupt, scores = run
    chosen = select(scores, top_n=20)
    nodes, edges = parse_dot(chosen.to_dot())
    graph = scores.graph
    assert sorted((s, r) for s, r, _ in edges["edge"]) == sorted((e.sender, e.receiver) for e in chosen.edges)
    for s, r, attrs in edges["edge"]:
        assert float(attrs["score"]) == scores[(s, r)]
    owned = {(r, graph.senders[o]) for e in chosen.edges if e.receiver not in graph.senders
             and e.receiver != "logits" for r in [e.receiver] for o in graph.owners[graph.receivers.index(r)]}
    assert {(r, o) for r, o, _ in edges.get("owner", [])} == owned
    expected_nodes = {e.sender for e in chosen.edges} | {e.receiver for e in chosen.edges} | {o for _, o in owned}
    assert set(nodes) == expected_nodes
    assert to_dot(graph, chosen.edges) == chosen.to_dot()


def test_drawn_circuit_opens_as_an_image(run, tmp_path):
    import matplotlib.image

    name, model, clean, corrupt, scores = run
    chosen = select(scores, greedy=15)
    for graph_from in (chosen, select(EdgeScores.load(scores.save(tmp_path / "s.json")), greedy=15)):
        path = graph_from.draw(tmp_path / f"{name}.png")
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
        assert float(image[..., :3].std()) > 0.01  # not blank
        assert float((image[..., :3] < 0.5).mean()) > 0.001  # something dark is drawn: text, lines


def test_bad_selections_are_named():
    scores = random_scores(graph_of(tiny("gpt2")), 0)
    with pytest.raises(ValueError, match="top_n"):
        select(scores)
    with pytest.raises(ValueError, match="greedy"):
        select(scores, top_n=2, greedy=2)
    with pytest.raises(ValueError, match="greedy"):
        select(scores, greedy=-1)
    with pytest.raises(ValueError, match="keep"):
        on_paths(scores.graph, torch.ones(3, dtype=torch.bool))
