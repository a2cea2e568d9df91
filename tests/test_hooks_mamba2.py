"""Mamba-2 hook contract and interventions (DESIGN.md sections 3 and 4).

Contract: every documented mixer hook exists in every layer, fires once per forward in the
documented order with the documented shape; identity hooks leave logits bit-identical; the lazy
quantities (A_bar, B_bar, h, kernel, head_out) are not built without a hook.
Interventions (float64, 1e-10) are checked against `brute_mixer`, an independent loop over
positions written here from the parameters alone (no hooked.ops).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hooked.models.mamba2 as mamba2_module
from hooked.models.mamba2 import Mamba2Config, Mamba2Mixer
from hooked.models.families import build
from hooked.models.language_model import LanguageModel

TOL = dict(rtol=0, atol=1e-10)
BATCH, POS = 2, 19
CFG = Mamba2Config(n_layers=2, d_model=16, n_heads=4, d_head=8, d_state=8, n_groups=2, d_conv=4, chunk_size=8,
                   proj_bias=True, d_vocab=37)

# hook -> shape, in forward order (b = batch, l = pos)
MIXER_HOOKS = {
    "hook_in": lambda c, b, l: (b, l, c.d_inner + 2 * c.n_groups * c.d_state),
    "hook_gate": lambda c, b, l: (b, l, c.d_inner),
    "hook_conv": lambda c, b, l: (b, l, c.d_inner + 2 * c.n_groups * c.d_state),
    "hook_ssm_in": lambda c, b, l: (b, l, c.n_heads, c.d_head),
    "hook_dt": lambda c, b, l: (b, l, c.n_heads),
    "hook_B": lambda c, b, l: (b, l, c.n_groups, c.d_state),
    "hook_C": lambda c, b, l: (b, l, c.n_groups, c.d_state),
    "hook_A_bar": lambda c, b, l: (b, l, c.n_heads),
    "hook_B_bar": lambda c, b, l: (b, l, c.n_heads, c.d_state),
    "hook_h": lambda c, b, l: (b, l, c.n_heads, c.d_head, c.d_state),
    "hook_kernel": lambda c, b, l: (b, c.n_heads, l, l),
    "hook_y": lambda c, b, l: (b, l, c.n_heads, c.d_head),
    "hook_ssm_out": lambda c, b, l: (b, l, c.n_heads, c.d_head),
    "hook_gated": lambda c, b, l: (b, l, c.d_inner),
    "hook_head_out": lambda c, b, l: (b, l, c.n_heads, c.d_model),
}
LAZY = ["hook_A_bar", "hook_B_bar", "hook_h", "hook_kernel", "hook_head_out"]


def make_model(cfg: Mamba2Config = CFG, dtype: torch.dtype = torch.float64, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    model = build(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def tokens_for(cfg: Mamba2Config = CFG, batch: int = BATCH, pos: int = POS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ oracle
def brute_mixer(mix: Mamba2Mixer, x: torch.Tensor, edit=None, h_set=None, kernel_delta=None) -> dict:
    """The mixer as loops over positions. `edit(name, tensor_at_t, t)` may replace dt_t, A_bar_t or
    B_bar_t; h_set {t: [b h p n]} replaces the state after position t; kernel_delta
    [(b, head, j, i, delta)] adds delta * u_i to y_j."""
    batch, seq_len, _ = x.shape
    H, P, G, N, W = mix.n_heads, mix.d_head, mix.n_groups, mix.d_state, mix.conv_weight.shape[1]
    d_inner = H * P
    proj = x @ mix.in_proj.weight.T + (0 if mix.in_proj.bias is None else mix.in_proj.bias)
    z, xBC, dt_raw = proj[..., :d_inner], proj[..., d_inner:-H], proj[..., -H:]
    conv = torch.zeros_like(xBC)
    for t in range(seq_len):
        for k in range(W):  # tap k reads position t - (W - 1) + k
            if t - (W - 1) + k >= 0:
                conv[:, t] += mix.conv_weight[:, k] * xBC[:, t - (W - 1) + k]
    conv = conv + (0 if mix.conv_bias is None else mix.conv_bias)
    act = F.silu(conv)
    u = act[..., :d_inner].reshape(batch, seq_len, H, P)
    B = act[..., d_inner:d_inner + G * N].reshape(batch, seq_len, G, N)
    C = act[..., d_inner + G * N:].reshape(batch, seq_len, G, N)
    dt = F.softplus(dt_raw + mix.dt_bias).clamp(*mix.dt_limit)
    A = -torch.exp(mix.A_log)
    group = torch.arange(H) // (H // G)
    h = x.new_zeros(batch, H, P, N)
    states, ys, A_bars, B_bars = [], [], [], []
    for t in range(seq_len):
        dt_t = dt[:, t] if edit is None else edit("dt", dt[:, t], t)
        A_bar = torch.exp(dt_t * A) if edit is None else edit("A_bar", torch.exp(dt_t * A), t)  # [b h]
        B_bar = dt_t[..., None] * B[:, t, group]  # [b h n]
        B_bar = B_bar if edit is None else edit("B_bar", B_bar, t)
        h = A_bar[..., None, None] * h + u[:, t, :, :, None] * B_bar[:, :, None, :]
        if h_set is not None and t in h_set:
            h = h_set[t]
        states.append(h)
        A_bars.append(A_bar)
        B_bars.append(B_bar)
        ys.append((h * C[:, t, group][:, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    for b, head, j, i, delta in kernel_delta or []:
        y[b, j, head] += delta * u[b, i, head]
    ssm_out = y + mix.D[:, None] * u
    g = ssm_out.reshape(batch, seq_len, d_inner) * F.silu(z)
    g = g.reshape(batch, seq_len, G, d_inner // G)
    gated = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + mix.norm.eps)).reshape(batch, seq_len, d_inner)
    gated = gated * mix.norm.weight
    out = gated @ mix.out_proj.weight.T + (0 if mix.out_proj.bias is None else mix.out_proj.bias)
    return dict(out=out, h=torch.stack(states, 1), y=y, u=u, dt=dt, A_bar=torch.stack(A_bars, 1),
                B_bar=torch.stack(B_bars, 1), gated=gated)


def run_layer(model, tokens, layer, fwd_hooks=()):
    """(mixer input, mixer output, cache of that layer's mixer) of one run with `fwd_hooks`."""
    store = {}

    def save(x, hook):
        store[hook.name] = x.clone()

    names = [f"blocks.{layer}.ln1.hook_normalized", f"blocks.{layer}.hook_mixer_out"]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks) + [(n, save) for n in names])
    return store[names[0]], store[names[1]]


# ---------------------------------------------------------------------------------------- contract
def test_every_hook_exists_fires_once_with_its_shape():
    model = make_model()
    fired: dict[str, list] = {}
    with torch.no_grad():
        model.run_with_hooks(tokens_for(), fwd_hooks=[(lambda n: True, lambda x, hook: fired.setdefault(
            hook.name, []).append(tuple(x.shape)))])
    for layer in range(CFG.n_layers):
        for hook, shape in MIXER_HOOKS.items():
            name = f"blocks.{layer}.mixer.{hook}"
            assert name in model.hook_dict, name
            assert fired.get(name) == [shape(CFG, BATCH, POS)], name
    assert all(len(v) == 1 for v in fired.values())
    assert set(fired) == set(model.hook_dict)


def test_mixer_hook_order():
    order = [n.split(".")[-1] for n in make_model().hook_dict if n.startswith("blocks.0.mixer.")]
    assert order == list(MIXER_HOOKS)


@pytest.mark.parametrize("identity", ["none", "same", "clone"])
def test_identity_hooks_keep_logits_bit_identical(identity):
    model = make_model(dtype=torch.float32)
    tokens = tokens_for()
    fn = {"none": lambda x, hook: None, "same": lambda x, hook: x, "clone": lambda x, hook: x.clone()}[identity]
    with torch.no_grad():
        plain = model(tokens)
        hooked = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, fn)])
        _, cache = model.run_with_cache(tokens, incl_lazy=True)
    assert torch.equal(plain, hooked)
    assert len(cache) == len(model.hook_dict)


class ShapeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def count_calls(monkeypatch, names):
    calls = {n: 0 for n in names}
    for n in names:
        original = getattr(mamba2_module, n)

        def counted(*args, _n=n, _f=original, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(mamba2_module, n, counted)
    return calls


LAZY_FUNCS = ["linear_scan_heads", "mamba2_kernel_chunked", "mamba2_kernel_discrete"]


def test_lazy_quantities_not_built_without_hooks(monkeypatch):
    model = make_model(dtype=torch.float32)
    tokens = tokens_for()
    model.hook_dict  # records the hook order once (a run with every hook active) before counting
    calls = count_calls(monkeypatch, LAZY_FUNCS)
    recorder = ShapeRecorder()
    with torch.no_grad(), recorder:
        model(tokens)
        model.run_with_cache(tokens, names_filter=lambda n: not any(n.endswith(h) for h in LAZY))
    assert calls == {n: 0 for n in LAZY_FUNCS}
    for hook in ["hook_h", "hook_kernel", "hook_head_out"]:  # A_bar, B_bar share shapes with dt, heads(B)
        assert MIXER_HOOKS[hook](CFG, BATCH, POS) not in recorder.shapes, hook


@pytest.mark.parametrize("hook,expected", [
    ("hook_h", {"linear_scan_heads": 1, "mamba2_kernel_chunked": 0, "mamba2_kernel_discrete": 0}),
    ("hook_kernel", {"linear_scan_heads": 0, "mamba2_kernel_chunked": 1, "mamba2_kernel_discrete": 0}),
    ("hook_A_bar", {"linear_scan_heads": 0, "mamba2_kernel_chunked": 0, "mamba2_kernel_discrete": 0}),
])
def test_one_lazy_hook_builds_only_its_quantity(monkeypatch, hook, expected):
    model = make_model(dtype=torch.float32)
    model.hook_dict  # records the hook order once (a run with every hook active) before counting
    calls = count_calls(monkeypatch, LAZY_FUNCS)
    with torch.no_grad():
        model.run_with_cache(tokens_for(), names_filter=f"blocks.1.mixer.{hook}")
    assert calls == expected


# ------------------------------------------------------------------------------------ values
def test_cached_quantities_equal_brute_force():
    model = make_model()
    tokens = tokens_for()
    _, cache = model.run_with_cache(tokens, incl_lazy=True)
    for layer in range(CFG.n_layers):
        ref = brute_mixer(model.blocks[layer].mixer, cache[f"blocks.{layer}.ln1.hook_normalized"])
        pre = f"blocks.{layer}.mixer."
        for ours, theirs in [("hook_h", "h"), ("hook_y", "y"), ("hook_ssm_in", "u"), ("hook_dt", "dt"),
                             ("hook_A_bar", "A_bar"), ("hook_B_bar", "B_bar"), ("hook_gated", "gated")]:
            torch.testing.assert_close(cache[pre + ours], ref[theirs], **TOL, msg=lambda m: f"{ours}: {m}")
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_mixer_out"], ref["out"], **TOL)


@pytest.mark.parametrize("pos", [1, 8, 19, 33])
def test_kernel_reconstructs_y(pos):
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(pos=pos), names_filter=lambda n: n.split(".")[-1] in (
        "hook_kernel", "hook_ssm_in", "hook_y"))
    for layer in range(CFG.n_layers):
        pre = f"blocks.{layer}.mixer."
        kernel, u = cache[pre + "hook_kernel"], cache[pre + "hook_ssm_in"]
        assert torch.equal(kernel.triu(1), torch.zeros_like(kernel))  # causal: zero for source > target
        y = torch.einsum("bhji,bihp->bjhp", kernel, u)
        torch.testing.assert_close(y, cache[pre + "hook_y"], **TOL)


def test_head_out_sums_to_mixer_out():
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(), names_filter=lambda n: "head_out" in n or "mixer_out" in n)
    for layer in range(CFG.n_layers):
        summed = cache[f"blocks.{layer}.mixer.hook_head_out"].sum(2) + model.blocks[layer].mixer.out_proj.bias
        torch.testing.assert_close(summed, cache[f"blocks.{layer}.hook_mixer_out"], **TOL)


# ------------------------------------------------------------------------------- interventions
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("positions", [(0,), (6,), (18,), (3, 11)])
def test_state_edit_propagates_like_the_recurrence(positions, in_place):
    model, tokens, layer = make_model(), tokens_for(), 1
    g = torch.Generator().manual_seed(5)
    deltas = {t: torch.randn(BATCH, CFG.n_heads, CFG.d_head, CFG.d_state, generator=g, dtype=torch.float64)
              for t in positions}

    def edit(h, hook):
        if in_place:
            for t, d in deltas.items():
                h[:, t] += d
            return None
        h = h.clone()
        for t, d in deltas.items():
            h[:, t] += d
        return h

    x, out = run_layer(model, tokens, layer, [(f"blocks.{layer}.mixer.hook_h", edit)])
    clean = brute_mixer(model.blocks[layer].mixer, x)["h"]  # the hook received these: edited ones are set
    ref = brute_mixer(model.blocks[layer].mixer, x, h_set={t: clean[:, t] + d for t, d in deltas.items()})
    torch.testing.assert_close(out, ref["out"], **TOL)
    assert not torch.allclose(out, brute_mixer(model.blocks[layer].mixer, x)["out"], atol=1e-3)


@pytest.mark.parametrize("b,head,j,i", [(0, 0, 5, 2), (1, 3, 18, 0), (0, 2, 9, 9), (1, 1, 12, 4)])
def test_single_kernel_entry_edit(b, head, j, i):
    model, tokens, layer, delta = make_model(), tokens_for(), 0, 0.75

    def edit(kernel, hook):
        kernel = kernel.clone()
        kernel[b, head, j, i] += delta
        return kernel

    x, out = run_layer(model, tokens, layer, [(f"blocks.{layer}.mixer.hook_kernel", edit)])
    ref = brute_mixer(model.blocks[layer].mixer, x, kernel_delta=[(b, head, j, i, delta)])
    torch.testing.assert_close(out, ref["out"], **TOL)
    changed = (out - brute_mixer(model.blocks[layer].mixer, x)["out"]).abs().amax(-1) > 1e-8
    assert changed.nonzero().tolist() == [[b, j]]


@pytest.mark.parametrize("name", ["dt", "A_bar", "B_bar"])
def test_discrete_edits_feed_the_recurrence(name):
    model, tokens, layer, t_edit = make_model(), tokens_for(), 1, 7
    g = torch.Generator().manual_seed(3)
    factor = 1 + torch.rand(BATCH, *MIXER_HOOKS[f"hook_{name}"](CFG, 1, 1)[2:], generator=g, dtype=torch.float64)

    def edit(value, hook):
        value = value.clone()
        value[:, t_edit] *= factor
        return value

    def brute_edit(what, value, t):
        return value * factor if what == name and t == t_edit else value

    x, out = run_layer(model, tokens, layer, [(f"blocks.{layer}.mixer.hook_{name}", edit)])
    ref = brute_mixer(model.blocks[layer].mixer, x, edit=brute_edit)
    torch.testing.assert_close(out, ref["out"], **TOL)


def _flip_one_a_bar(a_bar, hook):
    a_bar = a_bar.clone()
    a_bar[:, 3, 1] = -a_bar[:, 3, 1]
    return a_bar


DISCRETE_EDITS = {  # hook, edit: B_bar and halved A_bar take the chunked kernel, a negative A_bar the slow one
    "B_bar_doubled": ("hook_B_bar", lambda b_bar, hook: b_bar * 2),
    "A_bar_halved": ("hook_A_bar", lambda a_bar, hook: a_bar / 2),
    "A_bar_negative": ("hook_A_bar", _flip_one_a_bar),
}


@pytest.mark.parametrize("name", DISCRETE_EDITS)
def test_edited_discrete_tensors_give_the_matching_kernel(name):
    """With A_bar or B_bar edited, hook_kernel is built from the edited tensors and still reconstructs y."""
    model, tokens = make_model(), tokens_for()
    hook, edit = DISCRETE_EDITS[name]
    hooks = [(f"blocks.0.mixer.{hook}", edit)]
    with model.hooks(hooks):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mixer."))
    y = torch.einsum("bhji,bihp->bjhp", cache["blocks.0.mixer.hook_kernel"], cache["blocks.0.mixer.hook_ssm_in"])
    torch.testing.assert_close(y, cache["blocks.0.mixer.hook_y"], **TOL)


def test_zeroing_a_head_out_equals_zeroing_its_out_proj_columns():
    model, tokens, layer, head = make_model(), tokens_for(), 1, 2

    def ablate(head_out, hook):
        head_out = head_out.clone()
        head_out[:, :, head] = 0
        return head_out

    with torch.no_grad():
        ablated = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.mixer.hook_head_out", ablate)])
        W = model.blocks[layer].mixer.out_proj.weight
        cols = slice(head * CFG.d_head, (head + 1) * CFG.d_head)
        saved = W[:, cols].clone()
        W[:, cols] = 0
        try:
            reference = model(tokens)
        finally:
            W[:, cols] = saved
    torch.testing.assert_close(ablated, reference, **TOL)


def test_config_checks_sizes():
    with pytest.raises(ValueError, match="d_inner"):
        Mamba2Config(n_layers=1, d_model=8, n_heads=4, d_head=8, d_inner=16)
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2Config(n_layers=1, d_model=8, n_heads=3, d_head=8, n_groups=2)
