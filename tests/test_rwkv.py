"""RWKV-4 (HF `rwkv`: time mixing with the WKV recurrence, channel mixing): parity with HF transformers 5.24 and
the WKV mixer's invariants (issue 41).

Parity, per variant (att_width != d_model, rescaled every 2 layers; tied, no rescaling, another eps): float32
logits and the embedding equal HF's eval mode (HF itself computes the WKV states in float32, so there is no
float64 HF to compare with); every hook_resid_post equals HF's eval hidden state times 2^c exactly (c = its
halvings: hooked/models/rwkv.py); with rescale_every=None the resid_posts are HF's train-mode ones; left-padded
rows == the prompt alone == HF alone (HF ignores attention_mask); decoding step by step == the whole sequence
== HF; save_pretrained -> from_pretrained bit for bit; rwkv-4-169m's and HF's default config on meta with HF's
shapes and parameter count; bad configs refused by name, and from_hf of an HF model whose eval forward has
rescaled its weights in memory.

The mixer (float64): oracle == HF's max-tracking scan (from a state, with keys at -inf); the kernel == its
formula, rows and columns == its slices, rows sum to 1; on the model y == K . v (1e-12); knockout == zeroing
the cut kernel entries and renormalising each row over what is left (all channels, some; a row with every term
cut gives 0); an edited kernel adds (K' - K) v; cut_conv zeroes the token shift of targets after a source;
two knockouts sharing a target are refused; ablate_heads == zeroing output columns; kernel rows / cols ==
slices of hook_kernel; the analyses run. The every-family tests (tiny_families.py) add state edits,
decode-step knockout, the model map, attribution and circuits.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from einops import einsum
from hybrid_checks import (assert_rel_close, check_ablation_zeroes_columns, check_decoding, check_released_on_meta,
                           check_rows_alone, check_save_pretrained, close, perturbed)

from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, decay_split, knockout, patch
from analysis.kernel_rows import kernel_cols, kernel_rows, ssm_sites
from analysis.tasks.known_facts import load_facts
from analysis.tasks.text import char_tokenizer, kv_retrieval
from hooked.ops.rwkv import true_states, wkv_kernel_slice, wkv_scan, wkv_sequential
from loaders.load import from_hf
from loaders.registry import REGISTRY

V = 128  # the char tokenizer's ids fit
BASE = dict(vocab_size=V, hidden_size=16, attention_hidden_size=12, intermediate_size=24, num_hidden_layers=4,
            rescale_every=2)
VARIANTS = {
    "att12_rescale2": {},
    "tied_plain": dict(attention_hidden_size=16, tie_word_embeddings=True, rescale_every=0, layer_norm_epsilon=1e-3,
                       num_hidden_layers=3),
}
RELEASED = {  # HF config.json fields: RWKV/rwkv-4-169m-pile's, and HF's defaults (a 7B-sized one)
    "169m": dict(model_type="rwkv", architectures=["RwkvForCausalLM"], vocab_size=50277, hidden_size=768,
                 num_hidden_layers=12, context_length=1024, rescale_every=6),
    "default": dict(model_type="rwkv", architectures=["RwkvForCausalLM"]),
}


def make_hf(variant: str = "att12_rescale2", dtype: torch.dtype = torch.float32, **extra):
    config = transformers.RwkvConfig(**{**BASE, **VARIANTS[variant], **extra})
    torch.manual_seed(0)
    return perturbed(transformers.RwkvForCausalLM(config), scale=0.2).to(dtype)


def pair(variant: str = "att12_rescale2", **extra):
    """(HF in eval mode, ours): ours is read before HF's first eval forward rescales its weights in memory."""
    hf = make_hf(variant, **extra)
    return hf, from_hf(hf)


@functools.cache
def model64(variant: str = "att12_rescale2"):
    model = from_hf(make_hf(variant, torch.float64))
    model.tokenizer = char_tokenizer()
    return model


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))



# ------------------------------------------------------------------------------------------ parity
def _resid_posts(model, toks):
    logits, cache = model.run_with_cache(toks, names_filter=lambda n: "resid_post" in n or n == "hook_embed")
    return logits, cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_and_every_resid_equal_hf_eval(variant):
    hf, model = pair(variant)
    toks = tokens(pos=17)
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = _resid_posts(model, toks)
    assert_rel_close(logits, out.logits, "logits")
    embed = hf.rwkv.blocks[0].pre_ln(hf.rwkv.embeddings(toks))
    assert_rel_close(cache["hook_embed"], embed, "embedding after pre_ln")
    for layer in range(model.cfg.n_layers):  # HF's hidden_states[l]: block l's output, halved c times
        c = model.cfg.halvings(layer + 1)
        assert_rel_close(cache[f"blocks.{layer}.hook_resid_post"] / 2**c, out.hidden_states[layer], f"resid {layer}")
    assert torch.equal(logits, out.logits)  # powers of two and the eps scaled by 4^c: HF's numbers to the bit


def test_without_rescaling_the_resid_posts_are_hfs_train_mode_ones():
    hf = make_hf().train()  # train mode: HF neither rescales nor halves (RWKV has no dropout)
    cfg = REGISTRY["rwkv"].config_from_hf({**hf.config.to_dict(), "rescale_every": 0})
    assert cfg.rescale_every is None
    model = from_hf(hf)
    plain = REGISTRY["rwkv"].build(cfg)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.unembed.weight = model.unembed.weight
    toks = tokens()
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = _resid_posts(plain, toks)
    assert_rel_close(logits, out.logits, "logits")
    for layer in range(cfg.n_layers):
        assert_rel_close(cache[f"blocks.{layer}.hook_resid_post"], out.hidden_states[layer], f"resid {layer}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_each_prompt_alone_and_hf_alone(variant):
    check_rows_alone(*pair(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_the_state_equals_recompute_and_hf(variant):
    """Prefill 5 tokens, then one at a time: both token shifts' last inputs and the WKV state carried."""
    check_decoding(*pair(variant), tokens(pos=14))


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    check_save_pretrained(make_hf(variant), tokens(), tmp_path)


@pytest.mark.parametrize("size", RELEASED)
def test_released_config_builds_hf_shapes_on_meta(size):
    check_released_on_meta(RELEASED[size], "rwkv", transformers.RwkvForCausalLM)  # (169m: 169,342,464 parameters)


def test_bad_configs_and_rescaled_hf_weights_are_refused_by_name():
    arch = REGISTRY["rwkv"]
    with pytest.raises(ValueError, match="att_width"):
        arch.config_from_hf(dict(BASE, model_type="rwkv", attention_hidden_size=-3))
    with pytest.raises(Exception, match="hidden_size"):  # HF's own refusal (a strict-dataclass error)
        transformers.RwkvConfig(**dict(BASE, hidden_size="16"))
    hf = make_hf()
    with torch.no_grad():
        hf(tokens(), use_cache=False)  # eval mode: HF divides the output weights in memory
    with pytest.raises(ValueError, match="layers_are_rescaled"):
        from_hf(hf)
    with pytest.raises(ValueError, match="fold_ln: RWKV's token shift"):
        from_hf(make_hf(), fold_ln=True)


# ------------------------------------------------------------------------------------------- ops
def _ops_inputs(pad: bool):
    g = torch.Generator().manual_seed(0)
    w = -torch.exp(torch.randn(5, generator=g, dtype=torch.float64))
    u = torch.randn(5, generator=g, dtype=torch.float64)
    k = 3 * torch.randn(2, 23, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 23, 5, generator=g, dtype=torch.float64)
    if pad:  # row 1 left-padded: its first 6 keys write nothing
        k[1, :6] = -torch.inf
    return w, u, k, v


@pytest.mark.parametrize("pad", [False, True])
def test_ops_scan_kernel_rows_and_cols_agree_with_the_oracle(pad):
    w, u, k, v = _ops_inputs(pad)
    y, h = wkv_sequential(w, u, k.clamp_min(-700), v)  # (e^-700 = 0 in the sum: -inf's meaning in true scale)
    y_scan, scaled, log_den = wkv_scan(w, u, k, v)
    if pad:
        y[1, :6] = 0  # nothing written yet: 0 by definition (the oracle divides 0 by 0)
        h[1, :6] = 0
    close(y_scan, y, "scan vs oracle")
    close(true_states(scaled), h, "scaled states vs oracle")
    h0 = torch.rand(2, 5, 2, dtype=torch.float64) + 0.1
    scaled0 = torch.cat([h0 * torch.exp(torch.tensor(-4.0, dtype=torch.float64)), torch.full_like(h0[..., :1], 4.0)], -1)  # a = a' e^m
    close(wkv_scan(w, u, k, v, scaled0)[0], wkv_sequential(w, u, k.clamp_min(-700), v, h0)[0], "scan from a state")
    K = wkv_kernel_slice(w, u, k, log_den)
    brute = torch.zeros_like(K)
    for t in range(k.shape[1]):
        s = torch.stack([(t - 1 - i) * w + k[:, i] if i < t else u + k[:, t] for i in range(t + 1)], -1)
        if not (pad and t < 6):
            brute[0, :, t, :t + 1] = torch.softmax(s[0], -1)
            brute[1, :, t, :t + 1] = torch.softmax(s[1], -1)
        else:
            brute[0, :, t, :t + 1] = torch.softmax(s[0], -1)
    close(K, brute, "kernel vs a softmax of the scores")
    close(einsum(K, v, "b c t i, b i c -> b t c"), y_scan, "K . v vs the recurrence")
    real = torch.ones(2, 23, dtype=torch.bool)
    real[1, :6] = not pad
    close(K.sum(-1)[real[:, None].expand(-1, 5, -1)], torch.ones(2 * 5 * 23 - (30 if pad else 0), dtype=torch.float64),
          "rows sum to 1")
    idx = torch.tensor([22, 0, 9, 9, 4])
    close(wkv_kernel_slice(w, u, k, log_den, rows=idx), K[:, :, idx], "rows")
    close(wkv_kernel_slice(w, u, k, log_den, cols=idx), K[..., idx], "cols")


def test_the_scan_stays_finite_where_e_to_the_key_overflows():
    w, u, k, v = (x.float() for x in _ops_inputs(False))
    y = wkv_scan(w, u, k + 200.0, v)[0]  # e^200 is inf in float32: the max tracking never forms it
    y_ref = wkv_scan(w.double(), u.double(), k.double(), v.double())[0]  # a common shift of every key: same y
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-4)  # (float32 keys near 200: 1e-5 apart)


# ------------------------------------------------------------------------------ the model's mixer
SITE = "blocks.1.mixer"
CUT_T, CUT_S = [6, 9, 11], [1, 3, 6]


def _io(model, toks, hooks=()):
    names = [f"{SITE}.hook_{n}" for n in ("k", "v", "kernel", "y")]
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        logits, cache = model.run_with_cache(toks, names_filter=names)
    return logits, [cache[n] for n in names]


def test_y_equals_kernel_times_values_on_the_model():
    _, (k, v, K, y) = _io(model64(), tokens(pos=21))
    close(einsum(K, v, "b c t i, b i c -> b t c"), y, "K . v vs y")
    close(K.sum(-1), torch.ones_like(K.sum(-1)), "rows sum to 1")


def _renormalised(K, targets, sources, channels=None):
    """The brute force of the knockout's meaning: zero K[t, i] for t in targets, i in sources (i <= t), then
    divide each cut row by what is left of its sum (0 where nothing is left)."""
    K = K.clone()
    chans = slice(None) if channels is None else channels
    for t in targets:
        row = K[:, chans, t].clone()
        for i in sources:
            if i <= t:
                row[..., i] = 0
        total = row.sum(-1, keepdim=True)
        K[:, chans, t] = torch.where(total > 0, row / torch.where(total > 0, total, 1.0), 0.0)
    return K


@pytest.mark.parametrize("channels", [None, [0, 5, 11]])
def test_knockout_equals_zeroing_the_cut_entries_and_renormalising(channels):
    model, toks = model64(), tokens(pos=12)
    _, (_, v, K, y) = _io(model, toks)
    with knockout(model, sources=CUT_S, targets=CUT_T, layers=[1], channels=channels):
        _, (_, _, _, y_cut) = _io(model, toks)
    close(y_cut, einsum(_renormalised(K, CUT_T, CUT_S, channels), v, "b c t i, b i c -> b t c"), "knockout")
    assert not torch.allclose(y_cut, y)

    def renormalise(kernel, hook):  # the same cut as an edit of hook_kernel (y += (K' - K) v): equal logits
        return _renormalised(kernel, CUT_T, CUT_S, channels)
    with torch.no_grad():
        with knockout(model, sources=CUT_S, targets=CUT_T, layers=[1], channels=channels):
            cut = model(toks)
        edited = model.run_with_hooks(toks, fwd_hooks=[(f"{SITE}.hook_kernel", renormalise)])
    close(cut, edited, "knockout vs the renormalised kernel as an edit", 1e-10)


def test_a_row_with_every_term_cut_reads_nothing():
    model, toks = model64(), tokens(pos=8)
    with knockout(model, sources=list(range(5)), targets=[4], layers=[1]):
        _, (_, _, _, y) = _io(model, toks)
    assert torch.equal(y[:, 4], torch.zeros_like(y[:, 4]))


def test_cut_conv_zeroes_the_token_shift_of_targets_after_a_source():
    model, toks = model64(), tokens(pos=10)
    names = [f"{SITE}.hook_shift", f"{SITE}.hook_y"]
    with torch.no_grad():
        _, clean = model.run_with_cache(toks, names_filter=names)
        with knockout(model, sources=[2, 5], targets=[3, 5, 9], layers=[1], cut_conv=True):
            _, cut = model.run_with_cache(toks, names_filter=names)
    shift = clean[names[0]].clone()
    shift[:, 3] = 0  # 3 <- 2 cut; 5 <- 4 and 9 <- 8 are not edges from a source
    close(cut[names[0]], shift, "shift")
    with pytest.raises(ValueError, match="share a target"):
        with knockout(model, sources=[1], targets=[5], layers=[1]), knockout(model, sources=[2], targets=[5], layers=[1]):
            model(toks)


@pytest.mark.parametrize("keep", [False, True])
def test_ablate_heads_equals_zeroing_output_columns(keep):
    listed = [0, 7, 11]
    check_ablation_zeroes_columns(model64(), tokens(pos=12), [(SITE, c) for c in listed], f"{SITE}.output.weight",
                                  listed, ablate_heads, keep=keep)


def test_kernel_rows_and_cols_are_slices_of_hook_kernel():
    model, x = model64(), tokens(pos=30)
    _, (_, _, K, _) = _io(model, x)
    close(kernel_rows(model, x, [29, 3, 17], sites=[SITE])[SITE], K[:, :, [29, 3, 17]], "rows")
    close(kernel_cols(model, x, [0, 17], sites=[SITE])[SITE], K[..., [0, 17]], "cols")


def test_every_analysis_runs_on_rwkv():
    model = model64()
    x = tokens(pos=9)
    assert len(ssm_sites(model)) == model.cfg.n_layers
    units = head_units(model)
    with torch.no_grad():
        plain = model(x)
        with knockout(model, sources=[1, 2], targets=[-1], layers=range(model.cfg.n_layers), cut_conv=True):
            cut = model(x)
        _, clean_cache = model.run_with_cache(tokens(pos=9, seed=5), names_filter=[f"{SITE}.hook_h"])
        patched = patch(model, x, clean_cache, f"{SITE}.hook_h", index={"pos": 4})
    assert not torch.allclose(cut[:, -1], plain[:, -1]) and not torch.allclose(patched, plain)
    torch.testing.assert_close(cut[:, :-1], plain[:, :-1], rtol=0, atol=1e-12 * plain.abs().max().item())
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units[:6], batch_size=2)
    assert all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:3], batch_size=2, pairs_top_k=0, progress=False)
    assert len(ranking.rows) == 3
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()
    split = decay_split(model, 0)
    norms = torch.exp(-torch.exp(model.blocks[0].mixer.time_decay.double()))
    assert set(split.fastest.tolist()) == set(norms.argsort()[:4].tolist())
