"""RecurrentGemma (Griffin: RG-LRU recurrent blocks beside local MQA): parity with HF transformers 5.24 and the
RG-LRU mixer's invariants (issue 41).

Parity, per variant (MQA with a 4-token window and lru_width != d_model; GQA with q/k/v biases, a 3-tap conv,
an untied head and alternating layers): float32 logits, the embedding and every resid_post within 1e-4 of HF's
max magnitude; float64 within 1e-10 of HF's float64 model with its float32 parts made float64 (RMSNorms, the
rotary table, the RG-LRU's float32 accumulator); each left-padded row == that prompt alone == HF on the prompt
alone (HF itself lets padding through the conv, and resets the recurrence at position 0, not at the first real
token); decoding step by step from a DecodeState == the whole sequence == HF; save_pretrained ->
from_pretrained bit for bit; HF's default (recurrentgemma-2b) and a 9B-sized config on meta with HF's shape
for every tensor and its parameter count; configs HF rejects (more kv heads than heads) or cannot run (an
lru_width the gates' blocks do not divide) refused by name.

The mixer (float64): the ops agree (sequential oracle == scan == chunked scan; kernel == a brute-force
product, rows and columns == its slices, also across resets), y == K . x (1e-12) and hook_h == a brute-force
recurrence on the model's own gates; knockout == zeroing the cut entries of hook_kernel (all channels and
some); ablate_heads == zeroing out_proj's columns; kernel_rows / kernel_cols == slices of hook_kernel; and
knockout, ablation, G&A scores and ranking, info_flow, patching and decay_split run on it. The every-family
tests (tiny_families.py) add state edits, decode-step knockout, the model map, attribution and circuits.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import transformers
from einops import einsum
from hybrid_checks import (check_ablation_zeroes_columns, check_against_hf, check_decoding,
                           check_knockout_equals_kernel_zeroing, check_released_on_meta, check_rows_alone,
                           check_save_pretrained, close, perturbed)
from test_parity_dense_families import _float64_method

from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, decay_split, knockout, patch
from analysis.kernel_rows import kernel_cols, kernel_rows, ssm_sites
from analysis.tasks.known_facts import load_facts
from analysis.tasks.text import char_tokenizer, kv_retrieval
from hooked import backends
from hooked.ops.rg_lru import rg_lru_kernel, rg_lru_kernel_cols, rg_lru_kernel_rows, rg_lru_scan, rg_lru_sequential
from hooked.ops.rotary import rope_inv_freq
from loaders.load import from_hf
from loaders.registry import REGISTRY

V = 128  # the char tokenizer's ids fit
BASE = dict(vocab_size=V, hidden_size=16, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
            num_hidden_layers=3, lru_width=24, attention_window_size=4,
            block_types=["recurrent", "recurrent", "attention"])
VARIANTS = {
    "mqa_window4": {},
    "gqa_bias_untied": dict(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False, conv1d_width=3,
                            lru_width=16, num_hidden_layers=4, attention_window_size=6,
                            block_types=["recurrent", "attention"], logits_soft_cap=5.0),
}
RELEASED = {  # HF config.json fields: HF's defaults (its docs: "similar to recurrentgemma-2b"), a 9B-sized one
    "2b": dict(model_type="recurrent_gemma", architectures=["RecurrentGemmaForCausalLM"]),
    "9b_sized": dict(model_type="recurrent_gemma", architectures=["RecurrentGemmaForCausalLM"], hidden_size=4096,
                     intermediate_size=3 * 4096 * 2, num_attention_heads=16, num_key_value_heads=1,
                     num_hidden_layers=38, lru_width=4096),
}


def make_hf(variant: str = "mqa_window4", dtype: torch.dtype = torch.float32, attn: str = "eager"):
    config = transformers.RecurrentGemmaConfig(**{**BASE, **VARIANTS[variant]})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return perturbed(transformers.RecurrentGemmaForCausalLM(config), scale=0.2).to(dtype)


@functools.cache
def model64(variant: str = "mqa_window4"):
    model = from_hf(make_hf(variant, torch.float64))
    model.tokenizer = char_tokenizer()
    return model


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))



# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_and_every_resid_equal_hf(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    check_against_hf(hf, model, tokens())
    with backends.use(scan="chunked"):  # the two-level scan and its conv: the same numbers to float32's
        check_against_hf(hf, model, tokens(pos=29))


def hf_in_float64(hf):
    """`hf` (float64, SDPA) with its float32 parts computing in float64: the RMSNorms and the rotary forward (their
    casts replaced), the rotary frequencies recomputed in float64, the RG-LRU's accumulator (acc_dtype)."""
    for module in hf.modules():
        name = type(module).__name__
        if name.endswith(("RMSNorm", "RotaryEmbedding")):
            module.forward = types.MethodType(_float64_method(type(module).forward), module)
        if name.endswith("RotaryEmbedding"):
            d_rot = int(hf.config.head_dim * hf.config.rope_parameters["partial_rotary_factor"])
            module.inv_freq = rope_inv_freq(d_rot, hf.config.rope_parameters["rope_theta"], {}, torch.float64)
        if name.endswith("Rglru"):
            module._rnn_scan = functools.partial(type(module)._rnn_scan, module, acc_dtype=torch.float64)
    return hf


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_equals_hf_with_its_float32_parts_made_float64(variant):
    hf = hf_in_float64(make_hf(variant, torch.float64, attn="sdpa"))
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    check_against_hf(hf, model, tokens(pos=17), rel=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_each_prompt_alone_and_hf_alone(variant):
    hf = make_hf(variant)
    check_rows_alone(hf, from_hf(hf))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_the_state_equals_recompute_and_hf(variant):
    """Prefill 5 tokens, then one at a time past the window: the conv window, h and the keys carried."""
    hf = make_hf(variant)
    check_decoding(hf, from_hf(hf), tokens(pos=14))


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    check_save_pretrained(make_hf(variant), tokens(), tmp_path)


@pytest.mark.parametrize("size", RELEASED)
def test_released_config_builds_hf_shapes_on_meta(size):
    check_released_on_meta(RELEASED[size], "recurrent_gemma", transformers.RecurrentGemmaForCausalLM)
    # (2b: 2,010,263,040 parameters with HF's defaults)


def test_configs_hf_rejects_or_cannot_run_are_refused_by_name():
    arch = REGISTRY["recurrent_gemma"]
    fields = dict(BASE, model_type="recurrent_gemma", num_key_value_heads=8)
    with pytest.raises(Exception, match="num_key_value_heads"):  # HF's own refusal (a strict-dataclass error)
        transformers.RecurrentGemmaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        arch.config_from_hf(fields)
    with pytest.raises(ValueError, match="lru_width .* multiple of n_heads"):  # HF builds it, its forward fails
        arch.config_from_hf(dict(BASE, lru_width=18))
    with pytest.raises(ValueError, match="block types"):
        arch.config_from_hf(dict(BASE, block_types=["recurrent", "mlp"]))


# ------------------------------------------------------------------------------------------- ops
def _ops_inputs(reset_rows: bool):
    g = torch.Generator().manual_seed(0)
    log_a = -torch.rand(2, 37, 5, generator=g, dtype=torch.float64) * 0.3
    if reset_rows:  # a reset (a = 0) at position 0 of both rows and inside row 1's left padding
        log_a[:, 0] = -torch.inf
        log_a[1, :9] = -torch.inf
    w = torch.rand(2, 37, 5, generator=g, dtype=torch.float64)
    x = torch.randn(2, 37, 5, generator=g, dtype=torch.float64)
    return log_a, w, x


@pytest.mark.parametrize("reset_rows", [False, True])
def test_ops_scan_kernel_rows_and_cols_agree_with_the_oracle(reset_rows):
    log_a, w, x = _ops_inputs(reset_rows)
    a = torch.exp(log_a)
    h = rg_lru_sequential(a, w * x)
    h0 = torch.randn(2, 5, dtype=torch.float64)
    close(rg_lru_scan(a, w * x), h, "scan")
    close(rg_lru_scan(a, w * x, chunked=True), h, "chunked scan")
    close(rg_lru_scan(a, w * x, h0, chunked=True), rg_lru_sequential(a, w * x, h0), "chunked scan from h0")
    K = rg_lru_kernel(log_a, w)
    brute = torch.zeros_like(K)
    for j in range(K.shape[-1]):
        for i in range(j + 1):
            brute[:, :, j, i] = a[:, i + 1:j + 1].prod(1) * w[:, i]
    close(K, brute, "kernel vs brute-force products")
    close(einsum(K, x, "b d j i, b i d -> b j d"), h, "K . x vs the recurrence")
    idx = torch.tensor([36, 0, 17, 17, 8])
    close(rg_lru_kernel_rows(log_a, w, idx, chunk_size=8), K[:, :, idx], "rows")
    close(rg_lru_kernel_cols(log_a, w, idx, chunk_size=8), K[..., idx], "cols")


def test_gradients_equal_hfs_and_stay_finite_where_a_decay_rounds_to_one():
    """Training through our model: every parameter's gradient equals HF's (float32), and with one channel's
    decay at exactly 1 the multiplier's sqrt gradient is clipped as HF clips it (no inf, no NaN)."""
    for saturate in (False, True):
        hf = make_hf().train()
        if saturate:
            with torch.no_grad():
                hf.model.layers[1].temporal_block.rg_lru.recurrent_param[3] = -200.0  # softplus -> 0: a = 1
        model = from_hf(hf, share_weights=True).train()
        toks = tokens(pos=20)
        loss = lambda logits: torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), toks[:, 1:].flatten())  # noqa: E731
        loss(hf(toks, use_cache=False).logits).backward()
        ours = dict(model.named_parameters())
        grads = torch.autograd.grad(loss(model(toks)), list(ours.values()))
        theirs = {p.data_ptr(): p.grad for p in hf.parameters()}
        for (name, p), g in zip(ours.items(), grads):
            want = theirs[p.data_ptr()].view_as(g)
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, want, rtol=0, atol=1e-5 * want.abs().max().item(), msg=name)


# ------------------------------------------------------------------------------ the model's mixer
SITE = "blocks.1.mixer"


def test_kernel_and_states_equal_a_brute_force_recurrence_on_the_models_gates():
    model = model64()
    names = [f"{SITE}.hook_{n}" for n in ("x", "input_gate", "recurrent_gate", "a", "multiplier", "h", "kernel", "y")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(pos=21), names_filter=names)
    x, i, r, a, m, h, K, y = (cache[n] for n in names)
    mixer = model.get_submodule(SITE)
    a_ref = torch.exp(-8.0 * r * torch.nn.functional.softplus(mixer.recurrent_param)).clone()
    a_ref[:, 0] = 0  # position 0 is a reset
    close(a, a_ref, "a")
    close(m, torch.sqrt(1 - a_ref**2), "multiplier")
    h_ref = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h_ref = a_ref[:, t] * h_ref + torch.sqrt(1 - a_ref[:, t] ** 2) * i[:, t] * x[:, t]
        close(h[:, t, :, 0], h_ref, f"h_{t}")
    close(y, h[..., 0], "y is the states")
    close(einsum(K, x, "b d j i, b i d -> b j d"), y, "K . x vs y")


@pytest.mark.parametrize("in_place", [False, True])
def test_an_edited_decay_is_what_the_recurrence_and_its_multiplier_read(in_place):
    model, toks = model64(), tokens(pos=11)
    names = [f"{SITE}.hook_{n}" for n in ("x", "input_gate", "a", "multiplier", "y")]

    def halve(a, hook):
        if in_place:
            a[:, 4:7] *= 0.5
            return None
        a = a.clone()
        a[:, 4:7] *= 0.5
        return a
    with torch.no_grad(), model.hooks(fwd_hooks=[(f"{SITE}.hook_a", halve)]):
        _, cache = model.run_with_cache(toks, names_filter=names)
    x, i, a, m, y = (cache[n] for n in names)
    close(m, torch.sqrt(1 - a**2), "multiplier from the edited a")
    h, ys = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + torch.sqrt(1 - a[:, t] ** 2) * i[:, t] * x[:, t]
        ys.append(h)
    close(y, torch.stack(ys, 1), "y from the edited decays")


@pytest.mark.parametrize("channels", [None, [0, 5, 23]])
def test_knockout_equals_zeroing_the_cut_entries_of_the_kernel(channels):
    model, toks = model64(), tokens(pos=12)
    if channels is None:
        check_knockout_equals_kernel_zeroing(model, toks, 1, [1, 3, 6], [6, 9, 11], knockout)
        return

    def zero(K, hook):
        K = K.clone()
        for j in (6, 9, 11):
            for i in (1, 3, 6):
                K[:, channels, j, i] = 0
        return K
    with torch.no_grad():
        with knockout(model, sources=[1, 3, 6], targets=[6, 9, 11], layers=[1], channels=channels):
            cut = model(toks)
        ref = model.run_with_hooks(toks, fwd_hooks=[(f"{SITE}.hook_kernel", zero)])
        plain = model(toks)
    close(cut, ref, "knockout on channels vs zeroed entries", 1e-10)
    assert not torch.allclose(cut, plain)


@pytest.mark.parametrize("keep", [False, True])
def test_ablate_heads_equals_zeroing_out_proj_columns(keep):
    listed = [0, 7, 23]
    check_ablation_zeroes_columns(model64(), tokens(pos=12), [(SITE, c) for c in listed], f"{SITE}.out_proj.weight",
                                  listed, ablate_heads, keep=keep)


def test_kernel_rows_and_cols_are_slices_of_hook_kernel():
    model, x = model64(), tokens(pos=70)
    sites = ssm_sites(model)
    assert sites == ["blocks.0.mixer", "blocks.1.mixer"]
    rows, cols = [3, 64, -1], [0, 63, 65]
    with torch.no_grad():
        _, cache = model.run_with_cache(x, names_filter=[f"{s}.hook_kernel" for s in sites])
        got_rows, got_cols = kernel_rows(model, x, rows), kernel_cols(model, x, cols)
    for s in sites:
        K = cache[f"{s}.hook_kernel"]
        close(got_rows[s], K[:, :, [3, 64, 69]], f"{s} rows")
        close(got_cols[s], K[..., cols], f"{s} cols")


def test_analyses_run_on_recurrent_gemma():
    model = from_hf(make_hf())
    model.tokenizer = char_tokenizer()
    x = tokens(pos=9)
    units = head_units(model)
    assert {u.module.rsplit(".", 1)[1] for u in units} == {"attn", "mixer"}
    with torch.no_grad():
        with backends.use(attention="eager"):
            plain = model(x)
        with knockout(model, sources=[1, 2], targets=[-1], layers=range(model.cfg.n_layers), cut_conv=True):
            cut = model(x)
        with ablate_heads(model, [units[0].specs()[0], units[-1].specs()[0]]):
            ablated = model(x)
        _, clean_cache = model.run_with_cache(tokens(pos=9, seed=5), names_filter=[f"{SITE}.hook_h"])
        patched = patch(model, x, clean_cache, f"{SITE}.hook_h", index={"pos": 4})
    assert not torch.allclose(cut[:, -1], plain[:, -1])
    torch.testing.assert_close(cut[:, :-1], plain[:, :-1], rtol=0, atol=1e-6 * plain.abs().max().item())
    assert not torch.allclose(ablated, plain) and not torch.allclose(patched, plain)
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:3], batch_size=2, pairs_top_k=0, progress=False)
    assert len(ranking.rows) == 3
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()
    split = decay_split(model, 0)
    mixer = model.blocks[0].mixer
    norms = torch.exp(-8.0 * torch.nn.functional.softplus(mixer.recurrent_param.double()))
    assert set(split.fastest.tolist()) == set(norms.argsort()[:8].tolist())
