"""xLSTM (HF `xlstm`): the mLSTM as a state mixer, parity with HF's own model (its torch-native kernels).

Parity with HF (mode "inference": chunks of chunk_size positions, then HF's step loop for the rest): float32
logits, the embedding and every resid_post within 1e-4 of HF's max magnitude; float64 within 1e-10 where HF
stays in float64 (whole chunks: its step loop keeps its state in inference_state_dtype, float32; and its norms'
float32 reductions off: norm_reduction_force_float32=False, and by hand on the final norm, built without it;
its logits are cast to float32, so they are compared with its lm_head and cap applied in float64); HF reads
no attention mask, so a left-padded row is checked against the prompt alone (ours and HF's); decoding with a
DecodeState == recompute == HF's whole forward == HF's own cached decoding; save_pretrained -> from_pretrained == from_hf bit for bit, and a weight_mode "fused"
checkpoint (HF 5.24 cannot build one) == the same weights unfused; xLSTM-7B's config built on meta with HF's
shape for every tensor and its parameter count; configs HF cannot run refused by name.
The mLSTM (float64, 1e-12): the chunkwise form == the sequential oracle == HF's native kernels (any chunk,
from a state); y == K . v; y == C^T q / N read from hook_h with N == max(|n . q|, 1) + eps exp(m) read from
hook_n; kernel rows / columns == the dense kernel; knockout == zeroing the dense kernel's entries (all heads,
some heads) == a brute force written here that keeps N (the normaliser is NOT recomputed without the cut
terms); an edit of hook_n (hook_denom) == the recurrence continued from it (y rescaled); its heads are the
map's units. Edits of hook_h: tests/test_state_edits.py; decode-step knockout: tests/test_decode_knockout.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from einops import einsum
from hybrid_checks import (assert_rel_close, check_against_hf, check_decoding, check_heads_are_map_units,
                           check_knockout_zeroes_head_entries, check_released_on_meta, check_rows_alone,
                           check_save_pretrained, close, left_padded, perturbed)
from safetensors.torch import save_file
from tiny_families import tiny
from transformers.models.xlstm import modeling_xlstm as hf_xlstm

from analysis.interventions import knockout
from analysis.kernel_rows import kernel_cols, kernel_rows
from hooked.ops.mlstm import (mlstm_chunked, mlstm_kernel, mlstm_kernel_cols, mlstm_kernel_rows, mlstm_sequential,
                              pack_state, unpack_state)
from loaders.load import from_hf, from_pretrained
from loaders.registry import REGISTRY

V = 64
BASE = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=1.0, ffn_proj_factor=0.5,
            ffn_round_up_to_multiple_of=8, pad_token_id=0)
VARIANTS = {
    "chunks_then_steps": dict(chunk_size=4),  # 13 positions: 3 chunks, then HF's step loop
    "steps_tied_caps": dict(chunk_size=64, v_dim_factor=2.0, num_heads=2, gate_soft_cap=3.0, output_logit_soft_cap=5.0,
                            eps=1e-3, norm_eps=1e-4, tie_word_embeddings=True, num_hidden_layers=3),
}
RELEASED = dict(  # NX-AI/xLSTM-7b (HF's kernels named by their torch-native fallbacks)
    model_type="xlstm", architectures=["xLSTMForCausalLM"], vocab_size=50304, hidden_size=4096, num_hidden_layers=32,
    num_heads=8, qk_dim_factor=0.5, v_dim_factor=1.0, ffn_proj_factor=2.667, ffn_round_up_to_multiple_of=64,
    gate_soft_cap=15.0, output_logit_soft_cap=30.0, weight_mode="single", use_bias=False, tie_word_embeddings=False,
    norm_eps=1e-6, eps=1e-6, chunk_size=64, mode="inference", bos_token_id=0, eos_token_id=2, pad_token_id=1)


def make_hf(variant: str, dtype: torch.dtype = torch.float32, **fields):
    config = transformers.xLSTMConfig(**{**BASE, **VARIANTS[variant], **fields})
    torch.manual_seed(0)
    return perturbed(transformers.xLSTMForCausalLM(config), scale=0.2).to(dtype)


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))



# ------------------------------------------------------------------------------ parity with HF
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_and_every_residual_equal_hf(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    assert [b.kind for b in model.blocks] == ["mixer"] * hf.config.num_hidden_layers
    check_against_hf(hf, model, tokens())


def test_float64_within_1e10_of_hf_on_whole_chunks():
    hf = make_hf("chunks_then_steps", torch.float64, norm_reduction_force_float32=False)
    hf.backbone.out_norm.force_float32_reductions = False  # HF builds its final norm with the float32 reduction
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    toks = tokens(pos=12)
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: (
            n == "hook_embed" or "resid_post" in n or n.startswith("ln_final")))
        hf_logits64 = hf_xlstm.soft_cap(hf.lm_head(out.hidden_states[-1]), hf.config.output_logit_soft_cap)
    n = model.cfg.n_layers
    ours = [cache["hook_embed"]] + [cache[f"blocks.{l}.hook_resid_post"] for l in range(n - 1)]
    for l, (a, b) in enumerate(zip(ours + [cache["ln_final.hook_normalized"]], out.hidden_states)):
        assert a.dtype == torch.float64
        assert_rel_close(a, b, f"hidden state {l}", 1e-10)
    assert out.logits.dtype == torch.float32  # HF casts its logits to float32 (`.float()`)
    assert_rel_close(logits, hf_logits64, "logits vs HF's lm_head and cap in float64", 1e-10)
    assert_rel_close(logits, out.logits, "logits vs HF's float32 logits", 1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_each_prompt_alone_and_hf_alone(variant):
    hf = make_hf(variant)
    check_rows_alone(hf, from_hf(hf), rel_alone=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_with_the_state_equals_recomputing_and_hf(variant):
    """5 positions (past one chunk of 4), then one at a time; and HF's own decoding (its xLSTMCache)."""
    hf = make_hf(variant)
    toks = tokens(pos=11)
    stepped = check_decoding(hf, from_hf(hf), toks)
    with torch.no_grad():
        out = hf(toks[:, :5], use_cache=True)
        hf_steps = [out.logits] + [hf(toks[:, t:t + 1], cache=out.cache, use_cache=True).logits for t in range(5, 11)]
    assert_rel_close(stepped, torch.cat(hf_steps, 1), "stepped vs HF's cached decoding")


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    check_save_pretrained(make_hf(variant), tokens(), tmp_path)


def test_a_fused_checkpoint_loads_as_its_rows(tmp_path):
    """weight_mode "fused" stacks q, k, v, o (and i, f; the FFN's gate and up) by rows: sliced on load."""
    hf = make_hf("chunks_then_steps")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for l in range(hf.config.num_hidden_layers):
        cell, ffn = f"backbone.blocks.{l}.mlstm_layer.", f"backbone.blocks.{l}.ffn."
        sd[cell + "qkv_opreact.weight"] = torch.cat([sd.pop(cell + n + ".weight") for n in ("q", "k", "v", "ogate_preact")])
        for w in ("weight", "bias"):
            sd[cell + f"ifgate_preact.{w}"] = torch.cat([sd.pop(cell + f"{g}_preact.{w}") for g in ("igate", "fgate")])
        sd[ffn + "proj_up_gate_z.weight"] = torch.cat([sd.pop(ffn + "proj_up_gate.weight"), sd.pop(ffn + "proj_up.weight")])
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**hf.config.to_dict(), "weight_mode": "fused"}))
    loaded, direct = from_pretrained(tmp_path), from_hf(hf)
    with torch.no_grad():
        assert torch.equal(loaded(tokens()), direct(tokens()))


def test_released_config_builds_hf_shapes_on_meta():
    cfg, model = check_released_on_meta(RELEASED, "xlstm", transformers.xLSTMForCausalLM, read="raw")
    assert (cfg.n_heads, cfg.d_qk, cfg.d_v, cfg.d_mlp) == (8, 256, 512, 10944)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9) == 7  # xLSTM-7B


@pytest.mark.parametrize("fields, match", [
    (dict(num_heads=3), "num_heads"),  # 64 channels in 3 heads: HF's reshape fails
    (dict(embedding_dim=32), "embedding_dim"),
    (dict(use_bias=True), "use_bias"),
    (dict(inference_state_dtype="bfloat16"), "inference_state_dtype"),
])
def test_configs_hf_cannot_run_are_refused_by_name(fields, match):
    raw = {**BASE, "model_type": "xlstm", **fields}
    with pytest.raises(ValueError, match=match):
        REGISTRY["xlstm"].config_from_hf(raw)


# ------------------------------------------------------------------------------ the mLSTM, float64
def _inputs(b=2, l=11, h=3, c=4, v=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, l, h, c, generator=g, dtype=torch.float64) for _ in range(2))
    vals = torch.randn(b, l, h, v, generator=g, dtype=torch.float64)
    log_i = 4 * torch.randn(b, l, h, generator=g, dtype=torch.float64)
    log_f = torch.nn.functional.logsigmoid(3 * torch.randn(b, l, h, generator=g, dtype=torch.float64))
    state = (torch.randn(b, h, c, v, generator=g, dtype=torch.float64), torch.randn(b, h, c, generator=g,
                                                                                    dtype=torch.float64),
             torch.randn(b, h, generator=g, dtype=torch.float64))
    return q * c**-0.5, k, vals, log_i, log_f, state


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11, 16])
def test_chunkwise_form_equals_the_sequential_oracle_and_hfs_kernels(chunk_size):
    q, k, v, log_i, log_f, h0 = _inputs()
    for start in (None, h0):
        y, state = mlstm_sequential(q, k, v, log_i, log_f, start)
        parts = mlstm_chunked(q, k, v, log_i, log_f, start, chunk_size)
        close(parts.read(1e-6)[0], y, "y")
        for got, want, what in zip(parts.state, state, ("C~", "n~", "m")):
            close(got, want, what)
        assert all(torch.equal(a, b) for a, b in zip(unpack_state(pack_state(state)), state))
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  HF's [b h l ...]
    f_pre = -torch.log(torch.expm1(-log_f))  # logsigmoid^-1
    hf_y = hf_xlstm.mlstm_recurrent_sequence_native(t(q * 2.0), t(k), t(v), t(log_i), t(f_pre), eps=1e-6,
                                                    dtype_state=torch.float64)  # HF scales q by d^-1/2 = 1/2
    close(t(hf_y), mlstm_sequential(q, k, v, log_i, log_f)[0], "HF's sequence kernel", 1e-10)
    hf_c = hf_xlstm.mlstm_chunkwise_native_autograd(t(q[:, :8] * 2.0), t(k[:, :8]), t(v[:, :8]), t(log_i[:, :8]),
                                                    t(f_pre[:, :8]), chunk_size=4, eps=1e-6)
    close(t(hf_c), mlstm_sequential(q[:, :8], k[:, :8], v[:, :8], log_i[:, :8], log_f[:, :8])[0],
          "HF's chunkwise kernel", 1e-10)


def test_kernel_rows_and_columns_equal_the_dense_kernel():
    q, k, v, log_i, log_f, _ = _inputs()
    parts = mlstm_chunked(q, k, v, log_i, log_f, chunk_size=4)
    y, denom = parts.read(1e-6)
    K = mlstm_kernel(q, k, log_i, log_f, denom)
    close(einsum(K, v, "b h j i, b i h v -> b j h v"), y, "K . v")
    assert not K.triu(1).any()
    idx = torch.tensor([10, 0, 4, 4])
    close(mlstm_kernel_rows(q, k, log_i, log_f, denom, idx), K[:, :, idx], "rows")
    close(mlstm_kernel_cols(q, k, log_i, log_f, denom, idx), K[..., idx], "cols")


def model64():
    return copy.deepcopy(tiny("xlstm")).double()


NAMES = ("q", "k", "v", "i", "log_f", "h", "n", "denom", "kernel", "y")


def mixer_cache(model, toks, layer=1, fwd_hooks=()):
    where = f"blocks.{layer}.mixer"
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks)):
        _, cache = model.run_with_cache(toks, names_filter=[f"{where}.hook_{n}" for n in NAMES])
    return {n: cache[f"{where}.hook_{n}"] for n in NAMES}


def brute(c, eps=1e-6, set_n=None):
    """C_t, n_t, m_t by the unstabilised recurrence one position at a time (n replaced by set_n(t, n) after each
    step); y = C^T q / N, N = max(|n . q|, 1) + eps exp(m). Returns {"C", "n", "N", "y"} over positions."""
    q = c["q"] * c["q"].shape[-1] ** -0.5
    C = q.new_zeros(*c["h"].shape[:1], *c["h"].shape[2:])
    n, m = q.new_zeros(C.shape[:-1]), q.new_zeros(C.shape[:2])
    out = {"C": [], "n": [], "N": [], "y": []}
    for t in range(q.shape[1]):
        f, i = torch.exp(c["log_f"][:, t]), torch.exp(c["i"][:, t])
        C = f[..., None, None] * C + i[..., None, None] * einsum(c["k"][:, t], c["v"][:, t], "b h c, b h v -> b h c v")
        n = f[..., None] * n + i[..., None] * c["k"][:, t]
        n = n if set_n is None else set_n(t, n)
        m = torch.maximum(c["log_f"][:, t] + m, c["i"][:, t])
        N = einsum(n, q[:, t], "b h c, b h c -> b h").abs().clamp_min(1.0) + eps * torch.exp(m)
        for name, x in (("C", C), ("n", n), ("N", N), ("y", einsum(C, q[:, t], "b h c v, b h c -> b h v") / N[..., None])):
            out[name].append(x)
    return {name: torch.stack(xs, 1) for name, xs in out.items()}


def test_kernel_states_and_normaliser_reconstruct_y():
    c = mixer_cache(model64(), tokens(pos=11))
    q = c["q"] * c["q"].shape[-1] ** -0.5
    close(einsum(c["kernel"], c["v"], "b h j i, b i h v -> b j h v"), c["y"], "K . v")
    close(einsum(c["h"], q, "b l h c v, b l h c -> b l h v") / c["denom"][..., None], c["y"], "C^T q / N")
    ref = brute(c)
    for name, hook in (("C", "h"), ("n", "n"), ("N", "denom"), ("y", "y")):
        close(c[hook], ref[name], f"hook_{hook} vs the brute-force recurrence")


def test_the_models_kernel_rows_and_columns_equal_hook_kernel_with_padding():
    """analysis.kernel_rows through the mixer's kernel_slices (no pos x pos tensor) == the cached kernel; a padded
    source has no entry (its i = -inf)."""
    model = model64()
    toks, mask = left_padded([11, 7], 11, V)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=lambda n: n.endswith("hook_kernel"))
    idx = [10, 0, 6, 6]
    rows, cols = kernel_rows(model, toks, idx, attention_mask=mask), kernel_cols(model, toks, idx, attention_mask=mask)
    for site in ("blocks.0.mixer", "blocks.1.mixer"):
        K = cache[f"{site}.hook_kernel"]
        close(rows[site], K[:, :, idx], f"{site} rows")
        close(cols[site], K[..., idx], f"{site} cols")
        assert not K[1, :, :, :4].any() and K[1, :, 4:, 4:].abs().sum() > 0


def test_an_edit_of_the_normaliser_continues_from_it_and_rescales_y():
    model, toks = model64(), tokens(pos=11)
    clean = mixer_cache(model, toks)
    g = torch.Generator().manual_seed(3)
    new = torch.randn(clean["n"].shape, generator=g, dtype=torch.float64) * 4
    mask = torch.zeros(clean["n"].shape, dtype=torch.bool)
    mask[:, 6] = True

    def setter(n, hook):
        return torch.where(mask, new, n)
    got = mixer_cache(model, toks, fwd_hooks=[("blocks.1.mixer.hook_n", setter)])
    for name in ("q", "k", "v", "i", "log_f"):
        assert torch.equal(got[name], clean[name])
    ref = brute(clean, set_n=lambda t, n: torch.where(mask[:, t], new[:, t], n))
    close(got["n"], ref["n"], "n continued from the set one")
    close(got["denom"], ref["N"], "N from the set normaliser")
    close(got["y"], ref["y"], "y")
    assert (got["y"] - clean["y"])[:, 6:].abs().max() > 1e-3 and torch.equal(got["y"][:, :6], clean["y"][:, :6])

    def double(N, hook):  # an edited N rescales y
        return 2 * N
    halved = mixer_cache(model, toks, fwd_hooks=[("blocks.1.mixer.hook_denom", double)])
    close(halved["y"], clean["y"] / 2, "y with N doubled")


@pytest.mark.parametrize("channels", [None, [0, 2]])
def test_knockout_equals_zeroing_the_dense_kernels_entries_and_a_brute_force(channels):
    model, toks = model64(), tokens(pos=11)
    sources, targets = [1, 3, 6], [4, 6, 9, 10]
    check_knockout_zeroes_head_entries(model, toks, [0, 1], sources, targets, channels, 4, knockout)
    heads = torch.zeros(4, dtype=torch.bool)
    heads[channels if channels is not None else slice(None)] = True
    cut = torch.zeros(11, 11, dtype=torch.bool)
    cut[torch.tensor(targets)[:, None], torch.tensor(sources)] = True
    with knockout(model, sources=sources, targets=targets, layers=[0, 1], channels=channels):
        cut_cache = mixer_cache(model, toks, layer=0)
    # brute force (layer 0, its inputs unchanged by the cut): sum over kept sources only, N over all of them
    c = mixer_cache(model, toks, layer=0)
    q = c["q"] * c["q"].shape[-1] ** -0.5
    F = c["log_f"].cumsum(1)
    y = torch.zeros_like(c["y"])
    for j in range(11):
        for i in range(j + 1):
            w = torch.exp(F[:, j] - F[:, i] + c["i"][:, i]) * (q[:, j] * c["k"][:, i]).sum(-1) / c["denom"][:, j]
            w = torch.where(heads & cut[j, i], torch.zeros_like(w), w)
            y[:, j] += w[..., None] * c["v"][:, i]
    close(cut_cache["y"], y, "y under knockout vs brute force with N held")
    close(cut_cache["denom"], c["denom"], "N held")


def test_the_heads_are_the_maps_units():
    model = model64()
    check_heads_are_map_units(model, 4, tokens(pos=7))
    assert model.blocks[0].sublayer("mixer").decay_norms().shape == (4,)
