"""Ablation kinds (patch, zero, mean whole or per position) in verification and in the estimates, against
the same ablation done by hand with hooks on a tiny GPT-2 in float64.

By hand: each sender's activation is read off the model's own hooks (embed: blocks.0.hook_resid_pre; a head:
its attn.hook_result plus its share of the output bias; an MLP: hook_mlp_out), its baseline is zero, the
reference's mean over prompts and positions (or over prompts per position) or the corrupt run's, and
  - one edge s -> r ablated: the receiver's own input hook (hook_mlp_in, the last hook_resid_post, or one
    head's query recomputed from ln1 of the shifted stream) gets baseline_s - a_s added;
  - a circuit missing every edge out of some senders (and verify_nodes without those nodes): those
    senders' outputs set to their baselines at their hook points; the fully ablated run: the final
    residual set to the sum of the baselines (0, or the reference's mean final residual);
  - EAP: (baseline_s - a_s) . d metric / d (the receiver's input), the gradient taken at a leaf there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_families import FAMILIES, tiny

from analysis.circuits import (circuit_metric, edge_attribution, edge_effects, faithfulness_curve, verify_circuit,
                               verify_nodes)
from analysis.circuits.metrics import AnswerDiff

TOL = 1e-10
RIGHT = [3, 7, 11]
KINDS = [("patch", False), ("zero", False), ("mean", False), ("mean", True)]


@pytest.fixture(scope="module")
def gpt2():
    model = copy.deepcopy(tiny("gpt2")).double()
    gen = torch.Generator().manual_seed(5)
    clean, corrupt, reference = (torch.randint(1, 64, (n, 5), generator=gen) for n in (3, 3, 4))
    return model, clean, corrupt, reference


def metric(logits):
    return AnswerDiff(RIGHT)(logits)  # the log-probability of each prompt's answer: nonlinear in the logits


def senders_by_hand(model, tokens):
    """label -> activation [b p d] from the model's hooks (a head: its result plus 1/n of the output bias)."""
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.{h}" for l in range(2)
                                           for h in ("attn.hook_result", "hook_attn_out", "hook_mlp_out")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    acts = {"embed": cache["blocks.0.hook_resid_pre"]}
    for l in range(2):
        result, out = cache[f"blocks.{l}.attn.hook_result"], cache[f"blocks.{l}.hook_attn_out"]
        for h in range(2):
            acts[f"L{l}H{h}"] = result[:, :, h] + (out - result.sum(2)) / 2
        acts[f"mlp{l}"] = cache[f"blocks.{l}.hook_mlp_out"]
    return acts


def baselines_by_hand(model, clean, corrupt, reference, kind, per_position):
    if kind == "patch":
        return senders_by_hand(model, corrupt)
    if kind == "zero":
        return {k: torch.zeros_like(v) for k, v in senders_by_hand(model, clean).items()}
    dims = (0,) if per_position else (0, 1)
    return {k: v.mean(dims, keepdim=True) for k, v in senders_by_hand(model, reference).items()}


def args(kind, corrupt, reference, per_position):
    return dict(corrupt=corrupt if kind == "patch" else None, intervention=kind,
                reference=reference if kind == "mean" else None, per_position=per_position)


def logits_with(model, tokens, hooks):
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model(tokens)


def receiver_hook(model, receiver, delta, resid_pre):
    """The hook that adds `delta` to what `receiver` alone reads (logits, mlp1 or L1H0.q)."""
    if receiver == "logits":
        return ("blocks.1.hook_resid_post", lambda x, hook: x + delta)
    if receiver == "mlp1":
        return ("blocks.1.hook_mlp_in", lambda x, hook: x + delta)
    assert receiver == "L1H0.q"
    ln = model.blocks[1].ln1
    q = F.layer_norm(resid_pre + delta, (16,), ln.weight, ln.bias, 1e-5) @ model.W_Q[1, 0] + model.b_Q[1, 0]

    def set_q(x, hook):
        x = x.clone()
        x[:, :, 0] = q
        return x

    return ("blocks.1.attn.hook_q", set_q)


EDGES = [("mlp0", "mlp1"), ("embed", "logits"), ("L0H1", "mlp1"), ("L0H0", "L1H0.q"), ("L1H1", "logits")]


@pytest.mark.parametrize("kind,per_position", KINDS)
def test_single_edge_effects_equal_the_ablation_by_hand(gpt2, kind, per_position):
    model, clean, corrupt, reference = gpt2
    clean_acts = senders_by_hand(model, clean)
    base = baselines_by_hand(model, clean, corrupt, reference, kind, per_position)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=["blocks.1.hook_resid_pre"])
    clean_value = metric(logits_with(model, clean, []))
    by_hand = []
    for s, r in EDGES:
        delta = base[s] - clean_acts[s]
        by_hand.append(metric(logits_with(model, clean, [receiver_hook(model, r, delta, cache["blocks.1.hook_resid_pre"])]))
                       - clean_value)
    ours = edge_effects(model, [f"{s}->{r}" for s, r in EDGES], clean, metric=metric,
                        **args(kind, corrupt, reference, per_position))
    torch.testing.assert_close(ours, torch.stack(by_hand).double(), rtol=0, atol=TOL)
    assert ours.abs().min() > 1e-6  # every edge does something


def whole_circuit_hooks(base):
    """mlp0's and L1H0's outputs set to their baselines (L1H0's write read off this very run)."""
    seen = {}

    def keep(x, hook):
        seen["result"] = x

    def head(x, hook):
        result = seen["result"]
        a = result[:, :, 0] + (x - result.sum(2)) / 2
        return x - a + base["L1H0"]

    return [("blocks.0.hook_mlp_out", lambda x, hook: base["mlp0"].expand_as(x)),
            ("blocks.1.attn.hook_result", keep), ("blocks.1.hook_attn_out", head)]


@pytest.mark.parametrize("kind,per_position", KINDS)
def test_a_circuit_and_the_fully_ablated_run_equal_the_ablation_by_hand(gpt2, kind, per_position):
    model, clean, corrupt, reference = gpt2
    base = baselines_by_hand(model, clean, corrupt, reference, kind, per_position)
    from analysis.circuits import graph_of

    graph = graph_of(model)
    circuit = [e for e in graph.edges() if e.sender not in ("mlp0", "L1H0")]
    kw = args(kind, corrupt, reference, per_position)
    got = circuit_metric(model, circuit, clean, metric=metric, **kw)
    hand = float(metric(logits_with(model, clean, whole_circuit_hooks(base))))
    assert abs(got["circuit"] - hand) < TOL
    kept = [s for s in graph.senders if s not in ("mlp0", "L1H0")]  # the same circuit as nodes
    assert abs(verify_nodes(model, kept, clean, metric=metric, **kw)["circuit"] - hand) < TOL
    # fully ablated: the logits read the sum of every sender's baseline
    if kind == "patch":
        final = senders_by_hand(model, corrupt)
        total = sum(final.values())
    else:
        total = sum(base.values())
    ablated = float(metric(logits_with(model, clean, [("blocks.1.hook_resid_post",
                                                        lambda x, hook: total.expand_as(x).clone())])))
    assert abs(got["corrupt"] - ablated) < TOL
    if kind == "zero":  # ln_final(0) = its bias
        with torch.no_grad():
            assert abs(ablated - float(metric(model.unembed(model.ln_final.bias.expand(3, 5, 16))))) < TOL
    if kind == "mean":  # the reference's mean final residual, read off the hook directly
        with torch.no_grad():
            _, cache = model.run_with_cache(reference, names_filter=["blocks.1.hook_resid_post"])
        mean = cache["blocks.1.hook_resid_post"].mean((0,) if per_position else (0, 1), keepdim=True)
        torch.testing.assert_close(total.expand(1, 5, 16), mean.expand(1, 5, 16), rtol=0, atol=1e-12)
    faith = (hand - ablated) / (got["clean"] - ablated)
    assert abs(verify_circuit(model, circuit, clean, metric=metric, **kw) - faith) < 1e-9
    curve = faithfulness_curve(model, edge_attribution(model, clean, metric=metric, **kw), clean, metric=metric,
                               sizes=[0, len(graph)], **kw)
    assert abs(curve[0]["faithfulness"]) < 1e-9 and abs(curve[1]["faithfulness"] - 1) < 1e-9


def grad_at(model, tokens, name, hooks=()):
    """d metric / d (the activation at hook `name`), taken at a leaf there."""
    box = {}

    def leaf(x, hook):
        box["x"] = x.detach().requires_grad_(True)
        return box["x"]

    with torch.enable_grad(), model.hooks(fwd_hooks=list(hooks) + [(name, leaf)]):
        (g,) = torch.autograd.grad(metric(model(tokens)), box["x"])
    return g


RECEIVER_INPUT = {"logits": "blocks.1.hook_resid_post", "mlp1": "blocks.1.hook_mlp_in"}


@pytest.mark.parametrize("kind,per_position", KINDS)
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_estimates_use_the_same_baseline(gpt2, kind, per_position, method):
    """EAP: diff = baseline - clean times the clean gradient; EAP-IG (steps=2, left: alpha 0 and 1/2) the
    gradient with hook_embed at the baseline's token embedding + alpha (clean - baseline's)."""
    model, clean, corrupt, reference = gpt2
    clean_acts = senders_by_hand(model, clean)
    base = baselines_by_hand(model, clean, corrupt, reference, kind, per_position)
    scores = edge_attribution(model, clean, metric=metric, method=method, steps=2, steps_at="left",
                              **args(kind, corrupt, reference, per_position))
    assert scores.settings["intervention"] == kind
    with torch.no_grad():
        emb = {"patch": lambda: model.run_with_cache(corrupt, names_filter=["hook_embed"])[1]["hook_embed"],
               "zero": lambda: torch.zeros(1, 1, 16, dtype=torch.float64),
               "mean": lambda: model.run_with_cache(reference, names_filter=["hook_embed"])[1]["hook_embed"].mean(
                   (0,) if per_position else (0, 1), keepdim=True)}[kind]()
    for r, name in RECEIVER_INPUT.items():
        if method == "eap":
            g = grad_at(model, clean, name)
        else:
            g = sum(grad_at(model, clean, name, [("hook_embed", lambda x, hook, a=a: emb + a * (x - emb))])
                    for a in (0.0, 0.5)) / 2
        for s in ("embed", "L0H0", "L0H1", "mlp0", "L1H0", "L1H1", "mlp1"):
            if r == "mlp1" and s == "mlp1":
                continue
            hand = float(((base[s] - clean_acts[s]) * g).sum())
            assert abs(scores[(s, r)] - hand) < TOL * max(1.0, abs(hand)), (s, r)


def test_bad_ablation_arguments_are_refused_by_name(gpt2):
    model, clean, corrupt, reference = gpt2
    cases = [
        (dict(corrupt=None, intervention="mean"), "reference"),
        (dict(corrupt=corrupt, intervention="zero"), "corrupt"),
        (dict(corrupt=None, intervention="patch"), "corrupt"),
        (dict(corrupt=corrupt, reference=reference), "reference"),
        (dict(corrupt=None, intervention="zero", per_position=True), "per_position"),
        (dict(corrupt=None, intervention="mean", reference=reference[:, :3], per_position=True), "per_position"),
        (dict(corrupt=None, intervention="ablate"), "intervention"),
    ]
    for kw, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            edge_attribution(model, clean, metric=metric, **kw)
    with pytest.raises(ValueError, match="intervention"):
        verify_circuit(model, ["mlp0->mlp1"], clean, None, metric, intervention="none")
    with pytest.raises(ValueError, match="clean-corrupted"):
        edge_attribution(model, clean, None, metric, method="clean-corrupted", intervention="zero")
    # a whole mean serves clean prompts of another length
    short = edge_attribution(model, clean[:, :3], None, metric, intervention="mean", reference=reference)
    assert short.settings == {"method": "eap", "intervention": "mean", "per_position": False}


# ---- every family: the baselines and the activation integral hold where the graph has experts, side blocks, SSMs
# (zero: the embedding's and side blocks' slots at zero; mean: the reference recorded and averaged per group)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(2)
    clean, corrupt, reference = (torch.randint(1, model.cfg.d_vocab, (2, 5), generator=gen) for _ in range(3))
    return request.param, model, clean, corrupt, reference


def last_logit(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].log_softmax(-1).mean()


def test_eap_with_a_baseline_is_the_derivative_of_the_scaled_ablation(family, kind="zero", per_position=False):
    """score(e) = d/d alpha metric(edge e carries clean + alpha (baseline - clean)), by central differences
    on 12 edges, with the baseline's activations as the patched runs' source."""
    from analysis.circuits import graph_of
    from analysis.circuits.baselines import prepare
    from analysis.circuits.runs import patched

    name, model, clean, corrupt, reference = family
    scores = edge_attribution(model, clean, None, last_logit, intervention=kind,
                              reference=reference if kind == "mean" else None, per_position=per_position)
    graph = graph_of(model)
    prompts, baseline = prepare(model, graph, clean, None, kind, reference if kind == "mean" else None, per_position,
                                None)
    _, acts = baseline.activations(model, slice(None), prompts)
    k = min(12, len(graph))
    picked = torch.randperm(len(graph), generator=torch.Generator().manual_seed(1))[:k]
    coef = torch.zeros(2 * k, len(graph), dtype=torch.float64)
    coef[torch.arange(k), picked], coef[k + torch.arange(k), picked] = 1e-4, -1e-4
    logits = patched(model, graph, clean, acts, coef)
    values = torch.stack([last_logit(logits[2 * i:2 * i + 2]) for i in range(2 * k)])
    fd = (values[:k] - values[k:]) / 2e-4
    assert (scores.scores[picked] - fd).abs().max() <= 1e-4 * max(fd.abs().max().item(), 1e-8), name


def test_activation_ig_at_the_clean_end_is_eap(family, kind="mean"):
    """One step at alpha = 1 (steps_at="right") leaves every sender group clean: the clean gradient, EAP."""
    name, model, clean, corrupt, reference = family
    kw = dict(corrupt=corrupt if kind == "patch" else None, intervention=kind,
              reference=reference if kind == "mean" else None)
    eap = edge_attribution(model, clean, metric=last_logit, **kw)
    ig = edge_attribution(model, clean, metric=last_logit, method="eap-ig-activations", steps=1, steps_at="right", **kw)
    torch.testing.assert_close(ig.scores, eap.scores, rtol=1e-9, atol=1e-12 * eap.scores.abs().max().item())
    assert abs(ig.corrupt_metric - eap.corrupt_metric) < 1e-12, name


@pytest.mark.parametrize("kind,method", [("zero", "eap"), ("mean", "eap-ig-activations"), ("mean", "eap-ig")])
def test_prompts_of_different_lengths_equal_the_per_prompt_runs(gpt2, kind, method):
    """Padded (prompts.py) with a zero or mean baseline: scores, the ablated metric and a circuit's metric equal
    the per-prompt runs averaged (the metric is a mean over prompts); the reference is padded too."""
    model, _, _, _ = gpt2
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 64, (n,), generator=gen) for n in (4, 6, 5)]
    reference = [torch.randint(1, 64, (n,), generator=gen) for n in (3, 5)]
    last = lambda logits: logits[:, -1, 3].mean() - logits[:, -1].logsumexp(-1).mean()  # noqa: E731
    kw = dict(intervention=kind, reference=reference if kind == "mean" else None)
    padded = edge_attribution(model, prompts, None, last, method=method, steps=2, **kw)
    alone = [edge_attribution(model, [p], None, last, method=method, steps=2, **kw) for p in prompts]
    torch.testing.assert_close(padded.scores, sum(a.scores for a in alone) / 3, rtol=0, atol=1e-10)
    assert abs(padded.corrupt_metric - sum(a.corrupt_metric for a in alone) / 3) < 1e-10
    edges = padded.top(8)
    got = circuit_metric(model, edges, prompts, None, last, **kw)
    each = [circuit_metric(model, edges, [p], None, last, **kw) for p in prompts]
    for key in ("circuit", "clean", "corrupt"):
        assert abs(got[key] - sum(e[key] for e in each) / 3) < 1e-10, key
