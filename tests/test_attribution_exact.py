"""Attribution maths is exact on every family (multipliers, post-norms, MoE, parallel branches included).

For each family of tiny_families, in float64: the full residual decomposition (every head / SSM unit,
every neuron or expert, embeddings, biases) sums to the residual it decomposes, at the final layer and
at an MLP's input; `decompose_resid` sums to it too; the logit attributions of the components sum to
the logits (before a final soft-cap); head labels are the ones `head_units` uses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES, tiny

from analysis.ga.ranking import head_units

TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, incl_lazy=True)
    return request.param, model, tokens, logits, cache


def test_full_decomposition_sums_to_the_final_residual(run) -> None:
    _, model, _, _, cache = run
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    assert len(labels) == stack.shape[0] and len(set(labels)) == len(labels)
    torch.testing.assert_close(stack.sum(0), cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], **TOL)


def test_decomposition_without_neurons_and_by_sublayer_sums_too(run) -> None:
    _, model, _, _, cache = run
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(cache.get_full_resid_decomposition(expand_neurons=False).sum(0), final, **TOL)
    torch.testing.assert_close(cache.decompose_resid().sum(0), final, **TOL)


def test_decomposition_at_an_mlp_input_sums_to_resid_mid(run) -> None:
    """... or to the block's input where the MLP is a parallel branch (GPT-NeoX), which is what it reads."""
    _, model, _, _, cache = run
    layers = [l for l, b in enumerate(model.blocks)
              if [w.kind for w in b.writers()][-1] == "mlp" and len(list(b.writers())) > 1]
    if not layers:
        pytest.skip("no block with an MLP after another sublayer")
    l = layers[-1]
    stack = cache.get_full_resid_decomposition(l, mlp_input=True)
    reads = cache[f"blocks.{l}.hook_resid_mid" if model.blocks[l].mlp_reads_mid else f"blocks.{l}.hook_resid_pre"]
    torch.testing.assert_close(stack.sum(0), reads, **TOL)
    torch.testing.assert_close(cache.decompose_resid(l, mlp_input=True).sum(0), reads, **TOL)


def test_logit_attributions_sum_to_the_logits(run) -> None:
    _, model, tokens, logits, cache = run
    stack = cache.get_full_resid_decomposition()
    target = tokens[:, 1:]
    attrs = cache.logit_attrs(stack[:, :, :-1], target, pos_slice=slice(0, -1))
    pre_cap = cache["unembed.softcap.hook_in"] if "unembed.softcap.hook_in" in cache.cache_dict else logits
    expected = pre_cap[:, :-1].gather(-1, target[..., None])[..., 0]
    if getattr(model.ln_final, "bias", None) is not None:  # LayerNorm's bias is no component's
        expected = expected - model.unembed.scale * (model.unembed.weight[target] @ model.ln_final.bias)
    torch.testing.assert_close(attrs.sum(0), expected, **TOL)


def test_head_labels_are_the_ones_head_units_uses(run) -> None:
    _, model, _, _, cache = run
    _, labels = cache.stack_head_results(return_labels=True, incl_shared=True)
    assert len(set(labels)) == len(labels)  # one name per unit (Falcon-H1's SSM heads are "M", not "H")
    own = {u.label for u in head_units(model) if "C" not in u.label}  # Mamba-1 units are channel groups
    assert own <= set(labels)
