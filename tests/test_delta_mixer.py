"""The delta-rule mixer's hooks as a contract, in float64 on the tiny families (Qwen3-Next's Gated DeltaNet,
OLMo-hybrid's beta in [0, 2], Kimi Linear's per-channel KDA), and incremental decoding on every new family.

Invariants (1e-12): hook_y == the chunked rule == a brute-force recurrence written here == S_t^T q_t from
hook_h == hook_kernel @ hook_v. Edits: an edit of hook_h at t == the recurrence continued from the edited
state (brute force); an edit of hook_kernel changes y by (A' - A) v; edits of hook_alpha / hook_beta at
their extremes (decay 0 and 1, beta 0 and 1; KDA per channel) are what the rule reads. Lazy: hook_h and
hook_kernel are sized before they are built and refused past a budget; identity hooks leave logits
bit-identical. Decoding: incremental logits == recompute (left padding too), generate with a state ==
without, the lazy whole-sequence hooks refused while decoding.
"""

from __future__ import annotations

import pytest
import torch
from delta_oracles import tiny_delta_hf
from einops import einsum

from hooked import backends
from hooked.cache_budget import CacheBudgetError
from hooked.models.decode_state import DecodeState
from loaders.load import from_hf

FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lfm2"]
DELTA = {"qwen3_next": "blocks.2.mixer", "olmo_hybrid": "blocks.0.mixer", "kimi_linear": "blocks.2.mixer"}
TOL = 1e-12


def model_of(model_type: str, dtype: torch.dtype = torch.float64):
    hf, _ = tiny_delta_hf(model_type, dtype=dtype)
    return from_hf(hf)


def brute(q, k, v, beta, alpha, edit_at=None, delta=None):
    """(S [b l h c v], y [b l h v]) one position at a time: S <- Diag(alpha) S; S <- S + beta k (v - S^T k)^T;
    y = S^T q (q, k per q/k head, repeated here for the value heads; q already scaled)."""
    n_heads = v.shape[2]
    q, k = (x.repeat_interleave(n_heads // x.shape[2], dim=2) for x in (q, k))
    S = v.new_zeros(v.shape[0], n_heads, k.shape[-1], v.shape[-1])
    states, ys = [], []
    for t in range(v.shape[1]):
        a = alpha[:, t]
        S = S * (a[..., None, None] if a.ndim == 2 else a[..., None])
        kt, vt = k[:, t], v[:, t]
        read = einsum(S, kt, "b h c v, b h c -> b h v")
        S = S + einsum(kt, beta[:, t, :, None] * (vt - read), "b h c, b h v -> b h c v")
        if t == edit_at:
            S = S + delta
        states.append(S)
        ys.append(einsum(S, q[:, t], "b h c v, b h c -> b h v"))
    return torch.stack(states, 1), torch.stack(ys, 1)


def read(model, site, tokens, hooks=()):
    names = [f"{site}.hook_{n}" for n in ("q", "k", "v", "beta", "alpha", "h", "kernel", "y")]
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        _, cache = model.run_with_cache(tokens, names_filter=names)
    return [cache[n] for n in names]


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("model_type", list(DELTA))
def test_states_kernel_and_output_agree_with_a_brute_force_recurrence(model_type):
    model, site = model_of(model_type), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))  # two chunks
    q, k, v, beta, alpha, h, A, y = read(model, site, tokens)
    q_read = q * q.shape[-1] ** -0.5
    h_ref, y_ref = brute(q_read, k, v, beta, alpha)
    close(y, y_ref, "hook_y vs brute force")
    close(h, h_ref, "hook_h vs brute force")
    q_heads = q_read.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
    close(einsum(h, q_heads, "b l h c v, b l h c -> b l h v"), y, "S^T q vs y")
    close(einsum(A, v, "b h j i, b i h v -> b j h v"), y, "kernel @ v vs y")
    assert torch.equal(A, A.tril())  # causal
    if model_type == "olmo_hybrid":
        assert beta.max() > 1.0  # beta in [0, 2]
    if model_type == "kimi_linear":
        assert alpha.ndim == 4 and not torch.allclose(alpha, alpha[..., :1].expand_as(alpha))  # per channel


@pytest.mark.parametrize("model_type", list(DELTA))
def test_state_edit_continues_the_recurrence(model_type):
    model, site = model_of(model_type), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(2))
    q, k, v, beta, alpha, h, _, y = read(model, site, tokens)
    t = 40
    delta = torch.randn(h[:, t].shape, generator=torch.Generator().manual_seed(5), dtype=h.dtype)

    def edit(states, hook):
        states = states.clone()
        states[:, t] += delta
        return states

    *_, y_edited = read(model, site, tokens, [(f"{site}.hook_h", edit)])
    _, y_ref = brute(q * q.shape[-1] ** -0.5, k, v, beta, alpha, edit_at=t, delta=delta)
    close(y_edited, y_ref, "y after a state edit vs brute force")
    assert torch.equal(y_edited[:, :t], y[:, :t]) and not torch.allclose(y_edited[:, t + 1:], y[:, t + 1:])


@pytest.mark.parametrize("model_type", list(DELTA))
def test_kernel_edit_changes_y_by_the_edited_entries(model_type):
    model, site = model_of(model_type), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    *_, v, _, _, _, A, y = read(model, site, tokens)
    new = A.clone()
    new[:, :, 20, 3] = 0.5
    new[1, 2, 29, :] = 0.0
    *_, y_edited = read(model, site, tokens, [(f"{site}.hook_kernel", lambda K, hook: new)])
    close(y_edited, y + einsum(new - A, v, "b h j i, b i h v -> b j h v"), "y + (A' - A) v")


@pytest.mark.parametrize("model_type", list(DELTA))
@pytest.mark.parametrize("alpha_value,beta_value", [(0.0, 1.0), (1.0, 0.0), (1.0, 1.0), (1e-9, 0.5), (1 - 1e-9, 1.0)])
def test_decay_and_beta_extremes_are_what_the_rule_reads(model_type, alpha_value, beta_value):
    """Decay 0 (forget all), 1 (keep all), beta 0 (no write) and 1 (full replacement), on half the heads
    (KDA: on half the key channels too)."""
    model, site = model_of(model_type), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(4))

    def set_alpha(alpha, hook):
        alpha = alpha.clone()
        alpha[:, 10:, ::2] = alpha_value if alpha.ndim == 3 else alpha[:, 10:, ::2]
        if alpha.ndim == 4:
            alpha[:, 10:, :, ::2] = alpha_value
        return alpha

    def set_beta(beta, hook):
        beta = beta.clone()
        beta[:, 5:, 1::2] = beta_value
        return beta

    q, k, v, beta, alpha, h, A, y = read(model, site, tokens, [(f"{site}.hook_alpha", set_alpha),
                                                               (f"{site}.hook_beta", set_beta)])
    assert (beta[:, 5:, 1::2] == beta_value).all()
    h_ref, y_ref = brute(q * q.shape[-1] ** -0.5, k, v, beta, alpha)
    close(y, y_ref, "y vs brute force")
    close(h, h_ref, "h vs brute force")
    close(einsum(A, v, "b h j i, b i h v -> b j h v"), y, "kernel @ v vs y")


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_lazy_hooks_are_sized_before_they_are_built_and_identity_is_exact(model_type):
    model, site = model_of(model_type, torch.float32), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    mixer = model.get_submodule(site)
    sizes = {n: model.hook_shape(f"{site}.hook_{n}", batch=2, pos=17) for n in ("h", "kernel", "alpha", "head_out")}
    s = mixer.spec
    assert sizes["h"] == (2, 17, s.n_heads, s.d_k, s.d_v) and sizes["kernel"] == (2, s.n_heads, 17, 17)
    assert sizes["alpha"] == ((2, 17, s.n_heads, s.d_k) if s.per_channel_decay else (2, 17, s.n_heads))
    assert sizes["head_out"] == (2, 17, s.n_heads, model.cfg.d_model)
    assert mixer.hook_h.lazy and mixer.hook_kernel.lazy and mixer.hook_head_out.lazy
    with torch.no_grad():
        with backends.use(attention="eager"):  # every hook below puts every layer on the exact path
            plain = model(tokens)
        _, bare = model.run_with_cache(tokens)
        assert f"{site}.hook_h" not in bare.keys() and f"{site}.hook_y" in bare.keys()
        with pytest.raises(CacheBudgetError, match="hook_kernel"):
            model.run_with_cache(tokens, names_filter=[f"{site}.hook_kernel"], max_cache_bytes=1000)
        every = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda x, hook: x.clone())])
    assert torch.equal(plain, every)


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_head_out_sums_to_the_mixer_output_and_zeroing_a_head_zeroes_its_out_proj_columns(model_type):
    model, site = model_of(model_type), DELTA[model_type]
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(6))
    block = site.rsplit(".", 1)[0]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[f"{site}.hook_head_out", f"{block}.hook_mixer_out"])
        close(cache[f"{site}.hook_head_out"].sum(2), cache[f"{block}.hook_mixer_out"], "sum of head writes")
        zero = lambda x, hook: torch.cat([x[:, :, :1] * 0, x[:, :, 1:]], dim=2)  # noqa: E731
        ablated = model.run_with_hooks(tokens, fwd_hooks=[(f"{site}.hook_head_out", zero)])
        d_v = model.get_submodule(site).spec.d_v
        model.get_submodule(site).out_proj.weight[:, :d_v] = 0
        ref = model(tokens)
    close(ablated, ref, "head 0 ablated")


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_incremental_logits_equal_full_recompute(model_type, padded):
    model = model_of(model_type)  # float64: one order of operations against another, exactly
    tokens = torch.randint(1, 64, (2, 75), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 75, dtype=torch.long)
    if padded:
        mask[1, :6] = 0
    with torch.no_grad():
        full = model(tokens, mask)
        state = DecodeState()
        parts = [model(tokens[:, :66], mask[:, :66], state=state)]  # a prefill past one chunk
        parts += [model(tokens[:, i:i + 1], state=state) for i in range(66, 72)]
        parts.append(model(tokens[:, 72:], state=state))  # three positions at once
        step = torch.cat(parts, dim=1)
    real = mask.bool()
    assert ((step - full)[real].abs().max() / full[real].abs().max()).item() < 1e-10
    assert state.length == 75


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_with_state_equals_without(model_type):
    model = model_of(model_type, torch.float32)
    prompt = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(8))
    fast = model.generate(prompt, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    slow = model.generate(prompt, max_new_tokens=6, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
    assert fast.shape == (2, 12) and torch.equal(fast, slow)


def test_lazy_delta_hooks_are_refused_while_decoding():
    model = model_of("qwen3_next", torch.float32)
    prompt = torch.randint(1, 64, (1, 5))
    for hook in ("hook_h", "hook_kernel"):
        with model.hooks(fwd_hooks=[(f"blocks.0.mixer.{hook}", lambda x, h: None)]):
            with pytest.raises(ValueError, match="use_past_kv_cache=False"):
                model.generate(prompt, max_new_tokens=2, do_sample=False, stop_at_eos=False)
            model.generate(prompt, max_new_tokens=2, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
