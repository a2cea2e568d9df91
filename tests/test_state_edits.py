"""Edits of a recurrent state (hook_h) SET the state where they differ, and the recurrence continues (float64).

For every family with a state-bearing mixer (Mamba-1 and its variants, Mamba-2 and Llamba's discrete
Mamba-2, the gated delta rule, KDA, MiniMax's lightning attention), against a sequential
float64 reference written here that REPLACES the state at the set entries (hooked/state_edit.py):
edits at one, two and every position, at some entries only, in place; a whole trajectory patched from
another prompt runs on exactly that prompt's states; a second hook on the same point sees the continued
states; an additive edit at one position is unchanged; `act_patch` over hook_h by position equals
single-position patches by hand; an SAE spliced into the states at several positions follows the same
meaning. The old meaning (differences added to the clean trajectory) is checked to differ, so that the
tests can tell the two apart.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from einops import einsum
from test_sae import TinySAE
from tiny_families import tiny

from analysis.interventions import act_patch

BATCH, POS = 2, 11
TOL = 1e-12


# ------------------------------------------------------------------ references, one position at a time
def mamba1_states(q, A, edit):
    """h_t = exp(dt A) h_{t-1} + dt B u_t, then h_t = edit(t, h_t); y_t = C_t . h_t."""
    u, dt, B, C = q["hook_ssm_in"], q["hook_dt"], q["hook_B"], q["hook_C"]
    if B.ndim == 4:  # grouped (Zamba): B, C [b l n_groups n], each channel reads its group's
        B, C = (x.repeat_interleave(u.shape[2] // x.shape[2], dim=2) for x in (B, C))
    else:
        B, C = B[:, :, None, :], C[:, :, None, :]
    h = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])
    hs, ys = [], []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t] * u[:, t, :, None]
        h = edit(t, h)
        hs.append(h)
        ys.append((h * C[:, t]).sum(-1))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def mamba2_states(q, A, edit):
    """Per head: h_t = exp(dt A) h_{t-1} + dt u_t B_t^T (B, C of the head's group), then edit; y_t = h_t C_t."""
    u, dt, B, C = q["hook_ssm_in"], q["hook_dt"], q["hook_B"], q["hook_C"]
    n_heads, n_groups = u.shape[2], B.shape[2]
    group = torch.arange(n_heads) // (n_heads // n_groups)
    h = u.new_zeros(u.shape[0], n_heads, u.shape[3], B.shape[3])
    hs, ys = [], []
    for t in range(u.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + dt[:, t, :, None, None] * u[:, t, :, :, None] * B[:, t, group][:, :, None, :]
        h = edit(t, h)
        hs.append(h)
        ys.append((h * C[:, t, group][:, :, None, :]).sum(-1))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def delta_states(q, A, edit):
    """S <- Diag(alpha) S; S <- S + beta k (v - S^T k)^T; then edit; y = S^T q (q read times d_k^-1/2)."""
    v, beta, alpha = q["hook_v"], q["hook_beta"], q["hook_alpha"]
    n_heads = v.shape[2]
    qh, kh = (x.repeat_interleave(n_heads // x.shape[2], dim=2) for x in (q["hook_q"], q["hook_k"]))
    qh = qh * qh.shape[-1] ** -0.5
    S = v.new_zeros(v.shape[0], n_heads, kh.shape[-1], v.shape[-1])
    hs, ys = [], []
    for t in range(v.shape[1]):
        a = alpha[:, t]
        S = S * (a[..., None, None] if a.ndim == 2 else a[..., None])
        read = einsum(S, kh[:, t], "b h c v, b h c -> b h v")
        S = S + einsum(kh[:, t], beta[:, t, :, None] * (v[:, t] - read), "b h c, b h v -> b h c v")
        S = edit(t, S)
        hs.append(S)
        ys.append(einsum(S, qh[:, t], "b h c v, b h c -> b h v"))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def lightning_states(q, A, edit):
    """Per head: S <- exp(A) S + k v^T (MiniMax's lightning attention, A = -slope), then edit; y = S^T q."""
    qh, kh, v = q["hook_q"], q["hook_k"], q["hook_v"]
    S = v.new_zeros(v.shape[0], v.shape[2], kh.shape[-1], v.shape[-1])
    hs, ys = [], []
    for t in range(v.shape[1]):
        S = torch.exp(A)[:, None, None] * S + einsum(kh[:, t], v[:, t], "b h c, b h v -> b h c v")
        S = edit(t, S)
        hs.append(S)
        ys.append(einsum(S, qh[:, t], "b h c v, b h c -> b h v"))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def rg_lru_states(q, A, edit):
    """Per channel: h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t x_t (RecurrentGemma's RG-LRU; a = 0 at position 0),
    then edit; y = h."""
    a, i, x = q["hook_a"], q["hook_input_gate"], q["hook_x"]
    h = x.new_zeros(x.shape[0], x.shape[2], 1)
    hs, ys = [], []
    for t in range(x.shape[1]):
        h = a[:, t, :, None] * h + (torch.sqrt(1 - a[:, t] ** 2) * i[:, t] * x[:, t])[..., None]
        h = edit(t, h)
        hs.append(h)
        ys.append(h[..., 0])
    return torch.stack(hs, 1), torch.stack(ys, 1)


def rwkv_states(q, A, edit):
    """Per channel (a, b): a_t = e^w a_{t-1} + e^{k_t} v_t, b_t = e^w b_{t-1} + e^{k_t} (RWKV-4's WKV, w = A), then
    edit; y_t = (a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t}) reads the state before t (u: the mixer's bonus)."""
    model, where, _ = site("rwkv")
    u, k, v = model.get_submodule(where).time_first, q["hook_k"], q["hook_v"]
    h = k.new_zeros(k.shape[0], k.shape[2], 2)
    hs, ys = [], []
    for t in range(k.shape[1]):
        bonus = torch.exp(u + k[:, t])
        ys.append((h[..., 0] + bonus * v[:, t]) / (h[..., 1] + bonus))
        h = torch.exp(A)[:, None] * h + torch.exp(k[:, t])[..., None] * torch.stack([v[:, t], torch.ones_like(v[:, t])], -1)
        h = edit(t, h)
        hs.append(h)
    return torch.stack(hs, 1), torch.stack(ys, 1)


def mlstm_states(q, A, edit):
    """Per head (xLSTM's mLSTM, no stabiliser): C <- f C + exp(i) k v^T, n <- f n + exp(i) k, m <- max(log f + m, i),
    then edit C; y = C^T q / (max(|n . q|, 1) + eps exp(m)) (q read times d_qk^-1/2; eps: the tiny config's 1e-6)."""
    qh, kh, v, log_i, log_f = q["hook_q"] * q["hook_q"].shape[-1] ** -0.5, q["hook_k"], q["hook_v"], q["hook_i"], q["hook_log_f"]
    C = v.new_zeros(v.shape[0], v.shape[2], kh.shape[-1], v.shape[-1])
    n, m = v.new_zeros(C.shape[:-1]), v.new_zeros(v.shape[0], v.shape[2])
    hs, ys = [], []
    for t in range(v.shape[1]):
        f, i = torch.exp(log_f[:, t]), torch.exp(log_i[:, t])
        C = f[..., None, None] * C + i[..., None, None] * einsum(kh[:, t], v[:, t], "b h c, b h v -> b h c v")
        n, m = f[..., None] * n + i[..., None] * kh[:, t], torch.maximum(log_f[:, t] + m, log_i[:, t])
        C = edit(t, C)
        hs.append(C)
        denom = einsum(n, qh[:, t], "b h c, b h c -> b h").abs().clamp_min(1.0) + 1e-6 * torch.exp(m)
        ys.append(einsum(C, qh[:, t], "b h c v, b h c -> b h v") / denom[..., None])
    return torch.stack(hs, 1), torch.stack(ys, 1)


INPUTS = {mamba1_states: ("ssm_in", "dt", "B", "C"), mamba2_states: ("ssm_in", "dt", "B", "C"),
          delta_states: ("q", "k", "v", "beta", "alpha"), lightning_states: ("q", "k", "v")}


REFERENCES = {("d_inner", "d_state"): mamba1_states, ("d_head", "d_state"): mamba2_states,
              ("d_k", "d_v"): delta_states, ("lru_width", "d_state"): rg_lru_states, ("d_key", "d_value"): lightning_states,
              ("att_width", "num_den"): rwkv_states}
REFERENCES[("d_qk", "d_v")] = mlstm_states


@functools.cache
def site(name: str):
    """(model in float64, its last mixer with a state hook, the reference for that hook's recurrence)."""
    model = copy.deepcopy(tiny(name)).double()
    where = [n for n in model.hook_dict if n.endswith("mixer.hook_h")][-1].removesuffix(".hook_h")
    return model, where, REFERENCES[tuple(model.hook_dict[f"{where}.hook_h"].axes[-2:])]


SITES = ["mamba", "falcon_mamba", "jamba", "mamba2", "zamba2", "bamba", "granite", "falcon_h1", "nemotron_h",
         "llamba", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "recurrent_gemma", "minimax",
         "rwkv", "zamba", "xlstm", "qwen4_exp"]


def tokens(seed: int = 0, pos: int = POS):
    return torch.randint(1, 64, (BATCH, pos), generator=torch.Generator().manual_seed(seed))


def run(model, where, edits, toks=None):
    """The edited run's mixer inputs, its hook_y, and hook_h as a later hook sees it."""
    q: dict = {}

    def save(x, hook):
        q[hook.name.rsplit(".", 1)[1]] = x.clone()
    names = [f"{where}.hook_{n}" for n in ("ssm_in", "dt", "B", "C", "q", "k", "v", "beta", "alpha", "x", "a", "input_gate", "y", "i", "log_f")]
    hooks = [(n, save) for n in names if n in model.hook_dict]
    with torch.no_grad():
        model.run_with_hooks(tokens() if toks is None else toks,
                             fwd_hooks=[*[(f"{where}.hook_h", e) for e in edits], (f"{where}.hook_h", save), *hooks])
    return q


def reference(name, q, edit):
    model, where, states = site(name)
    A = model.get_submodule(where).A().to(torch.float64) if states is not delta_states else None
    return states(q, A, edit)


def close(got, want, what):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=TOL * scale, msg=lambda m: f"{what}: {m}")


def clean_states(name, toks=None):
    model, where, _ = site(name)
    return run(model, where, [], toks)["hook_h"]


# ------------------------------------------------------------------ the meaning: set, then continue
def setter(values, mask):
    """A hook returning the received states with `mask`'s entries replaced by `values` (a new tensor)."""
    def fn(h, hook):
        return torch.where(mask, values, h)
    return fn


def set_ref(values, mask):
    return lambda t, h: torch.where(mask[:, t], values[:, t], h)


def masks(name, kind):
    h = clean_states(name)
    g = torch.Generator().manual_seed(7)
    values = torch.randn(h.shape, generator=g, dtype=h.dtype)
    mask = torch.zeros(h.shape, dtype=torch.bool)
    if kind == "one":
        mask[:, 6] = True
    elif kind == "zero_5_and_8":  # the case: zero h at positions 5 and 8
        mask[:, [5, 8]] = True
        values = torch.zeros_like(values)
    elif kind == "every":
        mask[:] = True
    elif kind == "entries":  # one unit at 5, another at 8, part of a third's entries at 2
        mask[0, 5, 0] = True
        mask[:, 8, 1] = True
        mask[1, 2, -1, ..., :1] = True
    return values, mask


@pytest.mark.parametrize("kind", ["one", "zero_5_and_8", "every", "entries"])
@pytest.mark.parametrize("name", SITES)
def test_set_states_equal_the_replacing_recurrence(name, kind):
    model, where, _ = site(name)
    values, mask = masks(name, kind)
    q = run(model, where, [setter(values, mask)])
    h_ref, y_ref = reference(name, q, set_ref(values, mask))
    close(q["hook_h"], h_ref, "states a later hook sees")
    close(q["hook_y"], y_ref, "y")
    assert torch.equal(q["hook_h"][mask], values[mask])  # a set entry is the value returned, to the bit


@pytest.mark.parametrize("name", SITES)
def test_two_set_positions_differ_from_adding_differences(name):
    """The old meaning (h + scan(A_bar, h' - h)) leaves h_6 != 0 after zeroing 5 and 6: the tests tell them apart."""
    model, where, _ = site(name)
    mask = torch.zeros(clean_states(name).shape, dtype=torch.bool)
    mask[:, [5, 6]] = True
    q = run(model, where, [setter(torch.zeros(mask.shape, dtype=torch.float64), mask)])
    assert not q["hook_h"][:, [5, 6]].any()
    clean = clean_states(name)
    added, _ = reference(name, q, lambda t, h: h - clean[:, t] if t in (5, 6) else h)
    assert added[:, 6].abs().max() > 1e-6 * clean[:, 6].abs().max()  # far above the tests' 1e-12


@pytest.mark.parametrize("name", SITES)
def test_in_place_edits_at_two_positions(name):
    model, where, _ = site(name)
    values, mask = masks(name, "zero_5_and_8")

    def zero(h, hook):
        h[:, [5, 8]] = 0
    q = run(model, where, [zero])
    h_ref, y_ref = reference(name, q, set_ref(values, mask))
    close(q["hook_y"], y_ref, "y")
    close(q["hook_h"], h_ref, "states")


@pytest.mark.parametrize("name", SITES)
def test_a_whole_trajectory_from_another_prompt_runs_on_exactly_those_states(name):
    model, where, _ = site(name)
    other = clean_states(name, tokens(seed=3))
    q = run(model, where, [lambda h, hook: other])
    assert torch.equal(q["hook_h"], other)
    _, y_ref = reference(name, q, lambda t, h: other[:, t])
    close(q["hook_y"], y_ref, "y read from the other prompt's states")


@pytest.mark.parametrize("name", SITES)
def test_a_second_hook_sees_the_continued_states_and_its_edits_keep_the_first_hooks(name):
    """Hook 1 sets position 8; hook 2 receives the states hook 1 left and sets position 3: position 8 stays set."""
    model, where, _ = site(name)
    values, _ = masks(name, "one")
    first = torch.zeros(values.shape, dtype=torch.bool)
    first[:, 8] = True
    second = torch.zeros_like(first)
    second[:, 3] = True
    seen = {}

    def look(h, hook):
        seen["h"] = h.clone()
        return torch.where(second, -values, h)
    q = run(model, where, [setter(values, first), look])
    after_first, _ = reference(name, q, set_ref(values, first))
    close(seen["h"], after_first, "what the second hook received")
    both = first | second
    h_ref, y_ref = reference(name, q, set_ref(torch.where(first, values, -values), both))
    close(q["hook_h"], h_ref, "states after both")
    close(q["hook_y"], y_ref, "y after both")


@pytest.mark.parametrize("name", SITES)
def test_an_additive_edit_at_one_position_continues_from_the_edited_state(name):
    model, where, _ = site(name)
    values, _ = masks(name, "one")

    def add(h, hook):
        h = h.clone()
        h[:, 4] += values[:, 4]
        return h
    q = run(model, where, [add])
    h_ref, y_ref = reference(name, q, lambda t, h: h + values[:, 4] if t == 4 else h)
    close(q["hook_y"], y_ref, "y")
    close(q["hook_h"], h_ref, "states")


# ------------------------------------------------------------------ analyses that write states
@pytest.mark.parametrize("name", ["mamba", "mamba2", "qwen3_next"])
def test_act_patch_over_states_by_position_equals_single_position_patches(name):
    model, where, _ = site(name)
    layer = int(where.split(".")[1])
    clean, corrupt = tokens(seed=1), tokens(seed=2)
    hook = f"{where}.hook_h"
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=[hook])

    def metric(logits):
        return logits[:, -1, 3].mean()
    got = act_patch(model, corrupt, cache, metric, "blocks.{layer}.mixer.hook_h", over=("layer", "pos"),
                    layers=[layer])
    for t in range(POS):
        def one(h, hook, t=t):
            h = h.clone()
            h[:, t] = cache[hook.name][:, t]
            return h
        with torch.no_grad():
            by_hand = metric(model.run_with_hooks(corrupt, fwd_hooks=[(hook, one)]))
        torch.testing.assert_close(got[layer, t].to(by_hand.dtype), by_hand, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_an_sae_spliced_at_several_positions_sets_the_states_there(name):
    """The splice reads the states it receives (the clean ones) and its outputs at 2 and 7 are set."""
    model, where, _ = site(name)
    hook = f"{where}.hook_h"
    clean = clean_states(name)
    d_in = clean[0, 0].numel()
    sae = TinySAE(d_in, 8).double()
    model.add_sae(sae, hook, positions=[2, 7])
    try:
        q = run(model, where, [])
    finally:
        model.reset_saes()
    spliced = sae.decode(sae.encode(clean.flatten(2))).view(clean.shape)
    mask = torch.zeros(clean.shape, dtype=torch.bool)
    mask[:, [2, 7]] = True
    _, y_ref = reference(name, q, set_ref(spliced, mask))
    close(q["hook_y"], y_ref, "y after the splice")


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_the_heads_view_sets_states_as_hook_h_does(name):
    """hook_h.hook_heads ([batch pos heads rest], a tap of hook_h): positions 5 and 8 zeroed there == on hook_h."""
    model, where, _ = site(name)

    def zero(h, hook):
        h = h.clone()
        h[:, [5, 8]] = 0
        return h
    direct = run(model, where, [zero])
    with torch.no_grad(), model.hooks(fwd_hooks=[(f"{where}.hook_h.hook_heads", zero)]):
        via_view = run(model, where, [])
    close(via_view["hook_y"], direct["hook_y"], "y")


@pytest.mark.parametrize("name", ["mamba", "mamba2", "qwen3_next"])
def test_a_patched_unit_is_set_whole_even_where_an_entry_equals_the_received_one(name):
    """Float32 states of two prompts share an entry now and then by chance: the unit (head, channel) is set as a
    whole, so a whole trajectory from elsewhere is still run on exactly, that entry included."""
    model, where, _ = site(name)
    clean = clean_states(name)
    other = clean_states(name, tokens(seed=3)).clone()
    other[0, 7, 1].view(-1)[0] = clean[0, 7, 1].view(-1)[0]  # one entry equal to what the hook receives
    q = run(model, where, [lambda h, hook: other])
    assert torch.equal(q["hook_h"], other)
    _, y_ref = reference(name, q, lambda t, h: other[:, t])
    close(q["hook_y"], y_ref, "y read from the other prompt's states")
