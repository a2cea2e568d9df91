"""The hook engine on a toy model: naming, order, removal on exit, checks, cache shorthand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hooked.hook_points import HookPoint
from hooked.models.base import HookedModel
from hooked.models.block import Writer


@dataclass(frozen=True)
class ToyConfig:
    n_layers: int = 2
    d_vocab: int = 11
    d_model: int = 4


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.hook_resid_pre = HookPoint()
        self.hook_lazy = HookPoint()  # built only when active
        self.hook_mixer_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x, ctx):
        x = self.hook_resid_pre(x)
        out = self.hook_mixer_out(self.lin(x))
        if self.hook_lazy.is_active:
            self.calls += 1
            self.hook_lazy(out * 2)
        return self.hook_resid_post(x + out)

    def writers(self):  # the block protocol (hooked/models/block.py): what the block adds
        yield Writer("mixer", self.lin, self.hook_mixer_out, nn.Identity())

    def stream_norms(self):  # the block protocol: norms applied to the stream itself (MiniMax's); none here
        return []


class Toy(HookedModel):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = ToyConfig()
        self.emb = nn.Embedding(11, 4)
        self.blocks = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.ln_final = nn.Identity()
        self.unembed = nn.Linear(4, 11)
        self.hook_embed = HookPoint()
        self.setup()

    def embed_input(self, tokens, ctx):
        return self.hook_embed(self.emb(tokens))


@pytest.fixture
def toy():
    torch.manual_seed(0)
    return Toy()


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def test_names_and_forward_order(toy):
    names = list(toy.hook_dict)
    assert names[0] == "hook_embed"
    assert names[1:5] == ["blocks.0.hook_resid_pre", "blocks.0.hook_mixer_out", "blocks.0.hook_lazy",
                          "blocks.0.hook_resid_post"]
    assert all(toy.hook_dict[n].name == n for n in names)


def test_lazy_hook_only_computed_when_hooked(toy):
    toy.hook_dict  # recording the order runs once; reset the counter after it
    toy.blocks[0].calls = 0
    toy(TOKENS)
    assert toy.blocks[0].calls == 0
    toy.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_lazy", lambda x, h: None)])
    assert toy.blocks[0].calls == 1


def test_user_hooks_do_not_fire_while_recording_order(toy):
    fired = []
    toy.add_hook("hook_embed", lambda x, h: fired.append(h.name))
    toy.hook_dict
    assert fired == []
    toy.reset_hooks()


def test_identity_hooks_bit_identical(toy):
    ref = toy(TOKENS)
    out = toy.run_with_hooks(TOKENS, fwd_hooks=[(lambda n: True, lambda x, h: x.clone())])
    assert torch.equal(ref, out)


def test_replacement_propagates(toy):
    def zero(x, hook):
        return torch.zeros_like(x)

    out = toy.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_post", zero)])
    torch.testing.assert_close(out, toy.unembed.bias.expand_as(out))


@pytest.mark.parametrize("where", ["hook", "forward"])
def test_hooks_removed_after_exception(toy, where):
    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises((RuntimeError, ValueError)):
        if where == "hook":
            toy.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", boom)])
        else:
            toy.run_with_hooks(torch.tensor([[99]]), fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, h: None)])
    assert all(not p._hooks for p in toy.hook_dict.values())


@pytest.mark.parametrize("bad", [lambda x: x[:, :1], lambda x: x.double(), lambda x: x.unsqueeze(0)])
def test_wrong_shape_or_dtype_names_hook(toy, bad):
    with pytest.raises(ValueError, match="blocks.0.hook_mixer_out"):
        toy.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_mixer_out", lambda x, h: bad(x))])
    assert all(not p._hooks for p in toy.hook_dict.values())


def test_unknown_name_close_matches_and_nothing_attached(toy):
    with pytest.raises(KeyError, match="close matches: blocks.0.hook_resid_pre"):
        with toy.hooks(fwd_hooks=[("hook_embed", lambda x, h: None), ("blocks.0.hook_resid_pr", lambda x, h: None)]):
            pass
    assert not toy.hook_dict["hook_embed"]._hooks


def test_tokens_outside_vocab(toy):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 11\): \[11, 12\]"):
        toy(torch.tensor([[1, 11, 12]]))
    with pytest.raises(TypeError, match="integer"):
        toy(torch.zeros(1, 3))


def test_run_with_cache_filters_and_shorthand(toy):
    logits, cache = toy.run_with_cache(TOKENS, names_filter=lambda n: "resid" in n)
    assert set(cache.keys()) == {f"blocks.{l}.hook_resid_{w}" for l in range(2) for w in ("pre", "post")}
    assert torch.equal(cache["resid_post", -1], cache["blocks.1.hook_resid_post"])
    assert torch.equal(cache["resid_pre", 1], cache["resid_post", 0])
    _, cache = toy.run_with_cache(TOKENS)
    assert torch.equal(cache["embed"], cache["hook_embed"])
    assert torch.equal(cache["lazy", 0], 2 * cache["mixer_out", 0])
    stack = cache.decompose_resid()
    torch.testing.assert_close(stack.sum(0), cache["resid_post", -1])
    assert cache.accumulated_resid().shape == (3, 2, 3, 4)
    assert all(not p._hooks for p in toy.hook_dict.values())


def test_backward_hooks(toy):
    grads = {}
    with torch.enable_grad(), toy.hooks(bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, h: grads.__setitem__(h.name, g))]):
        toy(TOKENS).sum().backward()
    assert grads["blocks.1.hook_resid_pre"].shape == (2, 3, 4)


def test_start_stop_round_trip(toy):
    mid = toy(TOKENS, stop_at_layer=1)
    assert torch.equal(toy(mid, start_at_layer=1), toy(TOKENS))
    with pytest.raises(ValueError, match=r"stop_at_layer=5: must be in \[-2, 2\]"):
        toy(TOKENS, stop_at_layer=5)


def test_attention_mask_checked(toy):
    with pytest.raises(ValueError, match="attention_mask has shape"):
        toy(TOKENS, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="only 0 and 1"):
        toy(TOKENS, attention_mask=torch.full((2, 3), 2))
