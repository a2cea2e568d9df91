"""Analyses on the delta-rule families and LFM2 through the mixer protocol (issue 30 item 3).

float64, on the tiny models of tests/delta_oracles.py: knockout == zeroing the cut entries of hook_kernel
(delta rule, the gated short conv) and of hook_pattern (gated attention, MLA), per head too; cutting every
edge into a target leaves the delta rule nothing to read there (y = 0), with cut_conv its conv output too;
ablate_heads == zeroing the head's output-projection columns (value heads, channels, attention heads);
kernel_rows / kernel_cols == slices of hook_kernel; patching a state == a brute-force recurrence
continued from the clean state; decay_norms of the delta heads. Then every family runs knockout,
ablate_heads, rank_heads, ga_scores and info_flow; dispatched models (cpu / disk) decode like the plain
model, and shared-prefix choice scores (the prefix's state selected per choice: conv windows, states,
MLA keys) equal the plain scores.
"""

from __future__ import annotations

import pytest
import torch
from delta_oracles import tiny_delta_hf
from einops import einsum
from test_delta_mixer import brute

from analysis.ga import ga_scores, head_units, rank_heads
from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, decay_norms, knockout, patch
from analysis.kernel_rows import kernel_cols, kernel_rows, ssm_sites
from analysis.tasks.known_facts import load_facts
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example, char_tokenizer, kv_retrieval, multiple_choice
from hooked import backends
from hooked.models.decode_state import DecodeState
from loaders import from_pretrained
from loaders.load import from_hf

FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lfm2"]
V = 128  # the char tokenizer's ids fit
TOL = 1e-12


def model_of(model_type: str, dtype: torch.dtype = torch.float64):
    hf, _ = tiny_delta_hf(model_type, dtype=dtype, vocab_size=V)
    model = from_hf(hf)
    model.tokenizer = char_tokenizer()
    return model


def tokens(n: int = 2, pos: int = 70, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (n, pos), generator=torch.Generator().manual_seed(seed))


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


# layer -> its mixer's weights hook; every family's layer 0 is a delta layer or LFM2's conv, layer 1 attention
CUT_SITES = [("qwen3_next", 0, "mixer.hook_kernel"), ("qwen3_next", 1, "attn.hook_pattern"),
             ("olmo_hybrid", 0, "mixer.hook_kernel"), ("olmo_hybrid", 1, "attn.hook_pattern"),
             ("kimi_linear", 0, "mixer.hook_kernel"), ("kimi_linear", 1, "attn.hook_pattern"),
             ("lfm2", 0, "mixer.hook_kernel"), ("lfm2", 1, "attn.hook_pattern")]


@pytest.mark.parametrize("model_type,layer,weights", CUT_SITES)
@pytest.mark.parametrize("heads", [None, [1, 2]])
def test_knockout_equals_zeroing_the_cut_entries(model_type, layer, weights, heads):
    model = model_of(model_type)
    x = tokens()
    sources, targets = [1, 2, 40, 66], [5, 41, 66, 69]
    is_attn = weights.startswith("attn")

    def zero(K, hook):
        K = K.clone()
        cut = slice(None) if heads is None or is_attn else heads
        for j in targets:
            for i in sources:
                if i <= j:
                    K[:, cut, j, i] = 0
        return K

    with torch.no_grad():
        # an identity hook at the site puts that layer on the exact path, as the knockout does
        plain = model.run_with_hooks(x, fwd_hooks=[(f"blocks.{layer}.{weights}", lambda K, hook: K)])
        kw = dict(attention="pattern") if is_attn else dict(channels=heads)
        with knockout(model, sources=sources, targets=targets, layers=[layer], **kw):
            cut = model(x)
        ref = model.run_with_hooks(x, fwd_hooks=[(f"blocks.{layer}.{weights}", zero)])
    close(cut, ref, "knockout vs zeroed entries")
    assert not torch.allclose(cut, plain)
    assert torch.equal(cut[:, :5], plain[:, :5])  # before the first target nothing moves


@pytest.mark.parametrize("model_type", ["qwen3_next", "olmo_hybrid", "kimi_linear"])
def test_cutting_every_edge_into_a_target_leaves_nothing_to_read(model_type):
    """All sources -> target t: y_t = 0 (S0 = 0: every term of y_t is a kernel edge); with cut_conv the conv
    output at t is 0 too (no conv bias); one head only: that head's y alone."""
    model = model_of(model_type)
    x, t = tokens(pos=30), 20
    site = "blocks.0.mixer"
    names = [f"{site}.hook_y", f"{site}.hook_conv"]
    with torch.no_grad():
        _, plain = model.run_with_cache(x, names_filter=names)
        with knockout(model, sources=list(range(30)), targets=[t], layers=[0], cut_conv=True):
            _, cut = model.run_with_cache(x, names_filter=names)
        with knockout(model, sources=list(range(30)), targets=[t], layers=[0], channels=[2]):
            _, one = model.run_with_cache(x, names_filter=names)
    assert cut[names[0]][:, t].abs().max() < TOL and cut[names[1]][:, t].abs().max() < TOL
    assert torch.equal(cut[names[0]][:, :t], plain[names[0]][:, :t])
    assert one[names[0]][:, t, 2].abs().max() < TOL
    others = [h for h in range(one[names[0]].shape[2]) if h != 2]
    close(one[names[0]][:, t, others], plain[names[0]][:, t, others], "uncut heads")


@pytest.mark.parametrize("model_type,layer,module,proj", [
    ("qwen3_next", 0, "mixer", "out_proj"), ("qwen3_next", 1, "attn", "o_proj"),
    ("kimi_linear", 0, "mixer", "out_proj"), ("kimi_linear", 1, "attn", "o_proj"),
    ("olmo_hybrid", 0, "mixer", "out_proj"), ("lfm2", 0, "mixer", "out_proj")])
@pytest.mark.parametrize("keep", [False, True])
def test_ablate_heads_equals_zeroing_output_projection_columns(model_type, layer, module, proj, keep):
    model = model_of(model_type)
    x = tokens(pos=12)
    site = model.get_submodule(f"blocks.{layer}.{module}")
    n, width = site.heads().n, site.heads().width
    listed = [0, n - 1]
    with torch.no_grad():
        ablated = ablate_heads(model, [(f"blocks.{layer}.{module}", h) for h in listed], keep=keep)
        with ablated:
            ours = model(x)
        weight = getattr(site, proj).weight
        zeroed = [h for h in range(n) if (h in listed) != keep]
        for h in zeroed:
            weight[:, h * width:(h + 1) * width] = 0
        ref = model(x)
    close(ours, ref, "ablated vs zeroed columns")


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear", "lfm2"])
def test_kernel_rows_and_cols_are_slices_of_hook_kernel(model_type):
    model = model_of(model_type)
    x = tokens(pos=70)
    sites = ssm_sites(model)
    assert sites == [f"blocks.{l}.mixer" for l, b in enumerate(model.blocks) if b.kind == "mixer"]
    rows, cols = [3, 64, -1], [0, 63, 65]
    with torch.no_grad():
        _, cache = model.run_with_cache(x, names_filter=[f"{s}.hook_kernel" for s in sites])
        got_rows, got_cols = kernel_rows(model, x, rows), kernel_cols(model, x, cols)
    for s in sites:
        K = cache[f"{s}.hook_kernel"]
        close(got_rows[s], K[:, :, [3, 64, 69]], f"{s} rows")
        close(got_cols[s], K[..., cols], f"{s} cols")
    double = [(f"{s}.hook_kernel", lambda K, hook: 2 * K) for s in sites]  # an edit there is what slices see
    with torch.no_grad(), model.hooks(fwd_hooks=double):
        edited = kernel_rows(model, x, rows)
        _, edited_cache = model.run_with_cache(x, names_filter=[f"{s}.hook_kernel" for s in sites])
    for s in sites:
        close(edited[s], edited_cache[f"{s}.hook_kernel"][:, :, [3, 64, 69]], f"{s} edited rows")
    close(edited[sites[0]], 2 * cache[f"{sites[0]}.hook_kernel"][:, :, [3, 64, 69]], "first site, doubled")


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_patching_a_state_continues_the_recurrence_from_the_clean_state(model_type):
    model, site = model_of(model_type), "blocks.0.mixer"
    clean, corrupt = tokens(seed=2), tokens(seed=3)
    t = 33
    names = [f"{site}.hook_{n}" for n in ("q", "k", "v", "beta", "alpha", "h", "y")]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=names)
        _, corrupt_cache = model.run_with_cache(corrupt, names_filter=names)
        with model.hooks(fwd_hooks=[(f"{site}.hook_y", lambda y, hook: hook.ctx.__setitem__("y", y))]):
            patched = patch(model, corrupt, clean_cache, f"{site}.hook_h", index={"pos": t})
            y = model.hook_dict[f"{site}.hook_y"].ctx["y"]
    q, k, v, beta, alpha, h, _ = (corrupt_cache[n] for n in names)
    delta = clean_cache[f"{site}.hook_h"][:, t] - h[:, t]
    _, y_ref = brute(q * q.shape[-1] ** -0.5, k, v, beta, alpha, edit_at=t, delta=delta)
    close(y, y_ref, "y after the patched state vs brute force")
    with torch.no_grad():
        assert not torch.allclose(patched, model(corrupt))


def test_decay_norms_of_the_delta_heads():
    model = model_of("qwen3_next")
    norms = decay_norms(model, 0)
    mixer = model.blocks[0].mixer
    expected = torch.exp(-torch.exp(mixer.A_log.double())) * mixer.spec.d_k
    assert norms.shape == (mixer.spec.n_heads,) and torch.allclose(norms, expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="no state decay"):
        model_of("lfm2").blocks[0].mixer.decay_norms()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_interventions_and_ga_run_on_every_family(model_type):
    model = model_of(model_type, torch.float32)
    x = tokens(pos=9)
    units = head_units(model)
    assert {u.module.rsplit(".", 1)[1] for u in units} == {"attn", "mixer"}
    with torch.no_grad():
        with backends.use(attention="eager"):  # the knockout's attention layers run eager: so does plain
            plain = model(x)
        with knockout(model, sources=[1, 2], targets=[-1], layers=range(model.cfg.n_layers), cut_conv=True):
            cut = model(x)
        with ablate_heads(model, [units[0].specs()[0], units[-1].specs()[0]]):
            ablated = model(x)
    assert not torch.allclose(cut[:, -1], plain[:, -1])
    # earlier positions are untouched (up to rounding: an MoE's expert products change with its row count)
    torch.testing.assert_close(cut[:, :-1], plain[:, :-1], rtol=0, atol=1e-6 * plain.abs().max().item())
    assert not torch.allclose(ablated, plain)
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:3], batch_size=2, pairs_top_k=0, progress=False)
    assert len(ranking.rows) == 3
    result = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                       progress=False)
    assert result.changes.shape == (2, 1, model.cfg.n_layers) and torch.isfinite(result.changes).all()


# ------------------------------------------------------------------------------ dispatch and prefixes
def _examples():
    return (kv_retrieval(3, 2, seed=2) + [multiple_choice("Pick one", ["red", "green", "blue"], 2)]
            + [Example("x is", ["12", "13", "2", "24"], 0)])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_dispatched_decoding_and_shared_prefix_scores_equal_the_plain_model(model_type, tmp_path):
    from test_dispatch import split_map

    hf, _ = tiny_delta_hf(model_type, vocab_size=V, perturb=0.1)
    hf.save_pretrained(tmp_path / "ckpt")
    plain = from_pretrained(tmp_path / "ckpt")
    model = from_pretrained(tmp_path / "ckpt", device_map=split_map(plain), offload_folder=tmp_path / "off")
    plain.tokenizer = model.tokenizer = char_tokenizer()
    prompt = tokens(pos=7, seed=4)
    kw = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False)
    want = plain.generate(prompt, **kw)
    assert torch.equal(model.generate(prompt, **kw), want)
    assert torch.equal(plain.generate(prompt, use_past_kv_cache=False, **kw), want)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    with torch.no_grad():
        state_a, state_b = DecodeState(), DecodeState()
        a, b = model(prompt, mask, state=state_a), plain(prompt, mask, state=state_b)
        for _ in range(3):
            torch.testing.assert_close(a[:, -1], b[:, -1], rtol=0, atol=1e-5 * b.abs().max().item())
            nxt = b[:, -1].argmax(-1)[:, None]
            a, b = model(nxt, state=state_a), plain(nxt, state=state_b)
        shared = ChoiceScorer(plain, _examples(), batch_size=3).scores()
        rows = ChoiceScorer(plain, _examples(), batch_size=3, shared_prefix=False).scores()
        dispatched = ChoiceScorer(model, _examples(), batch_size=3).scores()
    finite = torch.isfinite(rows)
    assert finite.sum() >= 10 and torch.equal(torch.isfinite(shared), finite)
    torch.testing.assert_close(shared[finite], rows[finite], rtol=0, atol=1e-4)
    torch.testing.assert_close(dispatched[finite], rows[finite], rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_5_text", {}), ("qwen3_next", dict(mlp_only_layers=[0, 1, 2, 3])), ("olmo_hybrid", {}),
    ("kimi_linear", dict(mlp_layer_types=["dense"] * 4)), ("lfm2", {})])
def test_fold_ln_keeps_the_logits(model_type, overrides):
    """Weight processing folds each norm into the maps reading it (the delta projections, the gate and q/k of
    attention, MLA's q and latent projections); OLMo's post-norm attention layers read the stream unnormed."""
    hf, _ = tiny_delta_hf(model_type, dtype=torch.float64, **overrides)
    x = tokens(pos=20)
    with torch.no_grad():
        close(from_hf(hf, fold_ln=True)(x % 64), from_hf(hf)(x % 64), "fold_ln")


def test_tl_weight_names_where_tl_has_the_concept():
    qwen = model_of("qwen3_5_text")
    attn, mixer = qwen.blocks[1].attn, qwen.blocks[0].mixer
    assert attn.W_Q.shape == (4, 32, 16) and attn.W_O.shape == (4, 16, 32) and attn.W_K.shape == (4, 32, 16)
    assert mixer.W_out_heads.shape == (4, 6, 32)  # value heads, d_v, d_model
    x = tokens(pos=5)
    with torch.no_grad():
        _, cache = qwen.run_with_cache(x, names_filter=["blocks.0.mixer.hook_gated", "blocks.0.mixer.hook_head_out"])
        gated = cache["blocks.0.mixer.hook_gated"].unflatten(-1, (4, 6))
        close(einsum(gated, mixer.W_out_heads, "b l h v, h v m -> b l h m"), cache["blocks.0.mixer.hook_head_out"])
    with pytest.raises(ValueError, match="in_proj"):
        mixer.W_in_proj  # noqa: B018 (the delta projections are several maps, not one in_proj)
    assert not hasattr(model_of("kimi_linear").blocks[1].attn, "W_Q")  # TL has no latent attention
