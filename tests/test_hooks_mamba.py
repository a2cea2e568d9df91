"""Mamba-1 hook contract and interventions, checked against a brute-force loop written here.

Contract: every documented hook exists, fires once per forward with its documented shape, in the
DESIGN.md table's order; identity hooks leave logits bit-identical; lazy quantities (A_bar, B_bar,
h, kernel, head_out) are not built without a hook. Interventions (float64, 1e-10): edits of h,
kernel entries, dt, B, C, A_bar, B_bar equal the recurrence run by hand with the same edit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import hooked.models.mamba as mamba_module
from hooked.models.mamba import MambaConfig
from hooked.models.families import build
from hooked.models.language_model import LanguageModel

BATCH, POS = 2, 9
CONFIGS = {
    "mamba": MambaConfig(n_layers=2, d_model=8, d_vocab=23, d_inner=12, d_state=4, dt_rank=3, proj_bias=True),
    "falcon": MambaConfig(n_layers=2, d_model=8, d_vocab=23, d_state=5, tied=False, mixer_rms_eps=1e-6),
}
# the DESIGN.md section 3 table, in forward order: hook -> documented shape
MIXER_HOOKS = {
    "hook_in": "batch pos d_inner",
    "hook_gate": "batch pos d_inner",
    "hook_conv": "batch pos d_inner",
    "hook_ssm_in": "batch pos d_inner",
    "hook_dt": "batch pos d_inner",
    "hook_B": "batch pos d_state",
    "hook_C": "batch pos d_state",
    "hook_A_bar": "batch pos d_inner d_state",
    "hook_B_bar": "batch pos d_inner d_state",
    "hook_h": "batch pos d_inner d_state",
    "hook_kernel": "batch d_inner pos pos",
    "hook_y": "batch pos d_inner",
    "hook_ssm_out": "batch pos d_inner",
    "hook_gated": "batch pos d_inner",
    "hook_head_out": "batch pos d_inner d_model",
}
BLOCK_HOOKS = {"hook_resid_pre": "batch pos d_model", "hook_mixer_in": "batch pos d_model", "ln1.hook_scale": "batch pos 1", "ln1.hook_normalized": "batch pos d_model",
               "hook_mixer_out": "batch pos d_model", "hook_resid_post": "batch pos d_model"}
LAZY = ["hook_A_bar", "hook_B_bar", "hook_h", "hook_kernel", "hook_head_out"]


def make_model(name: str, dtype: torch.dtype = torch.float64) -> LanguageModel:
    torch.manual_seed(0)
    model = build(CONFIGS[name]).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def tokens(pos: int = POS, seed: int = 0) -> Tensor:
    return torch.randint(0, 23, (BATCH, pos), generator=torch.Generator().manual_seed(seed))


def shape_of(spec: str, cfg: MambaConfig, pos: int) -> tuple[int, ...]:
    sizes = {"batch": BATCH, "pos": pos, "d_inner": cfg.d_inner, "d_state": cfg.d_state, "d_model": cfg.d_model, "1": 1,
             "d_vocab": cfg.d_vocab}
    return tuple(sizes[w] for w in spec.split())


# ----------------------------------------------------------------------------- brute force
def brute_force(u, dt, A, B, C, *, A_bar=None, B_bar=None, edit_h=None):
    """h_t = A_bar_t * h_{t-1} + B_bar_t * u_t; y_t = sum_n C_t[n] h_t[:, n]; edit_h(t, h) -> h."""
    batch, seq_len, d_inner = u.shape
    h = torch.zeros(batch, d_inner, A.shape[1], dtype=u.dtype)
    ys, hs = [], []
    for t in range(seq_len):
        a = torch.exp(dt[:, t, :, None] * A) if A_bar is None else A_bar[:, t]
        b = dt[:, t, :, None] * B[:, t, None, :] if B_bar is None else B_bar[:, t]
        h = a * h + b * u[:, t, :, None]
        if edit_h is not None:
            h = edit_h(t, h)
        hs.append(h)
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), torch.stack(hs, 1)


def mixer_inputs(model: LanguageModel, toks: Tensor, layer: int = 0, edits=()) -> dict[str, Tensor]:
    """u, dt, B, C, y, ... of one layer's mixer (after the given edit hooks ran)."""
    names = ["hook_ssm_in", "hook_dt", "hook_B", "hook_C", "hook_y", "hook_A_bar", "hook_B_bar", "hook_h",
             "hook_kernel"]
    store: dict[str, Tensor] = {}
    save = [(f"blocks.{layer}.mixer.{n}", lambda x, hook: store.__setitem__(hook.name.split(".")[-1], x.clone()))
            for n in names]
    model.run_with_hooks(toks, fwd_hooks=list(edits) + save)
    return store


def at(t: int, value: Tensor):
    """A hook that sets position t (axis 1) to `value` and returns a new tensor."""
    def fn(x: Tensor, hook) -> Tensor:
        x = x.clone()
        x[:, t] = value
        return x
    return fn


CLOSE = dict(rtol=1e-10, atol=1e-10)


# -------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_hook_exists_fires_once_with_documented_shape(config: str) -> None:
    model = make_model(config, torch.float32)
    cfg, pos = model.cfg, 7
    expected = {"hook_embed": "batch pos d_model", "ln_final.hook_scale": "batch pos 1",
                "ln_final.hook_normalized": "batch pos d_model", "unembed.hook_in": "batch pos d_model",
                "unembed.hook_out": "batch pos d_vocab"}
    for layer in range(cfg.n_layers):
        expected.update({f"blocks.{layer}.{n}": s for n, s in BLOCK_HOOKS.items()})
        expected.update({f"blocks.{layer}.mixer.{n}": s for n, s in MIXER_HOOKS.items()})
    assert set(model.hook_dict) == set(expected)
    fired: dict[str, list[tuple[int, ...]]] = {n: [] for n in expected}
    model.run_with_hooks(tokens(pos), fwd_hooks=[(lambda n: True, lambda x, hook: fired[hook.name].append(x.shape))])
    for name, spec in expected.items():
        assert fired[name] == [shape_of(spec, cfg, pos)], name


def test_mixer_hook_order_is_the_design_table() -> None:
    model = make_model("mamba", torch.float32)
    order = [n.split(".")[-1] for n in model.hook_dict if n.startswith("blocks.1.mixer.")]
    assert order == list(MIXER_HOOKS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_identity_hooks_keep_logits_bit_identical(config: str) -> None:
    model = make_model(config, torch.float32)
    toks = tokens(20)
    plain = model(toks)
    hooked = model.run_with_hooks(toks, fwd_hooks=[(lambda n: True, lambda x, hook: x)])
    assert torch.equal(plain, hooked)
    _, cache = model.run_with_cache(toks, incl_lazy=True)
    assert torch.equal(plain, model(toks)) and len(cache) == len(model.hook_dict)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_zero_edits_on_every_path_keep_logits(config: str) -> None:
    """Hooks that return a copy take every edit path (h, kernel, A_bar, head_out) with a zero edit."""
    model = make_model(config)
    toks = tokens()
    hooked = model.run_with_hooks(toks, fwd_hooks=[(lambda n: True, lambda x, hook: x.clone())])
    torch.testing.assert_close(hooked, model(toks), **CLOSE)


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_lazy_quantities_are_not_built_without_hooks(monkeypatch) -> None:
    model = make_model("mamba", torch.float32)
    cfg, pos = model.cfg, 64
    model.hook_dict  # the one-off run that records the hook order has every hook active
    calls: dict[str, int] = {}
    # linear_scan is a module global of mamba.py; the kernels are MambaMixer's ops (class attributes)
    for owner, attr, fn in ((mamba_module, "linear_scan", "linear_scan"),
                            (mamba_module.MambaMixer, "kernel_dense", "mamba1_kernel_chunked"),
                            (mamba_module.MambaMixer, "kernel_discrete", "mamba1_kernel_discrete")):
        original = getattr(owner, attr)

        def counted(*args, _fn=fn, _original=original, **kwargs):
            calls[_fn] = calls.get(_fn, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, attr, counted if owner is mamba_module else staticmethod(counted))
    toks = tokens(pos)
    with torch.no_grad(), _LargestTensor() as mode:
        model(toks)
        model.run_with_cache(toks, names_filter=lambda n: not any(n.endswith(h) for h in LAZY))
    assert calls == {}
    states = BATCH * pos * cfg.d_inner * cfg.d_state
    assert mode.largest < states, "a [batch pos d_inner d_state] tensor was built without a hook"
    model.run_with_cache(toks, names_filter="blocks.0.mixer.hook_h")
    model.run_with_cache(toks, names_filter="blocks.1.mixer.hook_kernel")
    assert calls == {"linear_scan": 1, "mamba1_kernel_chunked": 1}  # the counting sees them when hooked


def test_head_out_refused_over_budget(monkeypatch) -> None:
    model = make_model("mamba", torch.float32)
    monkeypatch.setattr(mamba_module, "HEAD_OUT_BUDGET_BYTES", 1000)
    with pytest.raises(ValueError, match=r"blocks\.0\.mixer\.hook_head_out.*HEAD_OUT_BUDGET_BYTES"):
        model.run_with_cache(tokens(), names_filter=lambda n: n.endswith("hook_head_out"))
    assert all(not p._hooks for p in model.hook_dict.values())


# --------------------------------------------------------------------------- interventions
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cached_quantities_equal_brute_force(config: str) -> None:
    model = make_model(config)
    q = mixer_inputs(model, tokens(), layer=1)
    A = model.blocks[1].mixer.A()
    y, h = brute_force(q["hook_ssm_in"], q["hook_dt"], A, q["hook_B"], q["hook_C"])
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)
    torch.testing.assert_close(q["hook_h"], h, **CLOSE)
    torch.testing.assert_close(q["hook_A_bar"], torch.exp(q["hook_dt"][..., None] * A), **CLOSE)
    torch.testing.assert_close(q["hook_B_bar"], q["hook_dt"][..., None] * q["hook_B"][:, :, None], **CLOSE)
    # the kernel reconstructs y: y[b, j, d] = sum_i kernel[b, d, j, i] u[b, i, d]
    recon = torch.einsum("bdji,bid->bjd", q["hook_kernel"], q["hook_ssm_in"])
    torch.testing.assert_close(recon, q["hook_y"], **CLOSE)
    assert torch.equal(q["hook_kernel"].triu(1), torch.zeros_like(q["hook_kernel"]))


@pytest.mark.parametrize("t", [0, 3, POS - 1])
@pytest.mark.parametrize("how", ["returned", "in_place", "in_place_inference_mode"])
def test_state_edit_continues_the_recurrence(t: int, how: str) -> None:
    model = make_model("mamba")
    cfg = model.cfg
    new_h = torch.randn(BATCH, cfg.d_inner, cfg.d_state, dtype=torch.float64)

    def edit(x: Tensor, hook):
        if how == "returned":
            return at(t, new_h)(x, hook)
        x[:, t] = new_h
    with torch.inference_mode(how == "in_place_inference_mode"):
        q = mixer_inputs(model, tokens(), edits=[("blocks.0.mixer.hook_h", edit)])
    q = {k: v.clone() for k, v in q.items()}  # normal tensors again, usable with autograd
    A = model.blocks[0].mixer.A()
    y, _ = brute_force(q["hook_ssm_in"], q["hook_dt"], A, q["hook_B"], q["hook_C"],
                       edit_h=lambda s, h: new_h if s == t else h)
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)
    assert not torch.allclose(q["hook_y"][:, t:], mixer_inputs(model, tokens())["hook_y"][:, t:])
    # downstream: the logits equal a run whose y is the brute-force one
    edited = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.0.mixer.hook_h", edit)])
    patched = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.0.mixer.hook_y", lambda x, hook: y)])
    torch.testing.assert_close(edited, patched, **CLOSE)


def test_state_edits_at_two_positions_set_the_states_there() -> None:
    """Two positions edited (h + delta at 2 and 6 of what the hook received): the state at 6 IS the
    returned one (clean h_6 + delta_6), not the state continued from 2 plus delta_6 (tests/test_state_edits.py)."""
    model = make_model("falcon")
    cfg = model.cfg
    deltas = {2: torch.randn(BATCH, cfg.d_inner, cfg.d_state, dtype=torch.float64),
              6: torch.randn(BATCH, cfg.d_inner, cfg.d_state, dtype=torch.float64)}

    def add(x: Tensor, hook) -> Tensor:
        x = x.clone()
        for s, d in deltas.items():
            x[:, s] += d
        return x
    clean = mixer_inputs(model, tokens(), layer=1)["hook_h"]
    q = mixer_inputs(model, tokens(), layer=1, edits=[("blocks.1.mixer.hook_h", add)])
    y, h = brute_force(q["hook_ssm_in"], q["hook_dt"], model.blocks[1].mixer.A(), q["hook_B"], q["hook_C"],
                       edit_h=lambda s, h: clean[:, s] + deltas[s] if s in deltas else h)
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)
    torch.testing.assert_close(q["hook_h"], h, **CLOSE)  # what a later hook sees: the continued states


@pytest.mark.parametrize("j, i", [(5, 2), (4, 4), (POS - 1, 0)])
def test_single_kernel_entry_edit(j: int, i: int) -> None:
    model = make_model("mamba")
    b, d, delta = 1, 7, 0.37

    def edit(K: Tensor, hook) -> Tensor:
        K = K.clone()
        K[b, d, j, i] += delta
        return K
    q = mixer_inputs(model, tokens(), edits=[("blocks.0.mixer.hook_kernel", edit)])
    y, _ = brute_force(q["hook_ssm_in"], q["hook_dt"], model.blocks[0].mixer.A(), q["hook_B"], q["hook_C"])
    y[b, j, d] += delta * q["hook_ssm_in"][b, i, d]
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)


@pytest.mark.parametrize("j, i", [(6, 2), (3, 3), (POS - 1, 0)])
def test_cut_kernel_edge_equals_scan_without_the_source(j: int, i: int) -> None:
    """Zeroing kernel[:, :, j, i] == at target j, the recurrence run with u_i = 0."""
    model = make_model("falcon")

    def cut(K: Tensor, hook) -> None:
        K[:, :, j, i] = 0  # in place
    q = mixer_inputs(model, tokens(), edits=[("blocks.0.mixer.hook_kernel", cut)])
    A = model.blocks[0].mixer.A()
    y, _ = brute_force(q["hook_ssm_in"], q["hook_dt"], A, q["hook_B"], q["hook_C"])
    u_cut = q["hook_ssm_in"].clone()
    u_cut[:, i] = 0
    y_cut, _ = brute_force(u_cut, q["hook_dt"], A, q["hook_B"], q["hook_C"])
    y[:, j] = y_cut[:, j]
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)


@pytest.mark.parametrize("hook", ["hook_dt", "hook_B", "hook_C", "hook_A_bar", "hook_B_bar"])
def test_edits_of_scan_inputs_are_what_the_scan_uses(hook: str) -> None:
    model = make_model("mamba")
    t = 4
    gen = torch.Generator().manual_seed(3)

    def edit(x: Tensor, h) -> Tensor:
        x = x.clone()
        x[:, t] = x[:, t] * 0.5 + 0.1 * torch.rand(x[:, t].shape, generator=gen, dtype=x.dtype)
        return x
    q = mixer_inputs(model, tokens(), edits=[(f"blocks.0.mixer.{hook}", edit)])
    discrete = {k: q[f"hook_{k}"] for k in ("A_bar", "B_bar") if hook == f"hook_{k}"}
    y, _ = brute_force(q["hook_ssm_in"], q["hook_dt"], model.blocks[0].mixer.A(), q["hook_B"], q["hook_C"],
                       **discrete)
    torch.testing.assert_close(q["hook_y"], y, **CLOSE)
    baseline = mixer_inputs(model, tokens())["hook_y"]
    assert not torch.allclose(q["hook_y"][:, t:], baseline[:, t:])
    # the kernel built in the same run describes the edited scan
    recon = torch.einsum("bdji,bid->bjd", q["hook_kernel"], q["hook_ssm_in"])
    torch.testing.assert_close(recon, y, **CLOSE)


def test_head_out_sums_to_mixer_out_and_ablating_a_channel_is_zeroing_its_column() -> None:
    model = make_model("mamba")
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith("blocks.1."))
    head_out = cache["blocks.1.mixer.hook_head_out"]
    bias = model.blocks[1].mixer.out_proj.bias
    torch.testing.assert_close(head_out.sum(-2) + bias, cache["blocks.1.hook_mixer_out"], **CLOSE)
    channel = 5

    def ablate(x: Tensor, hook) -> Tensor:
        x = x.clone()
        x[:, :, channel] = 0
        return x
    ablated = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.mixer.hook_head_out", ablate)])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.blocks[1].mixer.out_proj.weight[:, channel] = 0
    torch.testing.assert_close(ablated, reference(tokens()), **CLOSE)
    assert not torch.allclose(ablated, model(tokens()))
