"""knockout() against references written here, independent of the library's kernel code.

Glossary: edge (target j, source i); K[j, i] the SSM kernel; a cut edge's term K[j, i] u_i is what
the brute-force recurrence below leaves out (it never adds the source's input B_bar_i u_i to the
state read at the target). Every model is a tiny random HF model converted with from_hf, float64.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from analysis.interventions.knockout import (decay_norms, decay_split, feature_knockout, feature_plan, knockout,
                               knockout_sites)
from hooked import backends
from hooked.models.families import build as build_model
from loaders.load import from_hf

V, L = 64, 11
CONFIGS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=3, n_head=2, n_positions=64, attn_implementation="eager")),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager")),
    "mamba1": lambda: transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=3, expand=2, conv_kernel=4, time_step_rank=4)),
    "falcon_mamba": lambda: transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
        vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=3, expand=2, conv_kernel=4, time_step_rank=4)),
    "mamba2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=V, hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=2, expand=2, chunk_size=4,
        num_hidden_layers=3)),
    "zamba2": lambda: transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        vocab_size=V, hidden_size=16, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=4, mamba_headdim=8, n_mamba_heads=4, mamba_ngroups=2, mamba_expand=2, chunk_size=4,
        num_attention_heads=2, num_key_value_heads=2, attention_head_dim=8, intermediate_size=32,
        num_mem_blocks=1, use_mem_rope=True, pad_token_id=0, initializer_range=0.2, attn_implementation="eager")),
}
ATTN, SSM = ("gpt2", "llama", "zamba2"), ("mamba1", "falcon_mamba", "mamba2", "zamba2")
_CACHE: dict[str, object] = {}


def build(name: str):
    """from_hf of a tiny random HF model in float64; skipped while that architecture has not landed."""
    if name not in _CACHE:
        torch.manual_seed(0)
        try:
            hf = CONFIGS[name]().eval().double()
            model = from_hf(hf)
        except (ValueError, ImportError, AttributeError) as e:
            if "unknown architecture" in str(e) or isinstance(e, (ImportError, AttributeError)):
                pytest.skip(f"{name} not available yet: {e}")
            raise
        _CACHE[name] = model
    return _CACHE[name]


def tokens(batch: int = 2, pos: int = L, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))


def masks(spec, batch: int, pos: int) -> torch.Tensor:
    if torch.is_tensor(spec):
        return spec
    m = torch.zeros(batch, pos, dtype=torch.bool)
    m[:, [p % pos for p in spec]] = True
    return m


# ----------------------------------------------------------------------- references (by hand)
def attention_reference(model, layers, sources, targets, mode: str):
    """An additive -inf mask on hook_attn_scores ("scores") or zeroed hook_pattern entries ("pattern")."""
    def fn(x, hook):
        cut = (masks(targets, *x.shape[:1], x.shape[-1])[:, :, None] & masks(sources, x.shape[0], x.shape[-1])[:, None, :])
        add = torch.zeros(cut.shape, dtype=x.dtype).masked_fill(cut, float("-inf"))[:, None]
        return x + add if mode == "scores" else x * (~cut[:, None]).to(x.dtype)
    suffix = "hook_attn_scores" if mode == "scores" else "hook_pattern"
    return [(n, fn) for n in model.hook_dict for l in layers
            if n.startswith(f"blocks.{l}.") and n.endswith("attn." + suffix)]


def ssm_reference(model, layers, sources, targets, channels=None, conv=False):
    """y at each target from a recurrence that never adds the cut sources' input; the conv by hand."""
    seen, hooks = {}, []
    for l in layers:
        for site in knockout_sites(model, l)[1]:
            mixer = model.get_submodule(site)
            A = -torch.exp(mixer.A_log.detach())
            hooks += [(f"{site}.hook_{k}", (lambda k, site: lambda x, hook: seen.__setitem__((site, k), x))(k, site))
                      for k in ("in", "ssm_in", "dt", "B", "C")]
            hooks.append((f"{site}.hook_y", _y_hook(seen, site, A, sources, targets, channels)))
            if conv:
                hooks.append((f"{site}.hook_conv", _conv_hook(seen, site, mixer, sources, targets, channels)))
    order = list(model.hook_dict)
    return sorted(hooks, key=lambda h: order.index(h[0]))


def _chan(channels, n):
    if channels is None:
        return torch.ones(n, dtype=torch.bool)
    c = torch.as_tensor(channels)
    return c if c.dtype == torch.bool else torch.zeros(n, dtype=torch.bool).index_fill(0, c.long(), True)


def _y_hook(seen, site, A, sources, targets, channels):
    def fn(y, hook):
        u, dt, B, C = (seen[site, k] for k in ("ssm_in", "dt", "B", "C"))
        batch, pos = y.shape[:2]
        t, s = masks(targets, batch, pos), masks(sources, batch, pos)
        out = y.clone()
        chan = _chan(channels, A.shape[0])
        for b in range(batch):
            for j in t[b].nonzero()[:, 0].tolist():
                y_j = _recurrence(u[b], dt[b], B[b], C[b], A, j, skip=set(s[b].nonzero()[:, 0].tolist()))
                out[b, j, chan] = y_j[chan]
        return out
    return fn


def _recurrence(u, dt, B, C, A, j, skip):
    """C_j . h_j with h_t = exp(dt_t A) h_{t-1} + [t not in skip] dt_t B_t u_t, per channel or head."""
    if u.ndim == 2:  # Mamba-1: u [pos d], dt [pos d], B, C [pos n], A [d n]
        h = torch.zeros_like(A)
        for t in range(j + 1):
            h = torch.exp(dt[t][:, None] * A) * h
            if t not in skip:
                h = h + dt[t][:, None] * B[t][None, :] * u[t][:, None]
        return (h * C[j][None, :]).sum(-1)
    H, P = u.shape[1:]  # Mamba-2: u [pos H P], dt [pos H], B, C [pos G N], A [H]
    G, N = B.shape[1:]
    grp = torch.arange(H) // (H // G)
    h = torch.zeros(H, P, N, dtype=u.dtype)
    for t in range(j + 1):
        h = torch.exp(dt[t] * A)[:, None, None] * h
        if t not in skip:
            h = h + dt[t][:, None, None] * u[t][:, :, None] * B[t][grp][:, None, :]
    return torch.einsum("hpn,hn->hp", h, C[j][grp])


def _conv_hook(seen, site, mixer, sources, targets, channels):
    """The causal conv at each target recomputed tap by tap, leaving out the sources' taps on the conv
    channels of the cut channels/heads (Mamba-2's shared B, C channels only when channels is None)."""
    w = next(p for n, p in mixer.named_parameters() if "conv" in n and n.endswith("weight")).detach()
    w = w.reshape(w.shape[0], -1)
    bias = next((p.detach() for n, p in mixer.named_parameters() if "conv" in n and n.endswith("bias")), None)
    n_conv, width = w.shape
    d_inner, n_c = mixer.out_proj.in_features, mixer.A_log.shape[0]
    cut_chan = torch.ones(n_conv, dtype=torch.bool)
    if channels is not None:
        cut_chan[:] = False
        cut_chan[:d_inner] = _chan(channels, n_c).repeat_interleave(d_inner // n_c)

    def fn(conv, hook):
        x = seen[site, "in"]
        batch, pos = conv.shape[:2]
        t, s = masks(targets, batch, pos), masks(sources, batch, pos)
        out = conv.clone()
        for b in range(batch):
            for j in t[b].nonzero()[:, 0].tolist():
                val = torch.zeros(n_conv, dtype=conv.dtype) if bias is None else bias.clone()
                for k in range(width):
                    i = j - (width - 1) + k
                    if i >= 0:
                        val = val + w[:, k] * x[b, i] * (~(cut_chan & s[b, i])).to(x.dtype)
                out[b, j] = val
        return out
    return fn


def run(model, toks, hooks=()):
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        return model(toks)


def close(actual, expected, tol=1e-10):
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual, expected, atol=tol * scale, rtol=tol)


def random_mask(batch, pos, p, seed, allow_first=True):
    m = torch.rand(batch, pos, generator=torch.Generator().manual_seed(seed)) < p
    if not allow_first:
        m[:, 0] = False
    return m


# -------------------------------------------------------------------------- SSM brute force
SSM_CASES = [  # model, layers, sources, targets, channels, cut_conv
    ("mamba1", [1], [2, 3], [-1], None, False),
    ("mamba1", [0, 1, 2], [0, 4, 5], [6, -1], None, False),
    ("mamba1", [1, 2], [-1], [-1], None, False),  # the self edge
    ("mamba1", [1], random_mask(2, L, 0.4, 1), random_mask(2, L, 0.3, 2), [0, 5, 7], False),
    ("mamba1", [0, 2], [7, 8], [9, -1], None, True),
    ("mamba1", [1], [8, 9], [-1, 9], [1, 2], True),
    ("falcon_mamba", [1, 2], [2, 3], [-1], None, False),
    ("mamba2", [1], [2, 3], [-1], None, False),
    ("mamba2", [0, 1, 2], [0, 4, 5], [6, -1], None, False),
    ("mamba2", [2], [-1], [-1], None, False),
    ("mamba2", [1], random_mask(2, L, 0.4, 3), random_mask(2, L, 0.3, 4), [1, 3], False),
    ("mamba2", [0, 1], [7, 8], [9, -1], None, True),
    ("mamba2", [2], [8, 9], [-1], torch.tensor([True, False, False, True]), True),
    ("zamba2", [0, 2], [2, 3], [-1], None, False),
    ("zamba2", [0], [8, 9], [-1], [0, 2], True),
]


@pytest.mark.parametrize("name, layers, sources, targets, channels, conv", SSM_CASES)
def test_ssm_knockout_equals_brute_force_recurrence(name, layers, sources, targets, channels, conv):
    model = build(name)
    toks = tokens()
    clean = run(model, toks)
    with torch.no_grad(), knockout(model, sources, targets, layers, channels=channels, cut_conv=conv):
        cut = model(toks)
    expected = run(model, toks, ssm_reference(model, layers, sources, targets, channels, conv))
    close(cut, expected)
    assert (cut - clean).abs().max() > 1e-6  # the cut does something


@pytest.mark.parametrize("name", ["mamba1", "mamba2"])
def test_ssm_knockout_equals_zeroed_hook_kernel(name):
    model = build(name)
    toks, layers, src, tgt = tokens(), [0, 2], [1, 4, 5], [5, -1]

    def zero(kernel, hook):  # [batch c q k]: the model's own dense kernel with the cut entries zeroed
        cut = masks(tgt, kernel.shape[0], L)[:, :, None] & masks(src, kernel.shape[0], L)[:, None, :]
        return kernel.masked_fill(cut[:, None], 0.0)
    with torch.no_grad(), knockout(model, src, tgt, layers):
        cut = model(toks)
    close(cut, run(model, toks, [(f"blocks.{l}.mixer.hook_kernel", zero) for l in layers]))


@pytest.mark.parametrize("name, channels", [("mamba1", [0, 5, 7]), ("mamba2", [1, 3]), ("mamba1", None)])
def test_only_listed_channels_change_at_targets(name, channels):
    model = build(name)
    toks, src, tgt = tokens(), random_mask(2, L, 0.5, 5), random_mask(2, L, 0.4, 6)
    with torch.no_grad():
        _, clean = model.run_with_cache(toks, names_filter="blocks.1.mixer.hook_y")
    with torch.no_grad(), knockout(model, src, tgt, [1], channels=channels):
        _, cut = model.run_with_cache(toks, names_filter="blocks.1.mixer.hook_y")
    changed = (cut["blocks.1.mixer.hook_y"] - clean["blocks.1.mixer.hook_y"]).abs() > 0
    changed = changed.flatten(3).any(-1) if changed.ndim == 4 else changed  # per head
    allowed = tgt[:, :, None] & _chan(channels, changed.shape[-1])[None, None, :]
    assert not (changed & ~allowed).any()
    assert changed.any()


# ---------------------------------------------------------------------- attention by hand
def _tgt_mask(seed):
    m = random_mask(2, L, 0.4, seed)
    m[:, 0] = False  # position 0 sees only itself: it would be a fully cut row
    return m


ATTN_CASES = [  # model, layers, sources, targets
    ("gpt2", [1], [1, 2], [-1, 5]),
    ("gpt2", [0, 1, 2], [-1], [-1]),
    ("llama", [0, 2], [3, 4, 5], [6, 7, -1]),
    ("llama", [1], random_mask(2, L, 0.4, 7, allow_first=False), _tgt_mask(8)),
    ("llama", [2], [0], [-1]),
    ("zamba2", [1, 3], [2, 3], [-1, 6]),
    ("zamba2", [0, 1, 2], [2, 3], [-1, 6]),  # a window spanning Mamba-2-only and hybrid layers
]


@pytest.mark.parametrize("mode", ["scores", "pattern"])
@pytest.mark.parametrize("name, layers, sources, targets", ATTN_CASES)
def test_attention_knockout_equals_hand_mask(name, layers, sources, targets, mode):
    model = build(name)
    if name == "zamba2":  # the hybrid layers' Mamba-2 mixers are cut too: add their reference
        hooks = attention_reference(model, layers, sources, targets, mode) + \
            ssm_reference(model, layers, sources, targets)
    else:
        hooks = attention_reference(model, layers, sources, targets, mode)
    toks = tokens()
    with torch.no_grad(), knockout(model, sources, targets, layers, attention=mode):
        cut = model(toks)
    close(cut, run(model, toks, hooks))
    assert (cut - run(model, toks)).abs().max() > 1e-6


def test_fully_cut_row_writes_nothing_and_stays_causal():
    model = build("llama")
    toks = tokens()
    with torch.no_grad(), knockout(model, range(L), [5], [1]):
        _, cache = model.run_with_cache(toks, names_filter="blocks.1.attn.hook_pattern")
    pattern = cache["blocks.1.attn.hook_pattern"]
    assert torch.equal(pattern[:, :, 5], torch.zeros_like(pattern[:, :, 5]))
    assert torch.isfinite(pattern).all()



# ---------------------------------------------------------------- invariants, every model
MODES = [(n, m, c) for n in CONFIGS for m in (("scores", "pattern") if n in ATTN else ("scores",))
         for c in ((False, True) if n in SSM else (False,))]  # attention modes where there is attention


@pytest.mark.parametrize("name, mode, conv", MODES)
def test_empty_edge_set_is_bit_identical(name, mode, conv):
    model = build(name)
    toks = tokens()
    with backends.use(attention="eager"):  # knockout's layers run eager: so does clean
        clean = run(model, toks)
    none = torch.zeros(2, L, dtype=torch.bool)
    for sources, targets in [([], [-1]), ([1, 2], []), (none, none), (random_mask(2, L, 0.5, 9), none)]:
        with torch.no_grad(), knockout(model, sources, targets, range(model.cfg.n_layers), attention=mode, cut_conv=conv):
            assert torch.equal(model(toks), clean)


@pytest.mark.parametrize("name, mode, conv", MODES)
def test_causal_in_every_mode(name, mode, conv):
    """Changing tokens after the target never changes the target's logits, whatever is cut."""
    model = build(name)
    j = 5
    a = tokens(seed=3)
    b = a.clone()
    b[:, j + 1:] = tokens(seed=4)[:, j + 1:]
    every = range(model.cfg.n_layers)
    for sources in (range(L), [j - 1, j, j + 1, j + 2], [j + 1, j + 3]):
        with torch.no_grad(), knockout(model, sources, [j, j - 2], every, attention=mode, cut_conv=conv):
            la, lb = model(a), model(b)
        assert torch.isfinite(la).all()
        close(la[:, : j + 1], lb[:, : j + 1], tol=1e-12)
    with torch.no_grad(), knockout(model, [j + 1, j + 3], [j], every, attention=mode, cut_conv=conv):
        close(model(a)[:, : j + 1], run(model, a)[:, : j + 1], tol=1e-12)  # future sources: no edge to cut


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_untouched_and_hooks_removed(name):
    model = build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    toks = tokens()
    clean = run(model, toks)
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), knockout(model, [1, 2], [-1], range(model.cfg.n_layers), cut_conv=name in SSM):
            model(toks)
            raise RuntimeError("boom")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not p._hooks for p in model.hook_dict.values())
    assert torch.equal(run(model, toks), clean)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sources=[L], targets=[-1], layers=[0]), IndexError, "sources"),
    (dict(sources=[1], targets=[-L - 1], layers=[0]), IndexError, "targets"),
    (dict(sources=torch.ones(3, L, dtype=torch.bool), targets=[-1], layers=[0]), ValueError, "shape"),
    (dict(sources=[1], targets=[-1], layers=[7]), ValueError, r"layers=7: must be in \[-3, 3\)"),
    (dict(sources=[1], targets=[-1], layers=[0], attention="softmax"), ValueError, "attention"),
    (dict(sources=[1], targets=[-1], layers=[0], channels=[99]), IndexError, "channels"),
    (dict(sources=[1], targets=[-1], layers=[0, 1], channels={0: [1]}), ValueError, "layer 1"),
])
def test_bad_input_is_named(kwargs, error, match):
    model = build("mamba1")
    with pytest.raises(error, match=match):
        with torch.no_grad(), knockout(model, **kwargs):
            model(tokens())
    assert all(not p._hooks for p in model.hook_dict.values())


# ----------------------------------------------------------------------- decay and features
@pytest.mark.parametrize("name", ["mamba1", "mamba2", "zamba2"])
def test_decay_norms_and_split(name):
    model = copy.deepcopy(build(name))
    mixer = model.get_submodule("blocks.1.mixer")
    with torch.no_grad():  # random A_log so the ranking is not a tie
        mixer.A_log.copy_(torch.randn(mixer.A_log.shape, generator=torch.Generator().manual_seed(0)))
    A = -torch.exp(mixer.A_log.detach())
    expected = torch.exp(A).sum(-1) if A.ndim == 2 else torch.exp(A) * model.cfg.d_state
    torch.testing.assert_close(decay_norms(model, 1), expected.double(), rtol=1e-12, atol=1e-12)
    split = decay_split(model, 1, fraction=1 / 3)
    k = round(len(expected) / 3)
    assert len(split.fastest) == len(split.slowest) == k
    assert set(split.fastest.tolist()).isdisjoint(split.slowest.tolist())
    assert expected[split.fastest].max() <= expected.sort().values[k - 1]
    assert expected[split.slowest].min() >= expected.sort().values[-k]


@pytest.mark.parametrize("reading", ["cut", "spare"])
@pytest.mark.parametrize("group", ["fastest", "slowest"])
def test_feature_knockout_states_what_it_cuts(group, reading):
    model = build("mamba1")
    layers = [1, 2]
    plan = feature_plan(model, layers, group, 1 / 3, reading)
    for l in layers:
        chosen = getattr(decay_split(model, l, 1 / 3), group)
        cut, spared = set(plan.cut[l].tolist()), set(plan.spared[l].tolist())
        assert cut | spared == set(range(model.cfg.d_inner)) and not cut & spared
        assert (cut if reading == "cut" else spared) == set(chosen.tolist())
    assert ("all but" in plan.describe()) == (reading == "spare")
    toks = tokens()
    with torch.no_grad(), feature_knockout(model, [2, 3], [-1], layers, group, reading=reading) as used:
        got = model(toks)
    assert used.describe() == plan.describe()
    assert all(torch.equal(used.cut[l], plan.cut[l]) and torch.equal(used.spared[l], plan.spared[l]) for l in layers)
    close(got, run(model, toks, [h for l in layers for h in ssm_reference(model, [l], [2, 3], [-1], plan.cut[l])]))


# ------------------------------------------------------------------------------- memory
MEMORY_SCRIPT = textwrap.dedent('''
    import resource, torch
    from hooked.models.families import build
    from hooked.models.mamba import MambaConfig
    from analysis.interventions.knockout import knockout
    torch.manual_seed(0)
    L, d_inner = 2048, 128
    model = build(MambaConfig(n_layers=1, d_model=64, d_vocab=64, d_inner=d_inner, d_state=16)).eval()
    toks = torch.randint(0, 64, (1, L))
    with torch.no_grad():
        model(toks)  # warm up: the plain forward's own peak
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with knockout(model, range(0, L, 2), [-1, -2, -3, -4, L // 2], [0], cut_conv=True):
            model(toks)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(peak - base, L * L * d_inner * 4)
''')


def test_knockout_at_2048_builds_no_pos_by_pos_by_channel_tensor():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    extra, dense = map(int, done.stdout.split()[-2:])
    assert 0 <= extra < dense / 8, f"knockout raised peak RSS by {extra / 2**20:.0f} MiB; a dense kernel is {dense / 2**20:.0f} MiB"
