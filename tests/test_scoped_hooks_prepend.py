"""`model.hooks(prepend=True)`: scoped hooks that run before the hooks already attached at their points
(what `analysis.interventions.ablation.attached` builds skip_layers' restore on)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import tiny


@pytest.mark.parametrize("prepend, order", [(False, ["outer", "inner"]), (True, ["inner", "outer"])])
def test_prepended_hooks_run_first(prepend, order):
    model = tiny("llama").eval()
    seen = []
    name = model.blocks[0].hook_resid_post.name
    with model.hooks(fwd_hooks=[(name, lambda x, hook: seen.append("outer"))]):
        with model.hooks(fwd_hooks=[(name, lambda x, hook: seen.append("inner"))], prepend=prepend):
            model(torch.randint(1, 60, (1, 4)))
    assert seen == order


def test_prepend_is_a_flag_and_a_bad_name_attaches_nothing():
    model = tiny("llama").eval()
    name = model.blocks[0].hook_resid_post.name
    with pytest.raises(Exception, match="prepend"):
        with model.hooks(fwd_hooks=[(name, lambda x, hook: None)], prepend="yes"):
            pass
    with pytest.raises(KeyError, match="unknown hook name"):
        with model.hooks(fwd_hooks=[(name, lambda x, hook: None), ("blocks.0.hook_nothing", lambda x, hook: None)],
                         prepend=True):
            pass
    assert not model.blocks[0].hook_resid_post.has_hooks
