"""Backends chosen per forward (hooked/backends.py), on every family's tiny model.

- every scan backend ("loop", "chunked", "fused" through stand-ins with mamba-ssm's semantics and
  layout) gives the exact path's logits: float32 within 1e-5, float64 within 1e-12 (relative to the
  largest logit), left padding and decoding from a state included;
- the exact path is chosen (asserted on `backends.active`) whenever a state hook, a score / pattern
  hook or a knockout is active, whatever `use` forces, and only in the layers that have one;
- SDPA equals eager within 1e-6 and a hook-free forward at 1,024 tokens holds no [batch heads q k]
  tensor (the largest tensor any op returns is measured);
- a hook-free forward reads nothing from the device inside the blocks (counted by op), and the blocks
  compile as one graph (fullgraph=True, in a fresh interpreter), on the default and on the GPU paths;
  hooks added after compiling fire.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_families import FAMILIES, tiny
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.interventions import knockout
from hooked import backends
from hooked.backend_rules import ATTENTIONS, SCANS
from hooked.models.attention import Attention
from hooked.models.decode_state import DecodeState
from hooked.models.moe import MoE
from hooked.ops.fused import REFERENCE, Kernels

V = 64
SSM = ["mamba", "falcon_mamba", "mamba2", "zamba2", "bamba", "granite", "falcon_h1", "nemotron_h", "jamba"]
ATTN = [f for f in FAMILIES if any(isinstance(m, Attention) for m in tiny(f).modules())]


def batch(pos: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, V, (2, pos), generator=torch.Generator().manual_seed(pos))
    mask = torch.ones(2, pos, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return tokens, mask


def model_in(family: str, dtype: torch.dtype):
    model = tiny(family)
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def rel_close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=rel * b.abs().max().item())


def used(model, kinds=SCANS) -> dict[str, str]:
    return {n: b for n, b in backends.active(model).items() if b in kinds}


# ------------------------------------------------------------------------------- every backend
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["f32", "f64"])
@pytest.mark.parametrize("scan", ["chunked", "fused"])
@pytest.mark.parametrize("family", SSM)
def test_every_scan_backend_gives_the_exact_logits(family, scan, dtype, rel):
    model = model_in(family, dtype)
    tokens, mask = batch()
    with torch.no_grad():
        with backends.use(scan="loop"):
            exact = model(tokens, attention_mask=mask)
        assert set(used(model).values()) == {"loop"}
        with backends.use(scan=scan):
            fast = model(tokens, attention_mask=mask)
    # the kernels compute in float32 at most: a float64 scan takes the exact algorithm (the loop on CPU)
    want = scan if dtype != torch.float64 or scan != "fused" else "loop"
    assert used(model) and set(used(model).values()) == {want}
    rel_close(fast, exact, rel)


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("family", SSM)
def test_decoding_from_a_state_on_every_backend(family, scan):
    """A prompt, then one token at a time from the state, equals the whole sequence on the exact path."""
    model = tiny(family)
    tokens, _ = batch(9)
    with torch.no_grad():
        with backends.use(scan="loop"):
            whole = model(tokens)
        with backends.use(scan=scan):
            state = DecodeState()
            steps = [model(tokens[:, :6], state=state)]
            first = set(used(model).values())
            steps += [model(tokens[:, t:t + 1], state=state) for t in range(6, 9)]
            later = set(used(model).values())
    assert first == {scan}
    # Mamba-1's kernel takes no initial state: from one, "fused" is the device's exact algorithm
    mamba1 = any(type(m).__name__ == "MambaMixer" for m in model.modules())
    assert later == ({"loop"} if scan == "fused" and mamba1 else {scan})
    rel_close(torch.cat(steps, dim=1), whole, 1e-5)


def _spy(calls: dict) -> Kernels:
    def wrap(name, fn):
        def spy(*args, **kwargs):
            tensors = [*args, *kwargs.values()]  # the kernels are called with keywords only, in their order
            calls.setdefault(name, []).append(([tuple(a.shape) for a in tensors if torch.is_tensor(a)], kwargs))
            return fn(*args, **kwargs)
        return spy
    return Kernels(*(wrap(n, getattr(REFERENCE, n)) for n in ("selective_scan_fn", "causal_conv1d_fn",
                                                              "mamba_chunk_scan_combined")), real=False)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_the_fused_path_calls_the_kernels_as_mamba_ssm_takes_them(family, monkeypatch):
    """Channels before positions for the selective scan and the conv; hooked dt given after softplus,
    so no bias, softplus, D or gate goes to the kernel (their hooks fire outside it)."""
    calls: dict = {}
    monkeypatch.setattr(backends, "fused_kernels", lambda device: _spy(calls))
    model = tiny(family)
    tokens, _ = batch()
    seen = {}
    hooks = [(f"blocks.0.mixer.{h}", lambda x, hook: seen.update({hook.name: x.shape}))
             for h in ("hook_conv", "hook_dt", "hook_y")]
    with torch.no_grad(), backends.use(scan="fused"):
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    n_layers = model.cfg.n_layers
    mixer = model.blocks[0].mixer
    assert len(seen) == 3 and len(calls["causal_conv1d_fn"]) == n_layers
    shapes, kwargs = calls["causal_conv1d_fn"][0]
    assert shapes[0] == (2, mixer.conv_weight.shape[0], 11) and kwargs["activation"] is None
    if family == "mamba":
        shapes, kwargs = calls["selective_scan_fn"][0]
        d, n = mixer.A_log.shape
        assert shapes[:5] == [(2, d, 11), (2, d, 11), (d, n), (2, n, 11), (2, n, 11)]
        assert kwargs["D"] is None and kwargs["z"] is None and kwargs["delta_bias"] is None
        assert kwargs["delta_softplus"] is False and kwargs["return_last_state"] is True
    else:
        shapes, kwargs = calls["mamba_chunk_scan_combined"][0]
        assert shapes[0] == (2, 11, mixer.n_heads, mixer.d_head)
        assert kwargs["dt_bias"] is None and kwargs["D"] is None and kwargs["z"] is None
        assert kwargs["dt_softplus"] is False


def test_use_is_scoped_nested_and_checked():
    model = tiny("mamba")
    tokens, _ = batch()
    with torch.no_grad():
        with backends.use(scan="chunked"):
            with backends.use(attention="eager"):  # keeps the outer scan
                assert backends.forced() == ("chunked", "eager")
                model(tokens)
            assert backends.forced() == ("chunked", None)
        assert backends.forced() == (None, None)
        model(tokens)
    assert set(used(model).values()) == {"loop"}  # the CPU's default
    with pytest.raises(ValueError, match="scan backend must be one of"):
        with backends.use(scan="flash"):
            pass
    with pytest.raises(ValueError, match="attention backend must be one of"):
        with backends.use(attention="flash"):
            pass


# ---------------------------------------------------------------------------- exact when needed
@pytest.mark.parametrize("hook", ["hook_A_bar", "hook_B_bar", "hook_h", "hook_kernel"])
@pytest.mark.parametrize("family", ["mamba", "mamba2", "jamba"])
def test_a_state_hook_takes_the_exact_path_in_its_layer_only(family, hook):
    model = tiny(family)
    tokens, _ = batch()
    layer = next(i for i, b in enumerate(model.blocks) if b.sublayer("mixer") is not None)
    name = f"blocks.{layer}.mixer.{hook}"
    got = {}
    with torch.no_grad():
        with backends.use(scan="loop"):
            exact = model.run_with_cache(tokens, names_filter=[name])[1][name]
        with backends.use(scan="fused"):
            logits = model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, h: got.setdefault("x", x))])
            chosen = used(model)
            plain = model(tokens)
        with backends.use(scan="chunked"):
            chunked = model.run_with_cache(tokens, names_filter=[name])[1][name]
            assert used(model)[f"blocks.{layer}.mixer"] == "chunked"  # states built in few ops
    assert chosen.pop(f"blocks.{layer}.mixer") == "loop" and set(chosen.values()) == ({"fused"} if chosen else set())
    rel_close(got["x"], exact, 0)
    rel_close(chunked, exact, 1e-5)
    rel_close(logits, plain, 1e-5)


def test_a_hook_marked_exact_takes_the_exact_path():
    model = tiny("mamba")
    tokens, _ = batch()
    with torch.no_grad(), backends.use(scan="fused"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mixer.hook_y", backends.exact_hook(lambda x, h: None))])
        assert used(model) == {"blocks.0.mixer": "fused", "blocks.1.mixer": "loop"}
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mixer.hook_y", lambda x, h: None)])
        assert used(model) == {"blocks.0.mixer": "fused", "blocks.1.mixer": "fused"}


@pytest.mark.parametrize("family", ["jamba", "zamba2", "falcon_h1", "llama"])
def test_knockout_takes_the_exact_path_in_its_layers(family):
    model = tiny(family)
    tokens, _ = batch()
    layers = [model.cfg.n_layers - 1]
    with torch.no_grad(), backends.use(scan="fused", attention="sdpa"):
        with knockout(model, sources=[1, 2], targets=[-1], layers=layers):
            model(tokens)
        cut = backends.active(model)
        model(tokens)
        free = backends.active(model)
    inside = {n: b for n, b in cut.items() if n.startswith(f"blocks.{layers[0]}.")}
    assert inside and set(inside.values()) <= {"loop", "eager"}
    assert all(b in ("fused", "sdpa") for n, b in cut.items() if n not in inside)
    assert set(free.values()) <= {"fused", "sdpa"}


@pytest.mark.parametrize("hook", ["hook_attn_scores", "hook_pattern"])
@pytest.mark.parametrize("family", ["llama", "zamba2"])
def test_a_score_or_pattern_hook_takes_eager_in_its_layer_only(family, hook):
    model = tiny(family)
    tokens, _ = batch()
    layer = max(i for i, b in enumerate(model.blocks) if any(isinstance(m, Attention) for m in b.modules()))
    name = next(n for n in model.hook_dict if n.startswith(f"blocks.{layer}.") and n.endswith(f"attn.{hook}"))
    with torch.no_grad(), backends.use(attention="sdpa"):
        model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, h: None)])
    attn = used(model, ATTENTIONS)
    assert attn.pop(name.rsplit(".", 1)[0]) == "eager" and set(attn.values()) <= {"sdpa"}


def test_a_soft_capped_layer_is_eager_without_hooks():
    model = tiny("gemma2")
    with torch.no_grad():
        model(batch()[0])
    assert set(used(model, ATTENTIONS).values()) == {"eager"}


# ------------------------------------------------------------------------------------ SDPA
@pytest.mark.parametrize("family", ATTN)
def test_sdpa_equals_eager(family):
    model = tiny(family)
    tokens, mask = batch()
    with torch.no_grad():
        with backends.use(attention="eager"):
            eager = model(tokens, attention_mask=mask)
            state = DecodeState()
            eager_steps = [model(tokens[:, :8], attention_mask=mask[:, :8], state=state),
                           model(tokens[:, 8:], attention_mask=mask[:, 8:], state=state)]
        with backends.use(attention="sdpa"):
            sdpa = model(tokens, attention_mask=mask)
            state = DecodeState()
            sdpa_steps = [model(tokens[:, :8], attention_mask=mask[:, :8], state=state),
                          model(tokens[:, 8:], attention_mask=mask[:, 8:], state=state)]
    real = mask.bool()  # padding queries are meaningless
    rel_close(sdpa[real], eager[real], 1e-6)
    rel_close(torch.cat(sdpa_steps, 1)[real], torch.cat(eager_steps, 1)[real], 1e-6)


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_no_scores_tensor_without_hooks_at_1024_tokens(family):
    model = tiny(family)
    tokens = torch.randint(1, V, (1, 1024), generator=torch.Generator().manual_seed(0))
    scores = model.blocks[0].attn.n_heads * 1024 * 1024
    sizes = {}
    for backend in ("eager", None):
        with torch.no_grad(), backends.use(attention=backend), LargestTensor() as probe:
            model(tokens)
        sizes[backend] = probe.numel
    assert sizes["eager"] >= scores  # the probe sees the scores where they exist
    assert set(used(model, ATTENTIONS).values()) == {"sdpa"} and sizes[None] < scores / 16


# ---------------------------------------------------------------------- host reads, compiling
SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "_unique2", "unique_dim", "unique_consecutive",
            "masked_select", "bincount"}
PY_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__"}


class HostReads(TorchDispatchMode):
    """Ops that read a device value on the host (each a wait for the GPU), counted while `on`."""

    def __init__(self):
        super().__init__()
        self.on, self.seen = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.overloadpacket.__name__ in SYNC_OPS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class PythonReads(TorchFunctionMode):
    def __init__(self, counter: HostReads):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counter.on and getattr(func, "__name__", "") in PY_READS:
            self.counter.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def reads_inside_blocks(model, run) -> list[str]:
    counter = HostReads()
    handles = [h for b in model.blocks for h in (b.register_forward_pre_hook(lambda *a: setattr(counter, "on", True)),
                                                  b.register_forward_hook(lambda *a: setattr(counter, "on", False)))]
    try:
        with counter, PythonReads(counter):
            run()
    finally:
        for h in handles:
            h.remove()
    return counter.seen


# families whose forward reads the host by design, and why
HOST_READS = {"qwen4_exp": "QSA selects each query's blocks with top-k on exactly HF's scores (ties broken as torch "
                           "breaks them on that vector), sized by the query's count of complete blocks"}


@pytest.mark.parametrize("scan", [None, "chunked", "fused"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in HOST_READS])
def test_no_host_read_inside_blocks_without_hooks(family, scan):
    model = tiny(family)
    tokens, mask = batch()
    with torch.no_grad(), backends.use(scan=scan):
        assert reads_inside_blocks(model, lambda: model(tokens)) == []
        assert reads_inside_blocks(model, lambda: model(tokens, attention_mask=mask)) == []


def test_the_host_read_counter_sees_reads():
    """Under autograd the MoE takes its per-call path (one read of the expert counts per layer)."""
    model = tiny("jamba")
    assert "tolist" in reads_inside_blocks(model, lambda: model(batch()[0]))


@pytest.fixture
def untyped():
    """jaxtyping's run-time checks off (pytest turns them on for hooked): dynamo cannot trace them."""
    import jaxtyping

    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", was)


def compiled_blocks(model, tokens):
    """The blocks alone, compiled as one graph (fullgraph: any break raises), and the plain result."""
    ctx = model.make_context(tokens.shape, None, tokens, tokens.device)
    resid = model.embed_input(tokens, ctx)

    def blocks(x):
        for block in model.blocks:
            x = block(x, ctx)
        return x

    torch._dynamo.reset()
    return torch.compile(blocks, fullgraph=True, backend="eager")(resid), blocks(resid)


def compile_failures() -> list[str]:
    """Every family's blocks compiled with fullgraph=True on the default path, and every SSM family's on
    the GPU paths (what CUDA chooses without `use`, which reads a context variable: forced here by
    replacing `backends.forced`); each failure as one line."""
    failures = []
    for family in (f for f in FAMILIES if f not in HOST_READS):  # a host read is a graph break
        for scan in (None, "chunked", "fused") if family in SSM else (None,):
            model, forced = tiny(family), backends.forced
            if scan is not None:
                backends.forced = lambda scan=scan: (scan, "sdpa")
            try:
                with torch.no_grad():
                    out, plain = compiled_blocks(model, batch()[0])
                if scan is not None and scan not in used(model).values():
                    failures.append(f"{family} {scan}: not chosen ({backends.active(model)})")
                if (out - plain).abs().max() > 1e-6 * plain.abs().max():
                    failures.append(f"{family} {scan}: compiled != plain")
            except Exception as e:  # noqa: BLE001 (reported, with the family)
                failures.append(f"{family} {scan}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            finally:
                backends.forced = forced
    return failures


def test_blocks_compile_as_one_graph_on_every_family():
    """In a fresh interpreter: pytest's run-time type checks (jaxtyping) wrap the constructors of
    hooked's classes in code dynamo cannot trace, which a user's process does not have."""
    code = ("import sys; sys.path[:0] = ['tests', '.']; import test_backends as t; f = t.compile_failures(); "
            "print('\\n'.join(f)); sys.exit(1 if f else 0)")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.parametrize("family", ["llama", "mamba"])
def test_explain_finds_breaks_outside_the_blocks_only(family, untyped):
    model = tiny(family)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(batch()[0])
    # the root's: the token range check (and, under pytest, the instrumented Context constructor)
    assert 1 <= explained.graph_break_count == len(explained.break_reasons)
    assert all(f.filename.endswith(("base.py", "language_model.py", "__init__.py")) for r in explained.break_reasons
               for f in r.user_stack), [r.user_stack for r in explained.break_reasons]


@pytest.mark.parametrize("family, name", [("llama", "blocks.1.hook_resid_mid"), ("llama", "blocks.0.attn.hook_pattern"),
                                          ("mamba", "blocks.1.mixer.hook_h"), ("mamba2", "blocks.0.mixer.hook_y")])
def test_hooks_added_after_compiling_fire(family, name, untyped):
    model = tiny(family)
    tokens = batch()[0]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    fired = []

    def double(x, hook):
        fired.append(tuple(x.shape))
        return x * 2

    with torch.no_grad():
        plain = compiled(tokens)
        remove = model.add_hook(name, double)[0]
        try:
            with_model_hook = compiled(tokens)
        finally:
            remove()
        with model.hooks(fwd_hooks=[(name, double)]):
            with_scoped_hook = compiled(tokens)
        again = compiled(tokens)
        expected = model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, h: x * 2)])
    assert fired == [model.hook_shape(name, *tokens.shape)] * 2
    assert not torch.allclose(with_model_hook, plain)
    rel_close(with_model_hook, expected, 1e-6)
    rel_close(with_scoped_hook, expected, 1e-6)
    assert torch.equal(again, plain)


# ---------------------------------------------------------------------------------------- MoE
def test_moe_grouped_and_per_call_paths_equal_each_expert_on_its_tokens():
    moe = next(m for m in tiny("jamba").modules() if isinstance(m, MoE))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, moe.router.in_features, generator=g)
    chosen = torch.randint(0, moe.n_experts, (13, moe.top_k), generator=g)
    chosen[:, 1] = (chosen[:, 0] + 1) % moe.n_experts  # distinct experts per token
    brute = torch.stack([torch.stack([moe.expert(int(e), x[i:i + 1])[0] for e in row]) for i, row in enumerate(chosen)])
    with torch.no_grad():
        assert moe._grouped_mm_applies(x)
        grouped = moe.expert_outputs(x, chosen)
    per_call = moe.expert_outputs(x, chosen)  # autograd: the per-call path
    assert per_call.requires_grad
    rel_close(grouped, brute, 1e-6)
    rel_close(per_call.detach(), brute, 1e-6)
    double = copy.deepcopy(moe).double()
    with torch.no_grad():
        assert not double._grouped_mm_applies(x.double())
        rel_close(double.expert_outputs(x.double(), chosen), brute.double(), 1e-6)
    dense = moe._every_expert(x).detach().gather(1, chosen[..., None].expand(13, moe.top_k, x.shape[1]))
    rel_close(dense, brute, 1e-6)


def test_moe_refuses_an_edited_choice_out_of_range():
    model = tiny("jamba")
    name = next(n for n in model.hook_dict if n.endswith("hook_chosen"))
    with pytest.raises(ValueError, match="chosen experts must be int64 ids"):
        model.run_with_hooks(batch()[0], fwd_hooks=[(name, lambda x, h: x + 100)])


# ---------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", SSM + ["llama", "qwen3", "gemma2"])
def test_on_cuda_the_default_path_equals_the_exact_path(family, dtype, rel, cuda):
    """What a hook-free forward picks on CUDA (fused where mamba-ssm imports, else chunked; SDPA) equals
    the exact path, reads nothing from the device inside the blocks, and a state hook gets "chunked"."""
    model = copy.deepcopy(tiny(family)).to(cuda, dtype)
    tokens, mask = (t.to(cuda) for t in batch())
    with torch.no_grad():
        with backends.use(scan="loop", attention="eager"):
            exact = model(tokens, attention_mask=mask)
        fast = model(tokens, attention_mask=mask)
        chosen = backends.active(model)
        assert reads_inside_blocks(model, lambda: model(tokens, attention_mask=mask)) == []
        mixers = [n for n, b in chosen.items() if b in SCANS]
        if mixers:
            model.run_with_cache(tokens, names_filter=[f"{mixers[-1]}.hook_h"])
            assert backends.active(model)[mixers[-1]] == "chunked"
    assert "loop" not in chosen.values()
    assert all(b == "sdpa" or family == "gemma2" for b in chosen.values() if b in ATTENTIONS)
    real = mask.bool()
    rel_close(fast[real].float(), exact[real].float(), rel)


def test_a_copy_of_a_hooked_model_keeps_the_original_on_the_exact_path():
    """Removing a deep copy's hooks leaves the original's counted: its pattern hook still fires (eager)."""
    model = copy.deepcopy(tiny("llama"))
    fired = []
    remove = model.add_hook("blocks.0.attn.hook_pattern", lambda x, hook: fired.append(x.shape))[0]
    try:
        twin = copy.deepcopy(model)
        twin.reset_hooks()
        del twin
        with torch.no_grad():
            model(batch()[0])
        assert fired and model.blocks[0].attn.last_backend == "eager"
    finally:
        remove()


class _CountingTap(torch.nn.Module):
    is_active = True

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


def test_a_tap_alone_keeps_its_layer_on_the_exact_path():
    """A tap (an SAE splice) on hook_pattern with no hook anywhere: the layer runs eager, the tap runs."""
    model = copy.deepcopy(tiny("llama"))
    point = model.blocks[0].attn.hook_pattern
    tap = _CountingTap()
    point.add_tap("counting", tap)
    try:
        with torch.no_grad():
            model(batch()[0])
        assert tap.calls == 1 and model.blocks[0].attn.last_backend == "eager"
    finally:
        point.remove_tap("counting")
    with torch.no_grad():
        model(batch()[0])
    assert model.blocks[0].attn.last_backend == "sdpa"


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_an_edited_decay_takes_the_exact_rule_on_the_fused_path(family, monkeypatch):
    """fla's kernels read log(alpha): a decay edited to 0 (or below) would give -inf / NaN there, so an edit of
    hook_alpha sends the layer to our rule (no kernel call), and the logits equal the exact path's."""
    calls = []

    def kernel(**kwargs):
        calls.append(kwargs)
        raise AssertionError("fla's rule was called on an edited decay")
    kernels = Kernels(chunk_gated_delta_rule=kernel, chunk_kda=kernel, real=False)
    monkeypatch.setattr(backends, "fused_kernels", lambda device: kernels)
    model = tiny(family)
    tokens, _ = batch()
    sites = [n for n in model.hook_dict if n.endswith("mixer.hook_alpha")]

    def zero(alpha, hook):
        return torch.zeros_like(alpha)
    with torch.no_grad():
        exact = model.run_with_hooks(tokens, fwd_hooks=[(s, zero) for s in sites])
        with backends.use(scan="fused"):
            fused = model.run_with_hooks(tokens, fwd_hooks=[(s, zero) for s in sites])
            with pytest.raises(AssertionError, match="was called"):  # unedited, the layers run the kernel
                model(tokens)
    assert len(calls) == 1 and torch.isfinite(fused).all()
    rel_close(fused, exact, 1e-5)
