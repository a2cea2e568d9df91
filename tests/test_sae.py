"""SAEs spliced into hook points (hooked/sae): exactness with the error term, feature edits against the
same edit by hand, the splice on SSM states continuing the recurrence, per-head slices, positions,
the feature hook points in the cache and in patching, attach / reset / restore."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from analysis.interventions import patch


class TinySAE(nn.Module):
    """A ReLU SAE with SAELens's attribute names (W_enc [d_in d_sae], W_dec [d_sae d_in])."""

    def __init__(self, d_in: int, d_sae: int, hook_name: str | None = None, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) * d_in ** -0.5)
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) * d_sae ** -0.5)
        self.b_enc = nn.Parameter(torch.randn(d_sae, generator=g) * 0.1)
        self.hook_name = hook_name

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.W_enc + self.b_enc)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        return acts @ self.W_dec


@pytest.fixture
def mamba2(organism):
    model = organism("mamba2-kv")
    yield model
    model.reset_saes()


def tokens(model, batch: int = 2, pos: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# hook, d_in: the whole activation, one head, the whole state, one head's state, the heads view
CASES = [("blocks.0.hook_resid_post", 64), ("blocks.1.mixer.hook_ssm_out", 128), ("blocks.0.mixer.hook_y", 16),
         ("blocks.0.mixer.hook_h", 8 * 16 * 32), ("blocks.1.mixer.hook_h", 16 * 32),
         ("blocks.0.mixer.hook_h.hook_heads", 16 * 32)]


@pytest.mark.parametrize("hook, d_in", CASES)
def test_error_term_is_bit_identical_and_features_are_cached(mamba2, hook, d_in) -> None:
    x = tokens(mamba2)
    with torch.no_grad():
        plain = mamba2(x)
        mamba2.add_sae(TinySAE(d_in, 24), hook, use_error_term=True)
        assert torch.equal(mamba2(x), plain)
        logits, cache = mamba2.run_with_cache(x, names_filter=lambda n: ".sae." in n)
        assert torch.equal(logits, plain)  # the feature hooks are built, the output is still x itself
        acts = cache[f"{hook}.sae.hook_sae_acts_post"]
        assert acts.shape == mamba2.hook_shape(f"{hook}.sae.hook_sae_acts_post", 2, 12)
        assert acts.shape[-1] == 24 and (acts > 0).any()
        recons, error = cache[f"{hook}.sae.hook_sae_recons"], cache[f"{hook}.sae.hook_sae_error"]
        _, original = mamba2.run_with_cache(x, names_filter=hook)
        torch.testing.assert_close(recons + error, original[hook], rtol=0, atol=1e-5)
        mamba2.add_sae(TinySAE(d_in, 24), hook, use_error_term=False)  # replaces the first
        assert list(mamba2.acts_to_saes) == [hook]
        assert not torch.allclose(mamba2(x), plain)


def test_feature_ablation_equals_the_same_edit_by_hand(mamba2) -> None:
    hook, sae, f = "blocks.0.mixer.hook_ssm_out", TinySAE(128, 32), 5
    x = tokens(mamba2)

    def zero_feature(acts, hook):
        acts[..., f] = 0  # in place, as SAELens users write it

    def by_hand(act, hook):
        flat = act.reshape(*act.shape[:2], -1)
        acts = sae.encode(flat)
        edited = acts.clone()
        edited[..., f] = 0
        return act + (sae.decode(edited) - sae.decode(acts)).reshape(act.shape)

    with torch.no_grad():
        expected = mamba2.run_with_hooks(x, fwd_hooks=[(hook, by_hand)])
        mamba2.add_sae(sae, hook, use_error_term=True)
        got = mamba2.run_with_hooks(x, fwd_hooks=[(f"{hook}.sae.hook_sae_acts_post", zero_feature)])
        plain = mamba2(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3


@pytest.mark.parametrize("t", [0, 4, 11])
def test_sae_on_the_state_at_position_t_changes_every_later_position_and_none_before(mamba2, t) -> None:
    x = tokens(mamba2)
    with torch.no_grad():
        plain = mamba2(x)
        mamba2.add_sae(TinySAE(16 * 32, 32), "blocks.0.mixer.hook_h", positions=[t])
        got = mamba2(x)
    change = (got - plain).abs().amax(-1)  # [batch pos]
    assert torch.equal(got[:, :t], plain[:, :t])
    assert (change[:, t:] > 1e-4).all(), change


def test_state_splice_continues_the_recurrence(mamba2) -> None:
    """The spliced state at t is what y reads at t and what the scan continues from: y after the
    splice equals C . h' where h' is the recurrence restarted from the spliced state."""
    hook, t, sae = "blocks.0.mixer.hook_h", 3, TinySAE(16 * 32, 16)
    x = tokens(mamba2, batch=1)
    with torch.no_grad():
        _, clean = mamba2.run_with_cache(x, names_filter=lambda n: n.startswith("blocks.0.mixer.hook_"))
        mamba2.add_sae(sae, hook, positions=[t])
        _, edited = mamba2.run_with_cache(x, names_filter=lambda n: n.startswith("blocks.0.mixer.hook_"))
    A_bar, B_bar = clean["blocks.0.mixer.hook_A_bar"][0], clean["blocks.0.mixer.hook_B_bar"][0]  # [pos h], [pos h n]
    u, C = clean["blocks.0.mixer.hook_ssm_in"][0], clean["blocks.0.mixer.hook_C"][0, :, 0]  # [pos h p], [pos n]
    h = clean[hook][0].clone()
    state = h[t]
    state = sae.decode(sae.encode(state.reshape(8, -1))).reshape(state.shape)
    ys = []
    for j in range(x.shape[1]):
        if j > t:
            state = A_bar[j][:, None, None] * state + u[j][..., None] * B_bar[j][:, None, :]
        current = h[j] if j < t else state
        ys.append(torch.einsum("hpn,n->hp", current, C[j]))
    torch.testing.assert_close(edited["blocks.0.mixer.hook_y"][0], torch.stack(ys), rtol=1e-4, atol=1e-4)


def test_per_head_sae_on_hook_z_applies_to_each_heads_slice(organism) -> None:
    model = organism("llama-kv")
    hook = "blocks.1.attn.hook_z"
    d_head, n_heads = model.cfg.d_head, model.cfg.n_heads
    sae = TinySAE(d_head, 8)
    x = tokens(model)
    try:
        with torch.no_grad():
            _, clean = model.run_with_cache(x, names_filter=hook)
            model.add_sae(sae, hook)
            _, cache = model.run_with_cache(x, names_filter=lambda n: n.startswith(hook))
    finally:
        model.reset_saes()
    z = clean[hook]
    assert cache[f"{hook}.sae.hook_sae_acts_post"].shape == (2, 12, n_heads, 8)
    for head in range(n_heads):
        torch.testing.assert_close(cache[f"{hook}.sae.hook_sae_recons"][:, :, head], sae.decode(sae.encode(z[:, :, head])))


def test_one_head_splice_keeps_the_other_heads(organism) -> None:
    model = organism("llama-kv")
    hook, head = "blocks.0.attn.hook_z", 1
    x = tokens(model)
    try:
        with torch.no_grad():
            _, clean = model.run_with_cache(x, names_filter=hook)
            model.add_sae(TinySAE(model.cfg.d_head, 8), hook, head=head)
            _, cache = model.run_with_cache(x, names_filter=lambda n: n == f"{hook}.sae.hook_sae_output")
    finally:
        model.reset_saes()
    out = cache[f"{hook}.sae.hook_sae_output"]
    others = [h for h in range(model.cfg.n_heads) if h != head]
    assert torch.equal(out[:, :, others], clean[hook][:, :, others])
    assert not torch.allclose(out[:, :, head], clean[hook][:, :, head])


def test_zamba2_shared_block_splices_per_invocation(organism) -> None:
    model = organism("zamba2-kv")
    hook = next(n for n in model.hook_dict if ".shared." in n and n.endswith("attn.hook_z"))
    x = tokens(model)
    try:
        with torch.no_grad():
            plain = model(x)
            model.add_sae(TinySAE(model.hook_shape(hook)[-1], 8), hook, use_error_term=True)
            assert torch.equal(model(x), plain)
            ablated = model.run_with_hooks(x, fwd_hooks=[(f"{hook}.sae.hook_sae_acts_post", lambda a, hook: a * 0)])
    finally:
        model.reset_saes()
    assert not torch.allclose(ablated, plain)


def test_patching_a_feature_from_a_clean_cache(mamba2) -> None:
    hook = "blocks.0.hook_resid_post"
    feature = f"{hook}.sae.hook_sae_acts_post"
    clean_x, corrupt_x = tokens(mamba2, seed=1), tokens(mamba2, seed=2)
    mamba2.add_sae(TinySAE(64, 16), hook, use_error_term=True)
    with torch.no_grad():
        _, clean = mamba2.run_with_cache(clean_x, names_filter=feature)
        corrupt = mamba2(corrupt_x)
        patched = patch(mamba2, corrupt_x, clean, feature)
        by_hand = mamba2.run_with_hooks(corrupt_x, fwd_hooks=[(feature, lambda a, hook: clean[feature])])
    torch.testing.assert_close(patched, by_hand, rtol=0, atol=0)
    assert not torch.allclose(patched, corrupt)


def test_backward_hooks_reach_the_features_with_the_error_term(mamba2) -> None:
    hook = "blocks.0.hook_resid_post"
    sae = TinySAE(64, 16).requires_grad_(False)
    x = tokens(mamba2)
    mamba2.add_sae(sae, hook, use_error_term=True)
    grads = {}
    with mamba2.hooks(bwd_hooks=[(f"{hook}.sae.hook_sae_acts_post", lambda g, hook: grads.setdefault("acts", g)),
                                 (hook, lambda g, hook: grads.setdefault("resid", g))]):
        logits = mamba2(x)
        logits[:, -1, 3].sum().backward()
    mamba2.zero_grad()
    with torch.no_grad():
        assert torch.equal(logits, mamba2(x))  # grad mode leaves the value exact
    assert grads["acts"].shape == (2, 12, 16) and grads["acts"].abs().sum() > 0
    torch.testing.assert_close(grads["acts"], grads["resid"] @ sae.W_dec.T)  # d metric / d features, through the decoder


def test_saes_context_restores_what_was_attached(mamba2) -> None:
    first, second = TinySAE(64, 8, hook_name="blocks.0.hook_resid_post"), TinySAE(64, 8, seed=1)
    second.hook_name = "blocks.0.hook_resid_post"
    mamba2.add_sae(first)
    x = tokens(mamba2)
    with torch.no_grad():
        with_first = mamba2(x)
        with mamba2.saes([second]):
            assert mamba2.acts_to_saes == {"blocks.0.hook_resid_post": second}
            with_second = mamba2(x)
        assert mamba2.acts_to_saes == {"blocks.0.hook_resid_post": first}
        assert torch.equal(mamba2(x), with_first)
        assert torch.equal(mamba2.run_with_saes(x, saes=[second]), with_second)
        _, cache = mamba2.run_with_cache_with_saes(x, saes=[second], names_filter=lambda n: "sae" in n)
        assert "blocks.0.hook_resid_post.sae.hook_sae_acts_post" in cache
    mamba2.reset_saes()
    assert mamba2.acts_to_saes == {} and not any(".sae." in n for n in mamba2.hook_dict)
    with torch.no_grad():
        mamba2.reset_hooks(including_permanent=True)  # hooks and SAEs are separate: nothing to restore


def test_bad_saes_are_refused_by_name(mamba2) -> None:
    with pytest.raises(ValueError, match="d_in=100 fits no trailing axes"):
        mamba2.add_sae(TinySAE(100, 8), "blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match="names no hook"):
        mamba2.add_sae(TinySAE(64, 8))
    with pytest.raises(KeyError, match="unknown hook name"):
        mamba2.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_pots")
    with pytest.raises(ValueError, match=r"\[batch pos \.\.\.\] hook"):
        mamba2.add_sae(TinySAE(12, 8), "blocks.0.mixer.hook_kernel")
    with pytest.raises(TypeError, match="encode"):
        mamba2.add_sae(nn.Linear(64, 8), "blocks.0.hook_resid_post")
    with pytest.raises(TypeError, match="use_error_term"):  # (under pytest the annotation check speaks first)
        mamba2.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", use_error_term="yes")
    with pytest.raises(ValueError, match="hook_head_index=1 needs an SAE of one head's size"):
        mamba2.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", head=1)
    with pytest.raises(KeyError, match="no SAE is attached"):
        mamba2.reset_saes("blocks.0.hook_resid_post")
    mamba2.add_sae(TinySAE(64, 8), "blocks.0.hook_resid_post", positions=[40])
    with pytest.raises(ValueError, match=r"add_sae: positions=40: must be in \[-12, 12\)"):
        mamba2(tokens(mamba2))


def test_attribution_patching_on_features_is_the_first_order_term(mamba2) -> None:
    from analysis.interventions import attribution_patch, logit_diff

    feature = "blocks.0.hook_resid_post.sae.hook_sae_acts_post"
    sae = TinySAE(64, 16).requires_grad_(False)
    clean_x, corrupt_x = tokens(mamba2, seed=1), tokens(mamba2, seed=2)
    mamba2.add_sae(sae, "blocks.0.hook_resid_post", use_error_term=True)
    metric = logit_diff(3, 4)
    with torch.no_grad():
        _, clean = mamba2.run_with_cache(clean_x, names_filter=feature)
        _, base = mamba2.run_with_cache(corrupt_x, names_filter=feature)
        base_metric = metric(mamba2(corrupt_x))
    estimate = attribution_patch(mamba2, corrupt_x, clean, metric, feature, over=("pos",))
    grads = {}
    with mamba2.hooks(bwd_hooks=[(feature, lambda g, hook: grads.setdefault("g", g))]):
        metric(mamba2(corrupt_x)).backward()
    mamba2.zero_grad()
    by_hand = base_metric + ((clean[feature] - base[feature]) * grads["g"]).sum(-1).sum(0)
    torch.testing.assert_close(estimate.float(), by_hand, rtol=1e-4, atol=1e-5)


def test_mamba1_state_splice_at_t_changes_every_later_position(organism) -> None:
    model = organism("mamba-kv")
    hook, t = "blocks.1.mixer.hook_h", 5
    d_state = model.hook_shape(hook)[-1]
    x = tokens(model)
    try:
        with torch.no_grad():
            plain = model(x)
            model.add_sae(TinySAE(d_state, 8), hook, positions=[t])  # one SAE per channel's state
            got = model(x)
    finally:
        model.reset_saes()
    assert torch.equal(got[:, :t], plain[:, :t])
    assert ((got[:, t:] - plain[:, t:]).abs().amax(-1) > 1e-5).all()
