"""EAP-IG's step placement (steps_at), the EAP-IG-activations and clean-corrupted variants, and metrics that
read the clean logits (KL), against hand computations on a tiny GPT-2 in float64 (1e-10).

By hand: score(s -> r) = (baseline_s - clean_s) . g_r, g_r the gradient of the metric at a leaf on the
receiver's input hook (logits: the last hook_resid_post; mlp1: blocks.1.hook_mlp_in), averaged over
  - eap-ig: runs with hook_embed = e_base + alpha (e_clean - e_base), alpha = k/steps (left), (k+1)/steps
    (right) or (k+1/2)/steps (mid);
  - eap-ig-activations: runs where the sender's sublayer writes clean + (1 - alpha)(baseline - clean) at its
    output hook (embed: blocks.0.hook_resid_pre; heads: hook_attn_out, the layer's heads at once; hook_mlp_out);
  - clean-corrupted: the clean run and the corrupt run.
KL(clean || run) reads the clean run's logits, taken from a separate clean forward here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import circuit_metric, edge_attribution
from analysis.circuits.metrics import KL, AnswerDiff, reads_clean, with_clean

TOL = 1e-10
SENDERS = ("embed", "L0H0", "L0H1", "mlp0", "L1H0", "L1H1", "mlp1")
GROUP_HOOK = {"embed": "blocks.0.hook_resid_pre", "L0H0": "blocks.0.hook_attn_out", "L0H1": "blocks.0.hook_attn_out",
              "mlp0": "blocks.0.hook_mlp_out", "L1H0": "blocks.1.hook_attn_out", "L1H1": "blocks.1.hook_attn_out",
              "mlp1": "blocks.1.hook_mlp_out"}
GROUP = {"embed": ["embed"], "mlp0": ["mlp0"], "mlp1": ["mlp1"], "L0H0": ["L0H0", "L0H1"], "L0H1": ["L0H0", "L0H1"],
         "L1H0": ["L1H0", "L1H1"], "L1H1": ["L1H0", "L1H1"]}
RECEIVER_INPUT = {"logits": "blocks.1.hook_resid_post", "mlp1": "blocks.1.hook_mlp_in"}


@pytest.fixture(scope="module")
def gpt2():
    model = copy.deepcopy(tiny("gpt2")).double()
    gen = torch.Generator().manual_seed(7)
    clean, corrupt = (torch.randint(1, 64, (3, 5), generator=gen) for _ in range(2))
    return model, clean, corrupt


def answer(logits):
    return AnswerDiff([3, 7, 11])(logits)


METRICS = {"answer": answer, "kl": KL()}


def senders_by_hand(model, tokens):
    names = ["hook_embed", "blocks.0.hook_resid_pre"] + [f"blocks.{l}.{h}" for l in range(2)
                                                         for h in ("attn.hook_result", "hook_attn_out", "hook_mlp_out")]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=names)
    acts = {"embed": cache["blocks.0.hook_resid_pre"], "hook_embed": cache["hook_embed"]}
    for l in range(2):
        result, out = cache[f"blocks.{l}.attn.hook_result"], cache[f"blocks.{l}.hook_attn_out"]
        for h in range(2):
            acts[f"L{l}H{h}"] = result[:, :, h] + (out - result.sum(2)) / 2
        acts[f"mlp{l}"] = cache[f"blocks.{l}.hook_mlp_out"]
    return logits, acts


def grad_at(model, tokens, name, metric, clean_logits, hooks=()):
    box = {}

    def leaf(x, hook):
        box["x"] = x.detach().requires_grad_(True)
        return box["x"]

    with torch.enable_grad(), model.hooks(fwd_hooks=list(hooks) + [(name, leaf)]):
        logits = model(tokens)
        value = metric(logits, clean_logits) if reads_clean(metric) else metric(logits)
        (g,) = torch.autograd.grad(value, box["x"])
    return g


def check(scores, diff, grad_of):
    """scores[(s, r)] == diff[s] . grad_of(s, r) for every sender into logits and mlp1."""
    for r in RECEIVER_INPUT:
        for s in SENDERS:
            if r == "mlp1" and s == "mlp1":
                continue
            hand = float((diff[s] * grad_of(s, r)).sum())
            assert abs(scores[(s, r)] - hand) < TOL * max(1.0, abs(hand)), (s, r, scores[(s, r)], hand)


@pytest.mark.parametrize("steps_at,shift", [("left", 0.0), ("right", 1.0), ("mid", 0.5)])
def test_eap_ig_steps_sit_where_steps_at_says(gpt2, steps_at, shift):
    """left: alpha = k/steps from the corrupt end (hannamw/EAP-IG's EAP-IG-inputs), a left Riemann sum."""
    model, clean, corrupt = gpt2
    steps = 3
    cl_logits, cl = senders_by_hand(model, clean)
    _, co = senders_by_hand(model, corrupt)
    e = co["hook_embed"]
    scores = edge_attribution(model, clean, corrupt, answer, method="eap-ig", steps=steps, steps_at=steps_at)
    assert scores.settings == {"method": "eap-ig", "intervention": "patch", "steps": 3, "steps_at": steps_at}
    grads = {r: sum(grad_at(model, clean, name, answer, None,
                            [("hook_embed", lambda x, hook, a=(k + shift) / steps: e + a * (x - e))])
                    for k in range(steps)) / steps for r, name in RECEIVER_INPUT.items()}
    check(scores, {s: co[s] - cl[s] for s in SENDERS}, lambda s, r: grads[r])


@pytest.mark.parametrize("metric_name", ["answer", "kl"])
@pytest.mark.parametrize("intervention,steps_at", [("patch", "right"), ("zero", "mid")])
def test_eap_ig_activations_equal_the_hand_integral(gpt2, metric_name, intervention, steps_at):
    model, clean, corrupt = gpt2
    metric, steps = METRICS[metric_name], 2
    shift = {"right": 1.0, "mid": 0.5}[steps_at]
    cl_logits, cl = senders_by_hand(model, clean)
    base = senders_by_hand(model, corrupt)[1] if intervention == "patch" else {s: 0 * cl[s] for s in cl}
    scores = edge_attribution(model, clean, corrupt if intervention == "patch" else None, metric,
                              method="eap-ig-activations", steps=steps, steps_at=steps_at, intervention=intervention)
    assert scores.settings["steps_at"] == steps_at and scores.method == "eap-ig-activations"
    diff = {s: base[s] - cl[s] for s in SENDERS}
    cache = {}

    def grad_of(s, r):
        key = (GROUP_HOOK[s], r)
        if key not in cache:
            shift_total = sum(diff[u] for u in GROUP[s])
            clean_out = sum(cl[u] for u in GROUP[s])
            total = 0
            for k in range(steps):
                beta = 1 - (k + shift) / steps
                hook = (GROUP_HOOK[s], lambda x, hook, b=beta: (clean_out + b * shift_total).clone())
                total = total + grad_at(model, clean, RECEIVER_INPUT[r], metric, cl_logits, [hook])
            cache[key] = total / steps
        return cache[key]

    check(scores, diff, grad_of)
    if metric_name == "kl":
        assert scores.clean_metric == 0.0


@pytest.mark.parametrize("metric_name", ["answer", "kl"])
def test_clean_corrupted_averages_the_two_ends(gpt2, metric_name):
    model, clean, corrupt = gpt2
    metric = METRICS[metric_name]
    cl_logits, cl = senders_by_hand(model, clean)
    co_logits, co = senders_by_hand(model, corrupt)
    scores = edge_attribution(model, clean, corrupt, metric, method="clean-corrupted")
    grads = {r: (grad_at(model, clean, name, metric, cl_logits) + grad_at(model, corrupt, name, metric, cl_logits)) / 2
             for r, name in RECEIVER_INPUT.items()}
    check(scores, {s: co[s] - cl[s] for s in SENDERS}, lambda s, r: grads[r])
    with torch.no_grad():
        expect = float(metric(co_logits, cl_logits)) if metric_name == "kl" else float(metric(co_logits))
    assert abs(scores.corrupt_metric - expect) < TOL


def test_kl_reads_the_clean_logits_in_eap_eap_ig_and_verification(gpt2):
    model, clean, corrupt = gpt2
    cl_logits, cl = senders_by_hand(model, clean)
    co_logits, co = senders_by_hand(model, corrupt)
    kl = KL()
    eap = edge_attribution(model, clean, corrupt, kl)
    assert eap.scores.abs().max() < 1e-12  # KL's gradient vanishes at the clean run: its own logits are the clean ones
    assert eap.clean_metric == 0.0 and abs(eap.corrupt_metric - float(kl(co_logits, cl_logits))) < TOL
    ig = edge_attribution(model, clean, corrupt, kl, method="eap-ig", steps=2)
    e = co["hook_embed"]
    grads = {r: sum(grad_at(model, clean, name, kl, cl_logits,
                            [("hook_embed", lambda x, hook, a=a: e + a * (x - e))]) for a in (0.25, 0.75)) / 2
             for r, name in RECEIVER_INPUT.items()}
    check(ig, {s: co[s] - cl[s] for s in SENDERS}, lambda s, r: grads[r])
    # verification: the circuit without mlp0 -> logits, zero-ablated, by hand
    got = circuit_metric(model, [e for e in ig.graph.edges() if str(e) != "mlp0->logits"], clean, None, kl,
                         intervention="zero")
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: x - cl["mlp0"])]):
        hand = float(kl(model(clean), cl_logits))
    assert got["clean"] == 0.0 and abs(got["circuit"] - hand) < TOL and hand > 1e-6


def test_the_arity_rule():
    assert reads_clean(KL()) and not reads_clean(answer)
    assert reads_clean(lambda logits, clean_logits: (logits - clean_logits).sum())
    assert not reads_clean(lambda logits, clean_logits=None: logits.sum())  # a default: not read

    class Flagged:
        reads_clean = False

        def __call__(self, logits, other):
            return logits.sum()

    assert not reads_clean(Flagged())  # the attribute wins over the signature
    with pytest.raises(TypeError, match="3 arguments"):
        reads_clean(lambda a, b, c: a)
    bound = with_clean(KL(pos=-2), torch.zeros(2, 4, 5))
    assert bound.tail == 2 and float(bound(torch.zeros(2, 4, 5))) == 0.0
    with pytest.raises(ValueError, match="pos"):
        KL(pos=7)(torch.zeros(1, 3, 5), torch.zeros(1, 3, 5))


def test_variants_refuse_what_they_cannot_do(gpt2):
    model, clean, corrupt = gpt2
    with pytest.raises(ValueError, match="steps_at"):
        edge_attribution(model, clean, corrupt, answer, method="eap-ig", steps_at="trapezoid")
    with pytest.raises(ValueError, match="token_edges"):
        edge_attribution(model, clean, corrupt, answer, method="clean-corrupted", token_edges=True)
    with pytest.raises(ValueError, match="method"):
        edge_attribution(model, clean, corrupt, answer, method="eap-ig-inputs")


def test_kl_in_token_edges_and_path_patching(gpt2):
    """Token edges: estimated by EAP-IG with KL, cut exactly by verify_token_edges reading the uncut logits;
    path patching reads the base run's logits."""
    from analysis.circuits import path_patch, verify_token_edges

    model, clean, corrupt = gpt2
    kl = KL()
    scores = edge_attribution(model, clean, corrupt, kl, method="eap-ig", steps=2, token_edges=True)
    edges = scores.token.top(2)
    out = verify_token_edges(model, clean, edges, kl)
    assert out["clean"] == 0.0 and out["exact"] > 0  # KL >= 0, > 0 once something is cut
    base, cl = senders_by_hand(model, clean)
    delta = senders_by_hand(model, corrupt)[1]["mlp0"] - cl["mlp0"]
    with torch.no_grad():
        with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: x + delta)]):
            hand = float(kl(model(clean), base))
    assert abs(path_patch(model, clean, corrupt, kl, ["mlp0"], ["logits"]) - hand) < TOL


@pytest.mark.parametrize("method,intervention", [("eap", "mean"), ("eap-ig", "zero"), ("eap-ig-activations", "mean"),
                                                 ("clean-corrupted", "patch")])
def test_chunks_of_prompts_add_up(gpt2, method, intervention):
    """batch_size=1 (the reference's means and the scores taken a prompt at a time, weighted by their share)
    equals the whole batch at once."""
    model, clean, corrupt = gpt2
    kw = dict(method=method, steps=2, intervention=intervention, corrupt=corrupt if intervention == "patch" else None,
              reference=corrupt if intervention == "mean" else None)
    metric = AnswerDiff([3, 7, 11])  # its rows follow the chunks
    whole = edge_attribution(model, clean, metric=metric, **kw)
    parts = edge_attribution(model, clean, metric=metric, batch_size=1, **kw)
    torch.testing.assert_close(parts.scores, whole.scores, rtol=0, atol=1e-12)
    assert abs(parts.clean_metric - whole.clean_metric) < 1e-12
    assert abs(parts.corrupt_metric - whole.corrupt_metric) < 1e-12
    if intervention != "patch":  # verification too: the ablated replica per chunk
        ablate = {k: kw[k] for k in ("corrupt", "intervention", "reference")}
        one = circuit_metric(model, whole.top(6), clean, metric=metric, batch_size=1, **ablate)
        all_ = circuit_metric(model, whole.top(6), clean, metric=metric, **ablate)
        assert all(abs(one[k] - all_[k]) < 1e-12 for k in ("circuit", "clean", "corrupt"))
