"""Hook axes are data: every hook's declared axes give the shape it fires with, on every family.

`model.hook_shape(name, batch, pos)` is computed from the config alone; these tests run each family
at two lengths and two batch sizes and compare with what every hook actually fires with (lazy ones
included), check the element types at bfloat16 (what the cache budget counts), and that the
model's repr lists the axes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES, tiny

from hooked.cache_budget import estimate_cache_bytes
from hooked.hook_points import recording


def fired(model, batch: int, pos: int) -> dict[str, torch.Tensor]:
    """Every hook's activation from one forward with every hook active (lazy ones built)."""
    out: dict[str, torch.Tensor] = {}
    with recording(lambda name, x: out.setdefault(name, x)), torch.no_grad():
        model(torch.randint(1, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(pos)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_shape_is_the_fired_shape_at_two_lengths_and_batches(family) -> None:
    model = tiny(family)
    for batch, pos in ((1, 3), (2, 7)):
        acts = fired(model, batch, pos)
        assert list(acts) == list(model.hook_dict)  # every hook fires, in forward order
        for name, act in acts.items():
            assert model.hook_shape(name, batch=batch, pos=pos) == tuple(act.shape), name


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_elements_and_cache_bytes_match_what_is_built(family) -> None:
    model = copy.deepcopy(tiny(family)).to(torch.bfloat16)
    acts = fired(model, 2, 5)
    estimate = estimate_cache_bytes(model, list(acts), 2, 5)
    for name, act in acts.items():
        assert estimate[name] == act.numel() * act.element_size(), (name, act.dtype, model.hook_dict[name].element)


def test_repr_lists_the_hook_points_with_their_axes() -> None:
    text = repr(tiny("mamba2"))
    assert "(hook_h): HookPoint([batch pos n_heads d_head d_state], lazy)" in text
    assert "(hook_pattern): HookPoint([batch n_heads q_pos k_pos])" in repr(tiny("llama"))


def test_unknown_hook_and_undeclared_axis_are_refused() -> None:
    model = tiny("llama")
    with pytest.raises(KeyError, match="unknown hook name"):
        model.hook_shape("blocks.0.attn.hook_patern", batch=1, pos=2)
    point = model.hook_dict["blocks.0.attn.hook_z"]
    saved = point.axes
    try:
        point.axes = ("batch", "pos", "n_widgets")
        with pytest.raises(KeyError, match="n_widgets"):
            model.hook_shape("blocks.0.attn.hook_z", batch=1, pos=2)
    finally:
        point.axes = saved
