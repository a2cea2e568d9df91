"""The model map (hooked/models/model_map.py) on every family of tiny_families, in float64.

Every unit's write asked from its site on a bare cache equals the write the forward builds with every
lazy hook on (hook_result / hook_head_out; experts: their sum is hook_routed_out); the units' writes
plus the rest (biases, MLPs, embeddings) sum to the final residual from a bare cache; every label is
built and parsed by the one grammar and names its own unit; the map is rebuilt when a block is replaced.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES, tiny

from hooked.models.model_map import label, label_layer, model_map, parse_label

TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = copy.deepcopy(tiny(request.param)).double()
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, bare = model.run_with_cache(tokens)
        _, lazy = model.run_with_cache(tokens, incl_lazy=True)
    return request.param, model, bare, lazy


def test_each_units_write_from_a_bare_cache_is_the_forwards_own(run):
    name, model, bare, lazy = run
    sites = list(model_map(model))
    assert sites, name
    for site in sites:
        writes = site.writes_from(bare.cache_dict)
        assert writes is not None, (name, site.path, [h.name for h in site.reads])
        assert writes.shape[-2] == site.n
        hook = site.result_hook
        if hook is not None:
            assert hook.name not in bare.cache_dict  # lazy: not in the bare cache, asked of the mixer
            torch.testing.assert_close(writes, lazy[hook.name], **TOL)
        else:  # experts: they sum to the routed output
            routed = lazy[site.module.hook_routed_out.name]
            torch.testing.assert_close(writes.sum(-2), routed, **TOL)


def test_units_and_the_rest_sum_to_the_residual_from_a_bare_cache(run):
    name, model, bare, _ = run
    stack, labels = bare.get_full_resid_decomposition(return_labels=True)
    torch.testing.assert_close(stack.sum(0), bare[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], **TOL)
    own = [u for s in model_map(model) if s.writer is not None for u in s.labels()]
    assert set(own) <= set(labels), name  # every residual-writing unit is one component, by its label


def test_every_label_is_its_own_unit(run):
    name, model, _, _ = run
    mp = model_map(model)
    seen = set()
    for site in mp:
        for i, text in enumerate(site.labels()):
            assert text not in seen
            seen.add(text)
            assert parse_label(text) == (site.layer, site.tag, i, i)
            unit = mp.unit(text)
            assert unit.module == site.path and unit.heads == (i,) and unit.label == text
    for u in mp.units(group=3) + mp.experts():
        assert mp.unit(u.label) == u


@pytest.mark.parametrize("text, parsed", [
    ("L3H5", (3, "H", 5, 5)), ("L5SH3", (5, "SH", 3, 3)), ("L0M3", (0, "M", 3, 3)), ("L2C0-63", (2, "C", 0, 63)),
    ("L3E5", (3, "E", 5, 5)), (" L1C7 ", (1, "C", 7, 7)),
])
def test_the_label_grammar(text, parsed):
    assert parse_label(text) == parsed
    assert parse_label(label(*parsed)) == parsed


@pytest.mark.parametrize("text, layer", [("L3H5", 3), ("L12SH3", 12), ("L2C0-63", 2), ("L0Hg1", 0), ("L4shared", 4),
                                         ("L3", None), ("mlp3", None), ("Lx3", None), ("L3.q", None)])
def test_the_layer_of_any_label(text, layer):
    assert label_layer(text) == layer


@pytest.mark.parametrize("text", ["L3X5", "H5", "L3H", "L2C5-3", "l3h5", 35, "L3H5.q"])
def test_what_is_no_label_is_refused(text):
    with pytest.raises(ValueError, match="label"):
        parse_label(text)


def test_the_map_is_rebuilt_when_a_block_is_replaced():
    from analysis.interventions import replace_block

    model = copy.deepcopy(tiny("jamba"))
    before = model_map(model)
    assert model_map(model) is before  # built once
    donor = copy.deepcopy(model)
    with replace_block(model, 0, donor):
        inside = model_map(model)
        assert inside is not before
        assert inside.sites[0].module is not before.sites[0].module
    assert model_map(model) is not inside


def test_every_mixer_names_its_mixing_and_its_rows_are_the_matrixs(run):
    """Every token mixer answers mixing(); matrix_slices gives the rows of the matrix a cache holds (the
    pattern's for attention, the kernel's, without the pos x pos tensor, for the recurrent mixers)."""
    name, model, _, _ = run
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([2, 6])
    for site in model_map(model).mixers():
        mixing = site.mixing()
        assert mixing is not None, (name, site.path)
        assert mixing.signed == site.recurrent and (mixing.scores is None) == site.recurrent
        got = {}
        hooks = site.module.matrix_slices(lambda pos, device: rows.to(device), lambda x: got.setdefault("rows", x))
        with torch.no_grad(), model.hooks(fwd_hooks=[(p.name, fn) for p, fn in hooks]):
            model(tokens)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=[mixing.matrix.name])
        torch.testing.assert_close(got["rows"], cache[mixing.matrix.name][:, :, rows], **TOL)
