"""Circuits on prompts of different lengths equal the per-prompt runs combined as the metric combines them.

In float64, on attention (GPT-2's learned positions), SSM (Mamba-1, Mamba-2) and delta-rule (Qwen3-Next)
families: prompts of lengths 5, 3, 7, 4, each clean prompt with a corrupt of its length, given as a list of
1-D token tensors. The metric is a mean over prompts, so every per-prompt quantity combines as the mean of
the per-prompt runs (each a batch of one, unpadded): EAP and EAP-IG scores and metrics, circuit_metric,
faithfulness_curve, edge_effects, rescore and the token-edge estimates (prompt b's position p at column
p + width - length_b); node scores and node verification too. Every family of tiny_families: EAP and one
patched run (each family's attention_mask path: rotary, side blocks, experts, mixers that zero padded
rows). The forms a user may give (left- or right-padded batches with their mask, lists, strings through
model.tokenizer, chunks) give the same numbers; pad positions get no gradient and EAP drops their sender
diffs; bad inputs are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES as ALL_FAMILIES
from tiny_families import tiny

from analysis.circuits import circuit_metric, edge_attribution, edge_effects, faithfulness_curve, graph_of, rescore
from analysis.circuits.metrics import AnswerDiff
from analysis.circuits.prompts import PAD, pad_free, prompt_pair
from analysis.circuits.runs import gradients, record

FAMILIES = ("gpt2", "mamba", "mamba2", "qwen3_next")
LENGTHS = (5, 3, 7, 4)
TOL = 1e-10


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _prompts(seed, lengths=LENGTHS, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def _one(metric, k):
    return metric.rows(slice(k, k + 1)) if hasattr(metric, "rows") else metric


def _mean(values):
    return sum(values) / len(values)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    model = copy.deepcopy(tiny(request.param)).double()
    clean, corrupt = _prompts(1), _prompts(2)
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    return request.param, model, clean, corrupt, metric


@pytest.fixture(scope="module")
def eap(case):
    """EAP and EAP-IG on the padded batch and on each prompt alone."""
    _, model, clean, corrupt, metric = case
    out = {}
    for method in ("eap", "eap-ig"):
        batch = edge_attribution(model, clean, corrupt, metric, method=method, steps=3)
        alone = [edge_attribution(model, [c], [x], _one(metric, k), method=method, steps=3)
                 for k, (c, x) in enumerate(zip(clean, corrupt))]
        out[method] = batch, alone
    return out


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_scores_are_the_mean_of_the_per_prompt_scores(case, eap, method):
    batch, alone = eap[method]
    assert _rel(batch.scores, _mean([a.scores for a in alone])) < TOL
    assert abs(batch.clean_metric - _mean([a.clean_metric for a in alone])) < TOL
    assert abs(batch.corrupt_metric - _mean([a.corrupt_metric for a in alone])) < TOL


def test_verification_is_the_mean_of_the_per_prompt_runs(case, eap):
    _, model, clean, corrupt, metric = case
    scores = eap["eap"][0]
    edges = scores.top(len(scores) // 3)
    got = circuit_metric(model, edges, clean, corrupt, metric)
    alone = [circuit_metric(model, edges, [c], [x], _one(metric, k)) for k, (c, x) in enumerate(zip(clean, corrupt))]
    for key in ("circuit", "clean", "corrupt"):
        assert abs(got[key] - _mean([a[key] for a in alone])) < TOL, key
    c, x, v = (_mean([a[key] for a in alone]) for key in ("clean", "corrupt", "circuit"))
    assert abs(got["faithfulness"] - (v - x) / (c - x)) < 1e-8

    sizes = [0, 5, len(scores)]
    curve = faithfulness_curve(model, scores, clean, corrupt, metric, sizes)
    per = [faithfulness_curve(model, scores, [c], [x], _one(metric, k), sizes)
           for k, (c, x) in enumerate(zip(clean, corrupt))]
    for row, point in enumerate(curve):
        assert abs(point["metric"] - _mean([p[row]["metric"] for p in per])) < TOL

    chosen = scores.top(6)
    effects = edge_effects(model, chosen, clean, corrupt, metric)
    per = [edge_effects(model, chosen, [c], [x], _one(metric, k)) for k, (c, x) in enumerate(zip(clean, corrupt))]
    assert (effects - _mean(per)).abs().max().item() < TOL
    exact = rescore(model, scores, clean, corrupt, metric, shortlist=6)
    assert (exact.scores[scores.order()[:6]] - effects).abs().max().item() < TOL


@pytest.mark.parametrize("family", ["llama", "mamba2", "qwen3_next"])
def test_token_edge_estimates_are_the_per_prompt_ones_aligned_at_the_end(family):
    model = copy.deepcopy(tiny(family)).double()
    clean, corrupt = _prompts(3), _prompts(4)
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    batch = edge_attribution(model, clean, corrupt, metric, token_edges=True, batch_size=3).token
    width = max(LENGTHS)
    for name, (_, s) in batch.sites.items():
        want = torch.zeros_like(s)
        for k, (c, x) in enumerate(zip(clean, corrupt)):
            one = edge_attribution(model, [c], [x], _one(metric, k), token_edges=True).token.sites[name][1]
            lo = width - len(c)
            want[:, lo:, lo:] += one / len(clean)
        assert _rel(s, want) < TOL, name


def _batch(prompts, side):
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), 17)  # any id at pad positions: they are replaced
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        tokens[b, cols], mask[b, cols] = p, 1
    return tokens, mask


@pytest.mark.parametrize("family", ["llama", "mamba2"])  # the forms are the normalisation's: two families
def test_every_form_of_the_same_prompts_gives_the_same_scores(family):
    model = copy.deepcopy(tiny(family)).double()
    clean, corrupt = _prompts(1), _prompts(2)
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    want = edge_attribution(model, clean, corrupt, metric).scores
    for side in ("left", "right"):
        (c, mask), (x, _) = _batch(clean, side), _batch(corrupt, side)
        got = edge_attribution(model, c, x, metric, attention_mask=mask)
        assert _rel(got.scores, want) < 1e-12, side
    chunked = edge_attribution(model, clean, corrupt, metric, batch_size=3)  # chunks of 3 and 1, each trimmed
    assert _rel(chunked.scores, want) < TOL
    lists = edge_attribution(model, [p.tolist() for p in clean], [p.tolist() for p in corrupt], metric)
    assert _rel(lists.scores, want) < 1e-12


def test_strings_go_through_the_models_tokenizer():
    from analysis.tasks.text import char_tokenizer

    model = copy.deepcopy(tiny("mamba2")).double()
    model.tokenizer = char_tokenizer("abcdefghij")
    clean, corrupt = ["abc", "abcdefg", "hij"], ["bca", "gfedcba", "jih"]
    metric = AnswerDiff(torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9]))
    got = edge_attribution(model, clean, corrupt, metric)
    ids = [torch.tensor(model.tokenizer(t)["input_ids"]) for t in clean]
    want = edge_attribution(model, ids, [torch.tensor(model.tokenizer(t)["input_ids"]) for t in corrupt], metric)
    assert _rel(got.scores, want.scores) < 1e-12
    assert abs(circuit_metric(model, got.top(5), clean, corrupt, metric)["circuit"]
               - circuit_metric(model, got.top(5), ids, [torch.tensor(model.tokenizer(t)["input_ids"])
                                                          for t in corrupt], metric)["circuit"]) < 1e-12


def test_a_metric_without_rows_or_tail_reads_each_prompts_last_token():
    model = copy.deepcopy(tiny("gpt2")).double()
    clean, corrupt = _prompts(1), _prompts(2)

    def metric(logits):  # no tail, no rows: given every position's logits, reads the last
        return (logits[:, -1, 3] - logits[:, -1, 5]).mean()

    got = edge_attribution(model, clean, corrupt, metric)
    alone = [edge_attribution(model, [c], [x], metric) for c, x in zip(clean, corrupt)]
    assert _rel(got.scores, _mean([a.scores for a in alone])) < TOL


def test_pad_positions_get_no_gradient_and_eap_drops_their_diffs(case):
    _, model, clean, corrupt, metric = case
    c, x = prompt_pair(model, clean, corrupt)
    assert c.padded and bool((c.tokens[~c.attention_mask] == PAD).all())
    pad = ~c.attention_mask
    graph = graph_of(model)
    _, _, (g, ge) = gradients(model, graph, c.tokens, metric, c.attention_mask)
    assert g[:, pad].abs().max().item() == 0.0  # no real position reads a pad position
    assert g[:, ~pad].abs().max().item() > 0.0
    assert all(e is None or e[:, pad].abs().max().item() == 0.0 for e in ge)
    _, cl = record(model, graph, c.tokens, c.attention_mask)
    _, xl = record(model, graph, x.tokens, x.attention_mask)
    diff = pad_free(xl.minus(cl), c.attention_mask)
    assert diff[:, pad].abs().max().item() == 0.0 and diff[:, ~pad].abs().max().item() > 0.0


def test_bad_padded_inputs_are_refused_by_name():
    model = copy.deepcopy(tiny("llama")).double()
    clean, corrupt = _prompts(1), _prompts(2)
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    with pytest.raises(ValueError, match=r"one length: prompts 1 \(3 clean, 4 corrupt"):
        edge_attribution(model, clean, corrupt[:1] + [torch.arange(1, 5)] + corrupt[2:], metric)
    tokens, mask = _batch(clean, "left")
    holed = mask.clone()
    holed[0, -2] = 0
    with pytest.raises(ValueError, match=r"rows \[0\] have padding between real tokens"):
        edge_attribution(model, tokens, tokens, metric, attention_mask=holed)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        edge_attribution(model, tokens, tokens, metric, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="only 0 and 1"):
        edge_attribution(model, tokens, tokens, metric, attention_mask=mask * 2)
    with pytest.raises(ValueError, match="no real token"):
        edge_attribution(model, tokens, tokens, metric, attention_mask=mask * 0)
    with pytest.raises(ValueError, match="attention_mask goes with a token batch"):
        edge_attribution(model, clean, corrupt, metric, attention_mask=mask)
    with pytest.raises(ValueError, match=r"prompts \[1\] have no tokens"):
        edge_attribution(model, [clean[0], clean[0][:0]], [corrupt[0], corrupt[0][:0]], metric)
    with pytest.raises(ValueError, match="a prompt must be 1-D"):
        edge_attribution(model, [tokens], [tokens], metric)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        edge_attribution(model, [torch.tensor([1, 999])], [torch.tensor([1, 2])], metric)
    with pytest.raises(ValueError, match="last 4 positions .* only 3 tokens"):
        edge_attribution(model, clean, corrupt, AnswerDiff([3] * 4, [7] * 4, pos=-4))
    with pytest.raises(ValueError, match=r"AnswerDiff\(pos=2\) counts from the start"):
        verify_edges = edge_attribution(model, [clean[0]], [corrupt[0]], AnswerDiff([3], [7])).top(3)
        circuit_metric(model, verify_edges, clean, corrupt, AnswerDiff([3] * 4, [7] * 4, pos=2))
    with pytest.raises(ValueError, match="no tokenizer"):
        edge_attribution(model, ["ab", "c"], ["ba", "d"], metric)
    with pytest.raises(TypeError, match="mixes strings"):
        edge_attribution(model, ["ab", torch.tensor([1, 2])], ["ba", torch.tensor([2, 1])], metric)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_scores_and_verifies_a_padded_batch_as_its_prompts_alone(family):
    """Every family's attention_mask path under the circuit runs (a mixer that zeroes its padded rows, a
    renormalised stream, experts, side blocks): EAP and one patched run, two prompts of lengths 5 and 3."""
    model = copy.deepcopy(tiny(family)).double()
    clean, corrupt = _prompts(5, (5, 3)), _prompts(6, (5, 3))
    metric = AnswerDiff(torch.tensor([3, 4]), torch.tensor([7, 8]))
    batch = edge_attribution(model, clean, corrupt, metric)
    alone = [edge_attribution(model, [c], [x], _one(metric, k)) for k, (c, x) in enumerate(zip(clean, corrupt))]
    assert _rel(batch.scores, _mean([a.scores for a in alone])) < TOL
    edges = batch.top(len(batch) // 4)
    got = circuit_metric(model, edges, clean, corrupt, metric)["circuit"]
    want = _mean([circuit_metric(model, edges, [c], [x], _one(metric, k))["circuit"]
                  for k, (c, x) in enumerate(zip(clean, corrupt))])
    assert abs(got - want) < TOL


def test_node_scores_and_node_verification_take_padded_prompts():
    from analysis.circuits.nodes import node_attribution, verify_nodes

    model = copy.deepcopy(tiny("mamba2")).double()
    clean, corrupt = _prompts(1), _prompts(2)
    metric = AnswerDiff(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
    batch = node_attribution(model, clean, corrupt, metric)
    alone = [node_attribution(model, [c], [x], _one(metric, k)) for k, (c, x) in enumerate(zip(clean, corrupt))]
    assert _rel(batch.scores, _mean([a.scores for a in alone])) < TOL
    nodes = [name for name, _ in batch.top(4)]
    got = verify_nodes(model, nodes, clean, corrupt, metric)["circuit"]
    want = _mean([verify_nodes(model, nodes, [c], [x], _one(metric, k))["circuit"]
                  for k, (c, x) in enumerate(zip(clean, corrupt))])
    assert abs(got - want) < TOL
    assert edge_attribution(model, clean, corrupt, metric).settings["lengths"] == list(LENGTHS)
