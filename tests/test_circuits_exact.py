"""Edge attribution is exact to first order on every family; edge patching reproduces both runs.

For each family of tiny_families, in float64: the patched run with no edge patched is the clean run and
with every edge patched the corrupt run; EAP's score of every edge equals the central finite difference
of a scaled edge patch (the receiver reads x + alpha (a_s^corrupt - a_s^clean)) within 1e-4 relative;
EAP-IG with one step at alpha = 1/2 equals the midpoint gradient, and its scores approach the exact
per-edge effect better than EAP's as steps grow on a nonlinear metric (checked on one family). Token
edges: every SSM kernel entry's score equals the finite difference of a scaled kernel-entry cut, every
attention entry's the finite difference of a scaled pattern cut; the per-unit knockout cuts only its unit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES, tiny

from analysis.circuits import cut_token_edges, edge_attribution, graph_of
from analysis.circuits.runs import patched, record
from analysis.circuits.token_edges import TokenEdge, kernel_io

EPS = 1e-4


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    gen = torch.Generator().manual_seed(2)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    return request.param, model, clean, corrupt


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def test_patching_nothing_is_clean_and_everything_is_corrupt(run):
    _, model, clean, corrupt = run
    graph = graph_of(model)
    _, src = record(model, graph, corrupt)
    coef = torch.stack([torch.zeros(len(graph)), torch.ones(len(graph))]).double()
    logits = patched(model, graph, clean, src, coef)
    with torch.no_grad():
        assert _rel(logits[:2], model(clean)) < 1e-12
        if any(block.stream_norms() for block in model.blocks):
            return  # MiniMax: the stream is renormalised at every step, so its receivers read no sum of senders
        assert _rel(logits[2:], model(corrupt)) < 1e-12


def test_running_sums_equal_the_plain_sum_over_senders(run, monkeypatch):
    """A mixed patch (most edges on, some off, some scaled) through the running sum minus off-one terms
    equals every receiver's delta summed sender by sender."""
    from analysis.circuits.runs import Patcher

    _, model, clean, corrupt = run
    graph = graph_of(model)
    _, src = record(model, graph, corrupt)
    gen = torch.Generator().manual_seed(4)
    mostly_on = (torch.rand(len(graph), generator=gen) < 0.8).double()
    mostly_off = (torch.rand(len(graph), generator=gen) < 0.2).double() * 0.7
    coef = torch.stack([mostly_on, mostly_off, torch.where(mostly_on.bool(), 1.0, 0.3).double()])
    fast = patched(model, graph, clean, src, coef)
    monkeypatch.setattr(Patcher, "running_sums", False)
    plain = patched(model, graph, clean, src, coef)
    assert _rel(fast, plain) < 1e-10
    with torch.no_grad():
        assert _rel(fast[:2], model(clean)) > 1e-6  # the patch does something


def test_eap_equals_the_finite_difference_of_every_edge(run):
    name, model, clean, corrupt = run
    graph = graph_of(model)
    scores = edge_attribution(model, clean, corrupt, metric)
    assert len(scores) == len(graph) and scores.scores.abs().max() > 0
    _, src = record(model, graph, corrupt)
    n = len(graph)
    coef = torch.zeros(2 * n, n, dtype=torch.float64)
    coef[torch.arange(n), torch.arange(n)] = EPS
    coef[n + torch.arange(n), torch.arange(n)] = -EPS
    fd = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, 64):  # replicas of the batch, 64 edges at a time
        stop = min(start + 64, n)
        rows = torch.cat([coef[start:stop], coef[n + start:n + stop]])
        k = rows.shape[0] // 2
        logits = patched(model, graph, clean, src, rows)
        up = torch.stack([metric(logits[2 * i:2 * i + 2]) for i in range(k)])
        down = torch.stack([metric(logits[2 * (k + i):2 * (k + i) + 2]) for i in range(k)])
        fd[start:start + k] = (up - down) / (2 * EPS)
    assert _rel(scores.scores, fd) < 1e-4, name


def test_eap_ig_with_one_step_is_the_midpoint_gradient(run):
    name, model, clean, corrupt = run
    if name not in ("llama", "mamba2", "zamba2"):
        pytest.skip("one attention, one SSM, one side-block family")
    graph = graph_of(model)
    ig = edge_attribution(model, clean, corrupt, metric, method="eap-ig", steps=1)
    _, src = record(model, graph, corrupt)
    _, cl = record(model, graph, clean)
    # the same scores by hand: clean tokens whose embedding is halfway to the corrupt one
    from analysis.circuits.eap import _edge_scores
    from analysis.circuits.runs import gradients

    half = lambda x: src.emb[0] + 0.5 * (x - src.emb[0])  # noqa: E731
    _, _, grads = gradients(model, graph, clean, metric, embed=half)
    by_hand = _edge_scores(graph, src.minus(cl), src.emb - cl.emb, grads)
    assert _rel(ig.scores, by_hand) < 1e-12


def _ssm_fd(model, clean, unit_mixer, h, j, i, kernel, u):
    """Central difference of y_j -= alpha K[h, j, i] u_i on one unit (the scaled kernel-entry cut)."""
    out = []
    for alpha in (EPS, -EPS):
        def fn(y, hook, alpha=alpha):
            y = y.clone()
            k = kernel[:, h, j, i].to(y)
            y[:, j, h] -= alpha * k.reshape(k.shape + (1,) * (y.ndim - 3)) * u[:, i, h].to(y)
            return y

        with torch.no_grad(), model.hooks(fwd_hooks=[(kernel_io(unit_mixer)[1].name, fn)]):
            out.append(metric(model(clean)))
    return float((out[0] - out[1]) / (2 * EPS))


@pytest.mark.parametrize("mode", ["pattern", "scores"])
def test_token_edge_scores_equal_scaled_cuts(run, mode):
    """SSM: d/d alpha of y_j -= alpha K_ji u_i. Attention: d/d alpha of pattern + alpha dA, dA the cut's exact
    change of the pattern row (the entry zeroed; with "scores" the rest of its row renormalised)."""
    name, model, clean, corrupt = run
    scores = edge_attribution(model, clean, corrupt, metric, token_edges=True, attention=mode).token
    assert len(scores) > 0
    checked = 0
    for site_name, (labels, s) in scores.sites.items():
        m = model.get_submodule(site_name)
        h = int(s.abs().sum((1, 2)).argmax())
        j, i = divmod(int(s[h].abs().argmax()), s.shape[-1])
        if m.heads().kind == "attn":
            with torch.no_grad():
                _, cache = model.run_with_cache(clean, names_filter=[m.hook_pattern.name])
            A = cache[m.hook_pattern.name][:, h, j]  # [batch k]
            dA = torch.zeros_like(A)
            dA[:, i] = -A[:, i]
            if mode == "scores":
                rest = A.clone()
                rest[:, i] = 0
                only = A[:, i] >= 1  # the row's only visible key: cut, the row writes nothing (rest is 0)
                dA += rest * torch.where(only, 0.0, A[:, i] / (1 - A[:, i]).masked_fill(only, 1.0))[:, None]
            vals = []
            for alpha in (EPS, -EPS):
                def fn(p, hook, alpha=alpha):
                    p = p.clone()
                    p[:, h, j] += alpha * dA
                    return p
                with torch.no_grad(), model.hooks(fwd_hooks=[(m.hook_pattern.name, fn)]):
                    vals.append(metric(model(clean)))
            fd = float((vals[0] - vals[1]) / (2 * EPS))
        else:
            with torch.no_grad():
                u, _ = kernel_io(m)
                _, cache = model.run_with_cache(clean, names_filter=[m.hook_kernel.name, u.name])
            fd = _ssm_fd(model, clean, m, h, j, i, cache[m.hook_kernel.name], cache[u.name])
        est = float(s[h, j, i])
        assert abs(est - fd) <= 1e-4 * max(abs(fd), float(s.abs().max())), (name, site_name, est, fd)
        checked += 1
    assert checked == len(scores.sites)


def test_token_knockout_cuts_one_unit_only(run):
    name, model, clean, _ = run
    site = next((n, m) for n, m in model.named_modules() if hasattr(m, "heads") and callable(m.heads)
                and n.startswith("blocks."))
    mixer_name, m = site
    layer = int(mixer_name.split(".")[1])
    from analysis.circuits.token_edges import token_sites

    labels = next(s.labels() for s in token_sites(model) if s.path == mixer_name)
    # before any norm mixes the units (a short conv has no y: its gated output, one channel per unit)
    point = (m.hook_z if m.heads().kind == "attn" else getattr(m, "hook_y", m.heads().write_hook)).name
    with torch.no_grad():
        _, base = model.run_with_cache(clean, names_filter=[point])
        with cut_token_edges(model, [TokenEdge(labels[0], 5, 4)]):
            _, cut = model.run_with_cache(clean, names_filter=[point])
    n = m.heads().n
    before, after = base[point][:, 5].reshape(clean.shape[0], n, -1), cut[point][:, 5].reshape(clean.shape[0], n, -1)
    # beyond rounding: the cut layer runs the exact (eager) path, the plain one may run SDPA
    changed = (before - after).abs().amax((0, 2)) > 1e-12 * before.abs().max()
    assert changed[0] and not changed[1:].any(), (name, layer, changed)


def test_a_mixer_without_a_scorable_form_is_refused_by_name():
    from types import SimpleNamespace

    from analysis.circuits.token_edges import _check_scorable

    odd = SimpleNamespace(mixing=lambda: None)  # the mixer names no mixing matrix (protocol.TokenMixer.mixing)
    with pytest.raises(NotImplementedError, match="blocks.0.mixer .*token_edges=False"):
        _check_scorable("blocks.0.mixer", odd)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_receivers_pull_back_through_the_norm_in_closed_form_or_by_autograd_alike(family, monkeypatch):
    """The receivers' norm step: the closed form (`input_grads_`) on a plain pre-norm model, autograd when a
    hook listens on the norm; the scores agree, and the closed form is the path taken when nothing listens."""
    from analysis.circuits import receivers

    model = copy.deepcopy(tiny(family)).double()
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    calls = {"autograd": 0}
    vjp = receivers._vjp

    def counted(*args, **kwargs):
        calls["autograd"] += 1
        return vjp(*args, **kwargs)

    monkeypatch.setattr(receivers, "_vjp", counted)
    closed = edge_attribution(model, clean, corrupt, metric)
    assert calls["autograd"] == 0
    listen = [("blocks.0.ln1.hook_scale", lambda s, hook: s)]  # a hook that keeps the value: autograd through it
    with model.hooks(fwd_hooks=listen):
        by_autograd = edge_attribution(model, clean, corrupt, metric)
    assert calls["autograd"] > 0
    assert _rel(closed.scores, by_autograd.scores) < 1e-10


def test_a_metric_reading_the_last_positions_gets_only_their_logits_and_the_same_numbers(run):
    """AnswerDiff(pos=-1) says `tail = 1`: the runs unembed the last position only; EAP, EAP-IG, verification
    and the patched logits equal those of the same metric given every position's logits."""
    from analysis.circuits import verify_circuit
    from analysis.circuits.metrics import AnswerDiff
    from analysis.circuits.runs import forward_logits

    name, model, clean, corrupt = run
    seen, seen_tailed = [], []

    class Tailed(AnswerDiff):
        def __call__(self, logits):
            seen_tailed.append(logits.shape[1])
            return super().__call__(logits)

        def rows(self, part):
            return Tailed(self.right[part], self.wrong[part], self.pos)

    tailed = Tailed([3, 3], [5, 5])
    assert tailed.tail == 1 and AnswerDiff([3, 3], [5, 5], pos=2).tail is None

    plain = AnswerDiff([3, 3], [5, 5])

    def whole(logits):  # the same metric, without a tail: it is given every position
        seen.append(logits.shape[1])
        return plain(logits)

    for method in ("eap", "eap-ig"):
        a = edge_attribution(model, clean, corrupt, tailed, method=method, steps=2)
        b = edge_attribution(model, clean, corrupt, whole, method=method, steps=2)
        assert _rel(a.scores, b.scores) < 1e-10 and a.clean_metric == pytest.approx(b.clean_metric, abs=1e-12), name
    top = a.top(5)
    assert verify_circuit(model, top, clean, corrupt, tailed) == pytest.approx(
        verify_circuit(model, top, clean, corrupt, whole), abs=1e-10)
    assert set(seen) == {clean.shape[1]} and set(seen_tailed) == {1}, (seen, seen_tailed)
    second_last = AnswerDiff([3, 3], [5, 5], pos=-2)  # tail 2: it reads logits[:, -2] of the last two
    assert second_last.tail == 2
    a = edge_attribution(model, clean, corrupt, second_last)
    b = edge_attribution(model, clean, corrupt, lambda logits: AnswerDiff([3, 3], [5, 5], pos=-2)(logits))
    assert _rel(a.scores, b.scores) < 1e-10, name
    with torch.no_grad():
        full = model(clean)
        assert _rel(forward_logits(model, clean, None, 2), full[:, -2:]) < 1e-12
        assert forward_logits(model, clean, None, 99).shape == full.shape


def test_a_bad_tail_is_refused_by_name():
    from analysis.circuits.metrics import tail_of

    def m(logits):
        return logits.sum()

    m.tail = 0
    with pytest.raises(ValueError, match=r"metric\.tail=0: must be >= 1"):
        tail_of(m)
    m.tail = None
    assert tail_of(m) is None
