"""The delta-rule ops against Hugging Face's torch paths, and the tiny HF models of the delta families.

HF's conventions, as these tests pin them (transformers 5.24): the rule takes the log-decay g (alpha =
exp(g)), beta, and q, k that it L2-normalises itself (use_qk_l2norm_in_kernel) and then scales q by
d_k^-1/2; the decay multiplies the old state before the delta correction reads it; value head h reads
q/k head h // (n_v / n_k). Ours take alpha and the q, k as read: l2norm(q) * d_k^-1/2, l2norm(k).
Compared: outputs and final states of our sequential and chunked forms against HF's chunked (at its
chunk sizes 16 and 64) and recurrent paths of every family module (their copies are separate code),
lengths across chunk boundaries, with and without an initial state, grouped q/k heads, OLMo-hybrid's
beta in [0, 2]; KDA against Kimi Linear's per-channel paths. float32 against HF as it runs (float32
inside, within 2e-5 of the output's scale); float64 against HF's source run in float64 (1e-12).
"""

import pytest
import torch
import torch.nn.functional as F
from delta_oracles import RULES, TINY, hf_delta_rule, tiny_delta_hf

from hooked.ops import delta_rule_chunked, delta_rule_sequential, l2norm
from hooked.ops.norms import rms_norm_gated

LENGTHS = [1, 5, 16, 17, 40, 64, 65]
REL = {torch.float32: 2e-5, torch.float64: 1e-12}
GDN_MODULES = [m for m in RULES if m != "kimi_linear"]


def hf_inputs(seq_len: int, dtype: torch.dtype, kda: bool, initial: bool, beta_max: float = 1.0, seed: int = 0):
    """HF's arguments (raw q, k; log-decay g) for 2 q/k heads and 4 value heads (KDA: 4 and 4)."""
    g = torch.Generator().manual_seed(seed + seq_len)
    batch, n_k, n_v, d_k, d_v = 2, (4 if kda else 2), 4, 8, 6

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    gate_shape = (batch, seq_len, n_v, d_k) if kda else (batch, seq_len, n_v)
    log_decay = -F.softplus(randn(*gate_shape) + 1) * 2  # as -exp(A_log) softplus(a + dt_bias)
    return dict(query=randn(batch, seq_len, n_k, d_k), key=randn(batch, seq_len, n_k, d_k),
                value=randn(batch, seq_len, n_v, d_v), g=log_decay,
                beta=beta_max * torch.sigmoid(randn(batch, seq_len, n_v)),
                initial_state=randn(batch, n_v, d_k, d_v) if initial else None)


def ours(inp, fn, **kwargs):
    d_k = inp["key"].shape[-1]
    q, k = l2norm(inp["query"]) * d_k**-0.5, l2norm(inp["key"])
    return fn(q, k, inp["value"], inp["beta"], torch.exp(inp["g"]), inp["initial_state"], **kwargs)


def rel_close(actual, expected, rel, what):
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check(module, inp, dtype):
    chunked, recurrent = hf_delta_rule(module, dtype)
    refs = {
        "hf chunked 16": chunked(**inp, chunk_size=16, output_final_state=True, use_qk_l2norm_in_kernel=True),
        "hf chunked 64": chunked(**inp, output_final_state=True, use_qk_l2norm_in_kernel=True),
        "hf recurrent": recurrent(**inp, output_final_state=True, use_qk_l2norm_in_kernel=True),
    }
    mine = {"sequential": ours(inp, delta_rule_sequential),
            "chunked 16": ours(inp, delta_rule_chunked, chunk_size=16),
            "chunked 7": ours(inp, delta_rule_chunked, chunk_size=7)}
    for ref_name, (o_ref, S_ref) in refs.items():
        assert o_ref.dtype == dtype
        for name, (o, S) in mine.items():
            rel_close(o, o_ref, REL[dtype], f"{name} vs {ref_name}: o")
            rel_close(S, S_ref.to(dtype), REL[dtype], f"{name} vs {ref_name}: final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("seq_len", LENGTHS)
@pytest.mark.parametrize("module", GDN_MODULES)
def test_gated_delta_rule_equals_hf(module, seq_len, initial, dtype):
    beta_max = 2.0 if module == "olmo_hybrid" else 1.0  # linear_allow_neg_eigval
    check(module, hf_inputs(seq_len, dtype, kda=False, initial=initial, beta_max=beta_max), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_kda_equals_kimi_linear(seq_len, initial, dtype):
    check("kimi_linear", hf_inputs(seq_len, dtype, kda=True, initial=initial), dtype)


def test_float64_oracle_is_not_hf_float32():
    """The float64 oracle computes in float64: it agrees with ours far below HF's float32 rounding."""
    inp = hf_inputs(40, torch.float64, kda=False, initial=True)
    o, _ = ours(inp, delta_rule_sequential)
    hf32 = hf_delta_rule("qwen3_next", torch.float32)[0](**inp, use_qk_l2norm_in_kernel=True)[0]
    hf64 = hf_delta_rule("qwen3_next", torch.float64)[0](**inp, use_qk_l2norm_in_kernel=True)[0]
    assert (o - hf32).abs().max() > 1e-9 > (o - hf64).abs().max()


# ---------------------------------------------------------------- the gated output norms
GATED_NORMS = {  # HF class path: the gate's activation
    "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated": F.silu,
    "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNormGated": F.silu,
    "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNormGated": F.silu,
    "kimi_linear.modeling_kimi_linear.KimiLinearRMSNormGated": torch.sigmoid,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("path", list(GATED_NORMS))
def test_rms_norm_gated_equals_hf(path, dtype):
    """Normalise, then gate, per head over d_v. HF computes in float32 (so float64 agrees to float32's
    rounding); in bfloat16 Qwen's order is ours exactly, Kimi's keeps the weight product in float32."""
    module_path, cls = path.rsplit(".", 1)
    hf = getattr(__import__(f"transformers.models.{module_path}", fromlist=[cls]), cls)(6, eps=1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * torch.randn(6, generator=g))
    hf = hf.to(dtype)
    x, gate = (3 * torch.randn(2, 7, 4, 6, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    ours = rms_norm_gated(x, gate, hf.weight, 1e-5, GATED_NORMS[path])
    ref = hf(x, gate)
    assert ours.dtype == ref.dtype == dtype
    if dtype == torch.bfloat16 and "Kimi" not in cls:
        assert torch.equal(ours, ref)
    rel = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}[dtype]
    rel_close(ours.double(), ref.double(), rel, cls)


# ---------------------------------------------------------------- tiny HF models
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("model_type", list(TINY))
def test_tiny_model_runs_on_cpu(model_type, dtype):
    hf, config = tiny_delta_hf(model_type, dtype=dtype)
    assert config.model_type == model_type
    assert len(set(config.layer_types)) == 2, "both layer types"
    tokens = torch.randint(1, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True, use_cache=False)
    assert out.logits.shape == (2, 19, config.vocab_size) and out.logits.dtype == dtype
    assert torch.isfinite(out.logits).all()
    assert len(out.hidden_states) == config.num_hidden_layers + 1


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_tiny_models_have_dense_and_moe_layers(model_type):
    hf, _ = tiny_delta_hf(model_type)
    kinds = {type(layer.mlp).__name__ for layer in hf.model.layers}
    assert len(kinds) == 2, kinds


def test_delta_functions_are_the_torch_paths():
    """After force_torch_paths the modeling modules call the plain torch functions (no fla wrapper)."""
    import inspect

    for module, names in RULES.items():
        modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["x"])
        for name in names:
            fn = getattr(modeling, name)
            assert inspect.unwrap(fn) is fn and fn.__module__ == modeling.__name__, (module, name)
