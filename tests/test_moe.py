"""The mixture-of-experts MLP (hooked/models/moe.py): routing rules, hooks, edits, against a brute-force loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hooked.hook_points import HookedRootModule
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SigmoidTopK, SoftmaxTopK

D, FF, E = 8, 6, 5


class Root(HookedRootModule):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.mlp = moe
        self.setup()

    def _example_input(self):
        return torch.zeros(1, 2, D, dtype=torch.float64)

    def forward(self, x):
        return self.mlp(x)


SELECTS = {
    "softmax_top2": lambda: SoftmaxTopK(2),
    "softmax_top3_renorm": lambda: SoftmaxTopK(3, renormalise=True),
    "sigmoid_top2_groups": lambda: SigmoidTopK(E + 1, 2, n_group=2, topk_group=1, renormalise=True, scaling=2.5),
    "sigmoid_top3_plain": lambda: SigmoidTopK(E + 1, 3, renormalise=False),
}


def build(name: str, gated: bool = True, shared: bool = False, seed: int = 0) -> Root:
    torch.manual_seed(seed)
    select = SELECTS[name]()
    n = E + 1 if isinstance(select, SigmoidTopK) else E
    moe = MoE(D, FF, n, select, "silu", gated=gated, shared=GatedMLP(D, 7, "silu") if shared else None)
    if isinstance(select, SigmoidTopK):
        select.correction_bias.data = torch.randn(n) * 0.3
    return Root(moe.double())


def brute(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token, every expert, written out: the reference for the routing rules and the sum."""
    logits = x @ moe.router.weight.T
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            row = logits[b, t]
            if isinstance(moe.select, SoftmaxTopK):
                order = row.argsort(descending=True)[: moe.top_k]
                probs = row.softmax(-1)
                w = probs[order] / (probs[order].sum() if moe.select.renormalise else 1.0)
            else:
                s = row.sigmoid()
                biased = s + moe.select.correction_bias
                groups = biased.view(moe.select.n_group, -1)
                best = groups.topk(2, dim=-1).values.sum(-1).topk(moe.select.topk_group).indices
                allowed = torch.zeros_like(groups, dtype=torch.bool)
                allowed[best] = True
                order = biased.masked_fill(~allowed.flatten(), -torch.inf).argsort(descending=True)[: moe.top_k]
                w = s[order] / (s[order].sum() if moe.select.renormalise else 1.0) * moe.select.scaling
            for e, we in zip(order.tolist(), w):
                xe = x[b, t]
                up = moe.up_proj[e] @ xe
                hid = F.silu(up) if moe.gate_proj is None else F.silu(moe.gate_proj[e] @ xe) * up
                out[b, t] += we * (moe.down_proj[e] @ hid)
            if moe.shared is not None:
                out[b, t] += moe.shared(x[b:b + 1, t:t + 1])[0, 0]
    return out


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("name", list(SELECTS))
def test_moe_equals_brute_force(name, gated):
    root = build(name, gated=gated, shared=name.startswith("softmax_top3"))
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(root(x), brute(root.mlp, x), rtol=0, atol=1e-12)


def test_hooks_fire_once_with_their_shapes():
    root = build("softmax_top3_renorm", shared=True)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        _, cache = root.run_with_cache(x, names_filter=lambda n: True)
    expected = {"mlp.hook_router_logits": (2, 7, E), "mlp.hook_chosen": (2, 7, 3), "mlp.hook_routing_weights": (2, 7, 3),
                "mlp.hook_expert_out": (2, 7, 3, D), "mlp.hook_routed_out": (2, 7, D), "mlp.hook_shared_out": (2, 7, D),
                "mlp.shared.hook_pre": (2, 7, 7), "mlp.shared.hook_pre_linear": (2, 7, 7), "mlp.shared.hook_post": (2, 7, 7)}
    assert {k: tuple(v.shape) for k, v in cache.items()} == expected
    assert cache["mlp.hook_chosen"].dtype == torch.long
    torch.testing.assert_close(cache["mlp.hook_routed_out"],
                               (cache["mlp.hook_routing_weights"][..., None] * cache["mlp.hook_expert_out"]).sum(2))


def test_identity_hooks_keep_output_bit_identical():
    root = build("sigmoid_top2_groups", shared=True)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        plain = root(x)
        hooked = root.run_with_hooks(x, fwd_hooks=[(lambda n: True, lambda t, hook: t.clone())])
    assert torch.equal(plain, hooked)


def test_editing_chosen_runs_the_named_expert():
    root = build("softmax_top2")
    moe = root.mlp
    x = torch.randn(1, 4, D, dtype=torch.float64)

    def reroute(c, hook):
        c = c.clone()
        c[0, 2, 0] = 4
        return c

    with torch.no_grad():
        _, cache = root.run_with_cache(x, names_filter=["mlp.hook_expert_out", "mlp.hook_chosen"])
        with root.hooks(fwd_hooks=[("mlp.hook_chosen", reroute)]):
            _, edited = root.run_with_cache(x, names_filter=["mlp.hook_expert_out"])
    torch.testing.assert_close(edited["mlp.hook_expert_out"][0, 2, 0], moe.expert(4, x[0, 2:3])[0])
    torch.testing.assert_close(edited["mlp.hook_expert_out"][0, 2, 1], cache["mlp.hook_expert_out"][0, 2, 1])


def test_zero_weight_of_an_expert_equals_zeroing_its_down_proj():
    root = build("softmax_top3_renorm", shared=True)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    seen = {}
    hooks = [("mlp.hook_chosen", lambda c, hook: seen.update(c=c)),
             ("mlp.hook_routing_weights", lambda w, hook: w.masked_fill(seen["c"] == 2, 0.0))]
    with torch.no_grad():
        ablated = root.run_with_hooks(x, fwd_hooks=hooks)
        root.mlp.down_proj[2].zero_()
        torch.testing.assert_close(ablated, root(x), rtol=0, atol=1e-12)


def test_bad_chosen_edit_is_refused():
    root = build("softmax_top2")
    with pytest.raises(ValueError, match="chosen experts"):
        root.run_with_hooks(torch.randn(1, 3, D, dtype=torch.float64),
                            fwd_hooks=[("mlp.hook_chosen", lambda c, hook: c + E)])
    with pytest.raises(ValueError, match="n_group"):
        SigmoidTopK(5, 2, n_group=2)
