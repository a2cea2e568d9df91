"""The interpreter tier (issue 44): the real Triton kernels of fla and mamba-ssm, run on a CPU under
TRITON_INTERPRET=1, through every family's fast path, against the exact path.

    bash scripts/setup_triton.sh                                   # .venv-triton (not .venv)
    .venv-triton/bin/python -m pytest -m triton_interpret tests/test_triton_interpret.py

Where triton, fla or mamba-ssm is missing (the shared .venv) every test skips, naming what is missing.
tests/triton_shims.py sets the interpreter up (its shims live there, never in the package).

Glossary
    kernels    the installed kernels with real=False (ops/fused.py: they take CPU tensors, as the Triton
               kernels do under the interpreter); causal-conv1d's and the selective scan's CUDA kernels
               left out, so the short convs run fla's Triton conv. Forced with backends.use(scan="fused")
    family     every family with a kernel path: Mamba-2 mixers (mamba_chunk_scan_combined, a decoding step
               selective_state_update, the gated RMSNorm rmsnorm_fn, fla's conv), delta-rule mixers (fla's
               chunk / fused-recurrent gated delta rule or KDA, fla's conv), LFM2's short conv (fla's conv)
    positions  Mamba-2 tiny configs have chunk_size 4 and fla's delta rule chunks by 64: the prompts cross
               chunk boundaries (11 and 70 positions); the delta families group 4 value heads on 2 q/k heads
               (GVA), the Mamba-2 ones group heads on B/C groups
"""

from __future__ import annotations

import dataclasses

import pytest
import triton_shims

MISSING = triton_shims.missing()
if MISSING:
    pytest.skip(f"the Triton interpreter tier needs {', '.join(MISSING)}: {triton_shims.SETUP}",
                allow_module_level=True)
triton_shims.install()  # before anything imports triton, fla or mamba_ssm

import torch  # noqa: E402
from conftest import rel_close  # noqa: E402
from tiny_families import FAMILIES, V, tiny  # noqa: E402

from hooked import backends  # noqa: E402
from hooked.models.decode_state import DecodeState  # noqa: E402
from hooked.models.delta_mixer import DeltaMixer  # noqa: E402
from hooked.models.gated_norm import GatedRMSNorm, NormThenGate  # noqa: E402
from hooked.models.mamba2 import Mamba2Mixer  # noqa: E402
from hooked.models.short_conv import GatedShortConv  # noqa: E402
from hooked.ops.fused import mamba_ssm_kernels  # noqa: E402

pytestmark = pytest.mark.triton_interpret

MAMBA2 = ["mamba2", "zamba2", "bamba", "granite", "falcon_h1", "nemotron_h", "llamba"]
DELTA = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "qwen4_exp"]
CONV = ["lfm2", "lfm2_moe"]
KERNEL_FAMILIES = [f for f in MAMBA2 + DELTA + CONV if f in FAMILIES]
MIXERS = (Mamba2Mixer, DeltaMixer, GatedShortConv)
KERNELS = ("mamba_chunk_scan_combined", "selective_state_update", "rmsnorm_fn", "fla_causal_conv1d",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """backends' "fused" path gets the installed Triton kernels, taking CPU tensors (module glossary)."""
    kernels = dataclasses.replace(mamba_ssm_kernels(), real=False, selective_scan_fn=None, causal_conv1d_fn=None)
    monkeypatch.setattr(backends, "fused_kernels", lambda device: kernels)


def kernel_mixers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MIXERS)}


def expected(mixer: torch.nn.Module, decoding: bool) -> str:
    """What backends.active(model, kernels=True) says a mixer ran on the fused path."""
    if type(mixer).forward not in (Mamba2Mixer.forward, DeltaMixer.forward, GatedShortConv.forward):
        return "fused"
    if isinstance(mixer, GatedShortConv):
        return "fused: fla.causal_conv1d"
    if isinstance(mixer, DeltaMixer):
        kda = mixer.spec.per_channel_decay
        rule = ("fused_recurrent_" if decoding else "chunk_") + ("kda" if kda else "gated_delta_rule")
        return f"fused: fla.causal_conv1d, fla.{rule}"
    scan = "selective_state_update" if decoding else "mamba_chunk_scan_combined"
    norm = ", mamba_ssm.rmsnorm_fn" if isinstance(mixer.norm, (GatedRMSNorm, NormThenGate)) else ""
    return f"fused: fla.causal_conv1d, mamba_ssm.{scan}{norm}"


def tokens_for(family: str, batch: int, pos: int | None = None) -> torch.Tensor:
    pos = pos or (70 if family in DELTA else 11)
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(3))


def run(model: torch.nn.Module, tokens: torch.Tensor, scan: str) -> tuple:
    """(logits, {hook name: tensor} of every kernel mixer's hook_conv and hook_y, d(logits . w)/d embeddings,
    active(kernels=True)) of one forward and backward on `scan`."""
    seen: dict[str, torch.Tensor] = {}
    leaf: list[torch.Tensor] = []

    def embed(x: torch.Tensor, hook) -> torch.Tensor:
        leaf.append(x.detach().requires_grad_(True))
        return leaf[0]

    def keep(x: torch.Tensor, hook) -> None:
        seen[hook.name] = x.detach().clone()

    names = tuple(f"{n}.{h}" for n in kernel_mixers(model) for h in ("hook_conv", "hook_y"))
    with backends.use(scan=scan):
        logits = model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", embed), (lambda n: n in names, keep)])
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    (grad,) = torch.autograd.grad((logits * w).sum(), leaf[0])
    return logits.detach(), seen, grad, backends.active(model, kernels=True)


def test_every_kernel_imports_and_every_kernel_family_is_tested():
    kernels = mamba_ssm_kernels()
    assert [k for k in KERNELS if getattr(kernels, k) is None] == []
    with_kernels = [f for f in FAMILIES if kernel_mixers(tiny(f))]
    assert sorted(with_kernels) == sorted(KERNEL_FAMILIES)


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_fast_path_equals_exact_forward_hooks_and_gradients(family):
    """Logits and the hooks read on the fast path (hook_conv, hook_y) within 1e-5 of the largest entry, the
    embeddings' gradient within 1e-4; each kernel mixer names the kernels it ran."""
    model = tiny(family)
    tokens = tokens_for(family, batch=2 if family not in DELTA else 1)
    logits, seen, grad, active = run(model, tokens, "fused")
    logits_ref, seen_ref, grad_ref, active_ref = run(model, tokens, "loop")
    rel_close(logits, logits_ref, 1e-5, "logits")
    assert seen.keys() == seen_ref.keys() and seen
    for name in seen:
        rel_close(seen[name], seen_ref[name], 1e-5, name)
    rel_close(grad, grad_ref, 1e-4, "d logits / d embeddings")
    for name, mixer in kernel_mixers(model).items():
        assert active[name] == expected(mixer, decoding=False), name
        assert active_ref[name] == "loop", name


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_ten_decode_steps_equal_recompute(family):
    """A prompt through the chunked kernels, then ten one-token steps through the recurrent ones (the state
    update, the conv on its window): each step's logits equal the exact path's over the whole sequence."""
    model = tiny(family)
    tokens = tokens_for(family, batch=2, pos=16)
    state = DecodeState()
    with torch.no_grad(), backends.use(scan="fused"):
        model(tokens[:, :6], state=state)
        prefill = backends.active(model, kernels=True)
        for t in range(6, 16):
            got = model(tokens[:, t:t + 1], state=state)[:, -1]
            stepped = backends.active(model, kernels=True)
            with backends.use(scan="loop"):
                want = model(tokens[:, :t + 1])[:, -1]
            rel_close(got, want, 1e-5, f"step {t - 5}")
    for name, mixer in kernel_mixers(model).items():
        assert prefill[name] == expected(mixer, decoding=False), name
        assert stepped[name] == expected(mixer, decoding=True), name


@pytest.mark.parametrize("family, hook", [("mamba2", "hook_h"), ("qwen3_next", "hook_h"), ("kimi_linear", "hook_h"),
                                          ("lfm2", "hook_kernel")])
def test_a_hook_that_needs_the_exact_path_gets_it(family, hook):
    """Under a forced "fused", the layer whose state (or kernel) is hooked runs the exact path and its hook
    fires with the whole tensor; the other kernel layers still run their kernels; the logits are the same."""
    model = tiny(family)
    tokens = tokens_for(family, batch=1, pos=11)
    first, *others = kernel_mixers(model)
    fired = []
    with torch.no_grad(), backends.use(scan="fused"):
        logits = model.run_with_hooks(tokens, fwd_hooks=[(f"{first}.{hook}", lambda x, h: fired.append(x.shape))])
        active = backends.active(model, kernels=True)
        with backends.use(scan="loop"):
            logits_ref = model(tokens)
    positions = fired[0][:2] if hook == "hook_h" else (fired[0][0], *fired[0][-2:])  # [b l ...], [b c j i]
    assert len(fired) == 1 and positions == ((1, 11) if hook == "hook_h" else (1, 11, 11))
    assert active[first] == "loop"
    assert others and all(active[n].startswith("fused: ") for n in others)
    rel_close(logits, logits_ref, 1e-5, "logits")


# ---------------------------------------------------------------- the kernels alone, against our ops
def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _grads(out: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    w = [_randn(*o.shape, seed=9 + i) for i, o in enumerate(out)]
    return torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), inputs)


def _close(got: tuple, want: tuple, rel: float, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        rel_close(g, w, rel, f"{what} [{i}]")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta_rule", "kda"])
@pytest.mark.parametrize("pos, with_state", [(70, False), (70, True), (1, True)], ids=["prompt", "from_state", "step"])
def test_fla_delta_rule_equals_ours(per_channel, pos, with_state):
    """fla's chunked (70 positions: across its 64-position chunk) and recurrent (one position without
    autograd) rule, 4 value heads on 2 q/k heads, from a state or not: outputs, final state and the gradients
    of every input (a recorded step takes the chunked kernel)."""
    from hooked.ops.delta_rule import delta_rule_chunked, l2norm
    from hooked.ops.fla_kernels import delta_rule_fused

    b, g, h, c, v = 2, 2, 4, 8, 6
    q, k = (l2norm(_randn(b, pos, g, c, seed=s)) * f for s, f in ((1, c**-0.5), (2, 1.0)))
    vals, beta = _randn(b, pos, h, v, seed=3), torch.rand(b, pos, h, generator=torch.Generator().manual_seed(4))
    alpha = torch.rand(b, pos, h, *((c,) if per_channel else ()), generator=torch.Generator().manual_seed(5)) * 0.6 + 0.4
    S0 = _randn(b, h, c, v, seed=6) if with_state else None
    kernels, rule = backends.fused_kernels("cpu"), "kda" if per_channel else "gated_delta_rule"
    want = delta_rule_chunked(q, k, vals, beta, alpha, S0)
    if pos == 1:  # a decoding step: the recurrent kernel, which has no backward
        ran: list[str] = []
        _close(delta_rule_fused(q, k, vals, beta, alpha, S0, kernels=kernels, ran=ran), want, 1e-5, "o, S_last")
        assert ran == [f"fla.fused_recurrent_{rule}"]
    inputs = [t.requires_grad_(True) for t in (q, k, vals, beta, alpha, *([S0] if with_state else []))]
    ran = []
    got = delta_rule_fused(*inputs[:5], S0, kernels=kernels, ran=ran)  # recorded by autograd: chunked
    want = delta_rule_chunked(*inputs[:5], S0)
    assert ran == [f"fla.chunk_{rule}"]
    _close(got, want, 1e-5, "o, S_last")
    _close(_grads(got, inputs), _grads(want, inputs), 1e-4, "gradients")


@pytest.mark.parametrize("pos, with_state", [(11, False), (11, True), (1, True)], ids=["prompt", "from_state", "step"])
def test_mamba_ssm_ssd_equals_ours(pos, with_state):
    """mamba_chunk_scan_combined over 11 positions in chunks of 4 (and selective_state_update for one position
    from a state without autograd), 4 heads on 2 B/C groups: y, the final state and their gradients."""
    from hooked.ops.fused import ssd_fused
    from hooked.ops.ssd import ssd_chunked

    b, h, p, g, n = 2, 4, 8, 2, 5
    x, B, C = _randn(b, pos, h, p, seed=1), _randn(b, pos, g, n, seed=2), _randn(b, pos, g, n, seed=3)
    dt = torch.rand(b, pos, h, generator=torch.Generator().manual_seed(4)) * 0.5 + 0.05
    A = -torch.linspace(0.5, 2.0, h)
    h0 = _randn(b, h, p, n, seed=5) if with_state else None
    kernels, want = backends.fused_kernels("cpu"), ssd_chunked(x, dt, A, B, C, 4, h0=h0)
    if pos == 1:  # a decoding step: selective_state_update, which has no backward
        ran: list[str] = []
        _close(ssd_fused(x, dt, A, B, C, 4, h0, kernels=kernels, ran=ran), want, 1e-5, "y, h_last")
        assert ran == ["mamba_ssm.selective_state_update"]
    inputs = [t.requires_grad_(True) for t in (x, dt, B, C, *([h0] if with_state else []))]
    ran = []
    got = ssd_fused(x, dt, A, B, C, 4, h0, kernels=kernels, ran=ran)  # recorded by autograd: the chunked kernel
    want = ssd_chunked(x, dt, A, B, C, 4, h0=h0)
    assert ran == ["mamba_ssm.mamba_chunk_scan_combined"]
    _close(got, want, 1e-5, "y, h_last")
    _close(_grads(got, inputs), _grads(want, inputs), 1e-4, "gradients")


@pytest.mark.parametrize("width, bias", [(3, False), (4, True)])
def test_fla_causal_conv_equals_ours(width, bias):
    from hooked.ops.conv import causal_conv1d
    from hooked.ops.fused import causal_conv1d_fused

    x, weight = _randn(2, 70, 12, seed=1).requires_grad_(True), _randn(12, width, seed=2).requires_grad_(True)
    b = _randn(12, seed=3).requires_grad_(True) if bias else None
    inputs = [x, weight, *([b] if bias else [])]
    ran: list[str] = []
    got = causal_conv1d_fused(x, weight, b, kernels=backends.fused_kernels("cpu"), ran=ran)
    want = causal_conv1d(x, weight, b)
    assert ran == ["fla.causal_conv1d"]
    _close((got,), (want,), 1e-5, "conv")
    _close(_grads((got,), inputs), _grads((want,), inputs), 1e-4, "gradients")


@pytest.mark.parametrize("norm_cls", [GatedRMSNorm, NormThenGate])
def test_mamba_ssm_gated_norm_equals_ours(norm_cls):
    from hooked.ops.fused import rms_norm_gated_fused

    norm = norm_cls(16, 8, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _randn(16, seed=1))
    y, z = _randn(2, 5, 16, seed=2).requires_grad_(True), _randn(2, 5, 16, seed=3).requires_grad_(True)
    inputs = [y, z, norm.weight]
    ran: list[str] = []
    got = rms_norm_gated_fused(y, z, norm.weight, norm.eps, norm.group_size, norm_cls is NormThenGate,
                               kernels=backends.fused_kernels("cpu"), ran=ran)
    want = norm(y, z)
    assert ran == ["mamba_ssm.rmsnorm_fn"]
    _close((got,), (want,), 1e-5, "gated norm")
    _close(_grads((got,), inputs), _grads((want,), inputs), 1e-4, "gradients")
