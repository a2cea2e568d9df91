"""A gated attention head's write (Qwen3-Next, Qwen3.5 dense and MoE: z . sigmoid(gate) . W_O) is asked
from the mixer everywhere: in a bare cache and in circuits.

From a bare `run_with_cache()` (no hook_result cached): the heads of a layer sum to its hook_attn_out
and the full decomposition to the final residual (float32 1e-6, float64 1e-12). In float64: EAP's
scores of a head's edges, summed over its receivers, equal grad x diff taken by hand at the head's own
write (hook_result, 1e-10 relative); `edge_effects` of a head -> logits edge equals adding the head's
corrupt-minus-clean write to the final residual by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits import edge_attribution, graph_of
from analysis.circuits.verify import edge_effects
from hooked.models.gated_attention import GatedAttention

GATED = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


def _gated_layers(model) -> list[int]:
    return [l for l, b in enumerate(model.blocks) if isinstance(getattr(b, "attn", None), GatedAttention)]


def _model(name, dtype):
    model = copy.deepcopy(tiny(name)).to(dtype)
    assert _gated_layers(model), name
    return model


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", GATED)
def test_bare_cache_head_stacks_sum_to_attn_out_and_the_decomposition_to_the_residual(name, dtype):
    model = _model(name, dtype)
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert not any(k.endswith("attn.hook_result") for k in cache.keys())  # the write is not cached: asked
    stack, labels = cache.stack_head_results(return_labels=True)
    for l in _gated_layers(model):
        rows = [i for i, s in enumerate(labels) if s.startswith(f"L{l}H")]
        assert len(rows) == model.blocks[l].attn.n_heads
        assert _rel(stack[rows].sum(0), cache[f"blocks.{l}.hook_attn_out"]) < TOL[dtype], (name, l)
    full = cache.get_full_resid_decomposition()
    assert _rel(full.sum(0), cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]) < TOL[dtype] * 10, name
    with torch.no_grad():
        _, lazy = model.run_with_cache(tokens, incl_lazy=True)
    stack_lazy = lazy.stack_head_results()
    assert _rel(stack, stack_lazy) < TOL[dtype]  # the same writes the forward builds with hook_result on


def _results(model, tokens, grad: bool = False):
    """Every gated layer's hook_result [batch pos n_heads d_model] of one run (with gradients kept)."""
    names = [f"blocks.{l}.attn.hook_result" for l in _gated_layers(model)]
    kept = {}

    def keep(x, hook):
        if grad:
            x.retain_grad()
        kept[hook.name] = x

    with model.hooks(fwd_hooks=[(n, keep) for n in names]):
        logits = model(tokens)
    return logits, kept


@pytest.fixture(scope="module", params=GATED)
def pair64(request):
    model = _model(request.param, torch.float64)
    gen = torch.Generator().manual_seed(2)
    clean = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    corrupt = torch.randint(1, model.cfg.d_vocab, (2, 6), generator=gen)
    return request.param, model, clean, corrupt


def test_eap_head_sender_scores_are_grad_times_diff_at_each_heads_own_write(pair64):
    name, model, clean, corrupt = pair64
    scores = edge_attribution(model, clean, corrupt, metric)
    graph = scores.graph
    logits, res_clean = _results(model, clean, grad=True)
    metric(logits).backward()
    with torch.no_grad():
        _, res_corrupt = _results(model, corrupt)
    senders = [graph.edge(i).sender for i in range(len(graph))]
    for key, r in res_clean.items():
        l = int(key.split(".")[1])
        by_hand = ((res_corrupt[key] - r.detach()) * r.grad).sum(dim=(0, 1, 3))  # [n_heads]
        eap = torch.stack([scores.scores[[i for i, s in enumerate(senders) if s == f"L{l}H{h}"]].sum()
                           for h in range(by_hand.shape[0])])
        assert _rel(eap, by_hand) < 1e-10, (name, l, eap.tolist(), by_hand.tolist())


def test_edge_effects_equal_patching_each_heads_write_by_hand(pair64):
    name, model, clean, corrupt = pair64
    with torch.no_grad():
        _, res_clean = _results(model, clean)
        _, res_corrupt = _results(model, corrupt)
        base = metric(model(clean))
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"  # what the logits receiver reads
    edges, by_hand = [], []
    for key in res_clean:
        l = int(key.split(".")[1])
        for h in range(res_clean[key].shape[2]):
            diff = res_corrupt[key][:, :, h] - res_clean[key][:, :, h]
            with torch.no_grad(), model.hooks(fwd_hooks=[(last, lambda x, hook, d=diff: x + d)]):
                by_hand.append(float(metric(model(clean)) - base))
            edges.append(f"L{l}H{h}->logits")
    effects = edge_effects(model, edges, clean, corrupt, metric)
    assert _rel(effects, torch.tensor(by_hand, dtype=effects.dtype)) < 1e-10, name
    assert graph_of(model).index(edges[0]) >= 0
