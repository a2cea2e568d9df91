"""Activation patching: exactness, equality with hand-written loops, SSM state patching against a
brute-force recurrence, attribution patching against exact patching and finite differences, and the
start_at_layer / stop_at_layer round trip it relies on."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import build_tiny_hf, rel_close

from analysis.interventions.patching import (act_patch, answer_prob, attribution_patch, compare_attribution, head_patch,
                               index_tuple, logit_diff, normalised_score, output_patch, patch, resid_patch,
                               run_patching, set_slice, ssm_state_patch)
from loaders.load import from_hf

V = 80
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64),
    "llama": lambda: transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                              num_attention_heads=4, num_key_value_heads=2),
    "mamba": lambda: transformers.MambaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=3, state_size=4,
                                              expand=2),
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=V, hidden_size=16, num_hidden_layers=3, state_size=8,
                                                expand=2, head_dim=8, num_heads=4, n_groups=2, chunk_size=4),
    "zamba2": lambda: transformers.Zamba2Config(hidden_size=16, num_hidden_layers=3,
                                                layers_block_type=["mamba", "hybrid", "hybrid"], mamba_d_state=8,
                                                n_mamba_heads=4, mamba_ngroups=2, mamba_expand=2,
                                                num_attention_heads=4, intermediate_size=24, vocab_size=V,
                                                chunk_size=4, adapter_rank=3, max_position_embeddings=64),
}
ATTN = ["gpt2", "llama"]
SSM = ["mamba", "mamba2"]


def _model(arch: str, dtype=torch.float32, seed: int = 0):
    return from_hf(build_tiny_hf(CONFIGS[arch](), seed=seed, perturb=0.1, dtype=dtype))


def _pair(n: int = 7, batch: int = 2, flip=(2,)):
    """Clean tokens and a corrupted copy differing at the positions `flip`."""
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, V, (batch, n), generator=g)
    corrupted = clean.clone()
    for p in flip:
        corrupted[:, p] = (clean[:, p] + 1 + torch.randint(0, V - 1, (batch,), generator=g)) % V
    return clean, corrupted


def _padded(tokens):
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0  # left padding in row 0
    return mask


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_start_stop_round_trip_is_bit_exact(arch, padded):
    model = _model(arch)
    tokens, _ = _pair(n=9)
    mask = _padded(tokens) if padded else None
    with torch.no_grad():
        full = model(tokens, mask)
        for layer in range(model.cfg.n_layers + 1):
            resid = model(tokens, mask, stop_at_layer=layer)
            again = model(resid, mask, start_at_layer=layer, tokens=tokens)
            assert torch.equal(again, full), f"round trip at layer {layer}"
        # a middle slice too
        resid = model(tokens, mask, stop_at_layer=1)
        resid = model(resid, mask, start_at_layer=1, stop_at_layer=2, tokens=tokens)
        assert torch.equal(model(resid, mask, start_at_layer=2, tokens=tokens), full)


@pytest.mark.parametrize("arch", ATTN + SSM)  # not Zamba2: its shared blocks also read the original embedding
def test_patching_the_whole_residual_gives_clean_logits_exactly(arch):
    model = _model(arch)
    clean, corrupted = _pair()
    with torch.no_grad():
        clean_logits, cache = model.run_with_cache(clean, names_filter=lambda n: "hook_resid" in n)
        assert not torch.equal(model(corrupted), clean_logits)
        for layer in range(model.cfg.n_layers):
            for which in ("pre", "post"):
                got = patch(model, corrupted, cache, f"blocks.{layer}.hook_resid_{which}")
                assert torch.equal(got, clean_logits), f"{which} {layer}"
        # resid_pre of layer 0 by position: only the flipped position matters, and restores exactly
        by_pos = resid_patch(model, corrupted, cache, lambda lg: (lg - clean_logits).abs().max(), over=("layer", "pos"))
    assert by_pos[0, 2] == 0 and (by_pos[0, [0, 1]] > 0).all()


def _hand_loop(model, tokens, cache, metric, template, over, layers):
    """act_patch written out: full forwards, one hand-written hook per index."""
    out = {}
    for layer in layers:
        name = template.format(layer=layer)
        act = cache[name]
        dims = {"pos": 2 if name.endswith(("pattern", "kernel")) else 1,
                "head": 1 if name.endswith(("pattern", "kernel")) else 2}
        sizes = [act.shape[dims[a]] for a in over[1:]]
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in sizes]).reshape(-1, len(sizes)).tolist():
            def hook(x, hook, idx=idx):
                x = x.clone()
                sel = [slice(None)] * x.ndim
                for a, i in zip(over[1:], idx):
                    sel[dims[a]] = i
                x[tuple(sel)] = act[tuple(sel)]
                return x

            out[(layer, *idx)] = float(metric(model.run_with_hooks(tokens, fwd_hooks=[(name, hook)])))
    return out


CASES = [("gpt2", "blocks.{layer}.hook_resid_pre", ("layer", "pos")),
         ("llama", "blocks.{layer}.attn.hook_z", ("layer", "head")),
         ("llama", "blocks.{layer}.attn.hook_result", ("layer", "pos", "head")),
         ("gpt2", "blocks.{layer}.attn.hook_pattern", ("layer", "head")),
         ("llama", "blocks.{layer}.hook_mlp_out", ("layer", "pos")),
         ("mamba", "blocks.{layer}.hook_mixer_out", ("layer", "pos")),
         ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "pos", "head")),
         ("mamba2", "blocks.{layer}.mixer.hook_kernel", ("layer", "head")),
         ("zamba2", "blocks.{layer}.shared.attn.hook_z", ("layer", "head"))]


@pytest.mark.parametrize("arch, template, over", CASES, ids=[f"{a}-{t.split('.')[-1]}-{len(o)}" for a, t, o in CASES])
def test_act_patch_equals_hand_written_loop(arch, template, over):
    model = _model(arch)
    clean, corrupted = _pair(n=4)
    metric = logit_diff(3, 4)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith(template.split(".")[-1]))
        got = act_patch(model, corrupted, cache, metric, template, over)
        present = [l for l in range(model.cfg.n_layers) if template.format(layer=l) in model.hook_dict]
        expected = _hand_loop(model, corrupted, cache, metric, template, over, present)
    assert got.shape[0] == model.cfg.n_layers and got.ndim == len(over)
    assert all(got[l].isnan().all() for l in range(model.cfg.n_layers) if l not in present)
    assert len(expected) == got[present].numel()
    for idx, value in expected.items():
        assert got[idx].item() == pytest.approx(value, rel=1e-6, abs=1e-6), idx
    assert got[present].std() > 0, "every patch gave the same value: the test cannot fail"


@pytest.mark.parametrize("arch, template", [("llama", "blocks.{layer}.attn.hook_z"),
                                            ("mamba", "blocks.{layer}.mixer.hook_gated")])
def test_prefix_reuse_changes_nothing(arch, template):
    model = _model(arch)
    clean, corrupted = _pair(n=4)
    mask = _padded(corrupted)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, mask, names_filter=lambda n: n.endswith(template.split(".")[-1]))
        fast = act_patch(model, corrupted, cache, answer_prob(2), template, ("layer", "pos"), attention_mask=mask)
        slow = act_patch(model, corrupted, cache, answer_prob(2), template, ("layer", "pos"), attention_mask=mask,
                         reuse_prefix=False)
    assert torch.equal(fast, slow)


def test_helpers_pick_the_documented_hooks():
    model = _model("llama")
    clean, corrupted = _pair(n=3)
    metric = answer_prob(1)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, incl_lazy=True)
        pairs = [(head_patch(model, corrupted, cache, metric), "blocks.{layer}.attn.hook_z", ("layer", "head")),
                 (head_patch(model, corrupted, cache, metric, by_pos=True, hook="result"),
                  "blocks.{layer}.attn.hook_result", ("layer", "pos", "head")),
                 (output_patch(model, corrupted, cache, metric, "mlp"), "blocks.{layer}.hook_mlp_out", ("layer", "pos")),
                 (resid_patch(model, corrupted, cache, metric, "mid"), "blocks.{layer}.hook_resid_mid", ("layer", "pos"))]
        for got, template, over in pairs:
            assert torch.equal(got, act_patch(model, corrupted, cache, metric, template, over))
    assert pairs[0][0].shape == (3, 4) and pairs[1][0].shape == (3, 3, 4)


@pytest.mark.parametrize("arch", SSM)
def test_ssm_state_patch_equals_brute_force_recurrence(arch):
    """Set h at (pos t, head k) of one layer to the clean state; the recurrence continues from it."""
    model = _model(arch, dtype=torch.float64)
    clean, corrupted = _pair(n=9, flip=(1, 3))
    layer, t, k = 1, 4, 3
    pre = f"blocks.{layer}.mixer."
    with torch.no_grad():
        _, ccache = model.run_with_cache(clean, names_filter=[pre + "hook_h"])
        _, cache = model.run_with_cache(corrupted, names_filter=lambda n: n.startswith(pre))
        got_y = []
        with model.hooks(fwd_hooks=[(pre + "hook_y", lambda y, hook: got_y.append(y))]):
            got = patch(model, corrupted, ccache, pre + "hook_h", {"pos": t, "head": k})
        u, a_bar, b_bar, C = (cache[pre + n] for n in ("hook_ssm_in", "hook_A_bar", "hook_B_bar", "hook_C"))
        h = torch.zeros_like(cache[pre + "hook_h"][:, 0])
        ys = []
        for s in range(u.shape[1]):
            if arch == "mamba":  # h [b d_inner n], A_bar/B_bar [b d_inner n], C [b n]
                h = a_bar[:, s] * h + b_bar[:, s] * u[:, s, :, None]
            else:  # h [b H P N], A_bar [b H], B_bar [b H N], C [b G N]
                h = a_bar[:, s, :, None, None] * h + u[:, s, :, :, None] * b_bar[:, s, :, None, :]
            if s == t:
                h = h.clone()
                h[:, k] = ccache[pre + "hook_h"][:, t, k]
            if arch == "mamba":
                ys.append(torch.einsum("bdn,bn->bd", h, C[:, s]))
            else:
                Ch = C[:, s].repeat_interleave(h.shape[1] // C.shape[2], dim=1)
                ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch))
        y = torch.stack(ys, 1)
        expected = model.run_with_hooks(corrupted, fwd_hooks=[(pre + "hook_y", lambda _, hook: y)])
    rel_close(got_y[0], y, 1e-10, "patched y")
    rel_close(got_y[0][:, :t], cache[pre + "hook_y"][:, :t], 1e-12, "positions before t")
    rel_close(got, expected, 1e-10, "logits")
    assert (got - model(corrupted)).abs().max() > 1e-6


def test_noising_and_denoising_directions():
    model = _model("gpt2")
    clean, corrupted = _pair()
    metric = logit_diff(3, 4)
    template = "blocks.{layer}.hook_resid_pre"
    with torch.no_grad():
        den = run_patching(model, clean, corrupted, metric, template, over=("layer",))
        noi = run_patching(model, clean, corrupted, metric, template, over=("layer",), direction="noising")
        raw = run_patching(model, clean, corrupted, metric, template, over=("layer",), normalise=False)
        m_clean, m_corr = float(metric(model(clean))), float(metric(model(corrupted)))
    torch.testing.assert_close(den, torch.ones(3, dtype=torch.float64))  # the whole clean residual restores everything
    torch.testing.assert_close(noi, torch.zeros(3, dtype=torch.float64))  # the whole corrupted residual breaks everything
    torch.testing.assert_close(raw, torch.full((3,), m_clean, dtype=torch.float64))
    torch.testing.assert_close(normalised_score(torch.tensor([m_clean, m_corr]), m_clean, m_corr), torch.tensor([1.0, 0.0]))


def test_metrics_match_hand_computation():
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(0))
    answers, wrong = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    expected = (logits[torch.arange(3), -1, answers] - logits[torch.arange(3), -1, wrong]).mean()
    torch.testing.assert_close(logit_diff(answers, wrong)(logits), expected)
    probs = logits[:, 2].softmax(-1)[torch.arange(3), answers].mean()
    torch.testing.assert_close(answer_prob(answers, pos=2)(logits), probs)


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_attribution_is_exact_where_the_metric_is_linear(arch):
    """logits are linear in ln_final.hook_normalized: attribution == exact patching there."""
    model = _model(arch)
    clean, corrupted = _pair()
    metric = logit_diff(3, 4)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter="ln_final.hook_normalized")
        exact = act_patch(model, corrupted, cache, metric, "ln_final.hook_normalized", over=("pos",))
    approx = attribution_patch(model, corrupted, cache, metric, "ln_final.hook_normalized", over=("pos",))
    torch.testing.assert_close(approx, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, template, over", [("llama", "blocks.{layer}.attn.hook_z", ("layer", "pos", "head")),
                                                  ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "head")),
                                                  ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "pos")),
                                                  ("gpt2", "blocks.{layer}.hook_resid_mid", ("pos", "layer"))])
def test_attribution_equals_finite_differences(arch, template, over):
    """The estimate's slope equals a central difference: patch a step of +-eps toward the source.

    On a state (hook_h) a patch by position sets one position and continues the later ones (the slope is
    the total derivative), a patch by head sets every position of the head (each state's own effect).

    (eps is not tiny: HF-style RMS norms compute in float32 even in a float64 model.)
    """
    model = _model(arch, dtype=torch.float64)
    clean, corrupted = _pair(n=5)
    metric, eps = logit_diff(3, 4), 1e-2
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith(template.split(".")[-1]))
        base = float(metric(model(corrupted)))

        def stepper(e):  # act + e * (source - act) on the slice
            return lambda act, source, index: set_slice(act, act + e * (source - act), index)

        up = act_patch(model, corrupted, cache, metric, template, over, setter=stepper(eps))
        down = act_patch(model, corrupted, cache, metric, template, over, setter=stepper(-eps))
    approx = attribution_patch(model, corrupted, cache, metric, template, over)
    slope_exact, slope_approx = (up - down) / (2 * eps), approx - base
    assert approx.shape == up.shape
    scale = slope_exact.abs().max().item()
    torch.testing.assert_close(slope_approx, slope_exact, rtol=1e-2, atol=1e-3 * scale)
    assert scale > 1e-3


def test_compare_attribution_reports_agreement():
    model = _model("gpt2")
    clean, corrupted = _pair(flip=(4,))
    metric = logit_diff(3, 4)
    template = "blocks.{layer}.hook_attn_out"
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_attn_out"))
        base = float(metric(model(corrupted)))
        exact = act_patch(model, corrupted, cache, metric, template)
    approx = attribution_patch(model, corrupted, cache, metric, template)
    stats = compare_attribution(exact, approx, baseline=base)
    assert set(stats) == {"pearson", "max_abs_error", "top5_overlap"}
    assert 0.5 < stats["pearson"] <= 1.0  # a tiny random model is close to linear in one layer's output
    assert stats["max_abs_error"] >= 0


def test_errors_name_the_problem():
    model = _model("gpt2")
    clean, corrupted = _pair()
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("resid_pre"))
        with pytest.raises(KeyError, match="hook_z"):
            patch(model, corrupted, cache, "blocks.0.attn.hook_z")
        with pytest.raises(KeyError, match="unknown hook name"):
            act_patch(model, corrupted, cache, logit_diff(1, 2), "blocks.{layer}.hook_resid_pree")
        with pytest.raises(ValueError, match="over must"):
            act_patch(model, corrupted, cache, logit_diff(1, 2), "blocks.{layer}.hook_resid_pre", over=("layer", "time"))
        with pytest.raises(ValueError, match="source has shape"):
            patch(model, corrupted[:, :4], cache, "blocks.0.hook_resid_pre")
    assert index_tuple(model.hook_dict["blocks.0.attn.hook_pattern"], {"head": 2}) == (2,)
    assert index_tuple(model.hook_dict["blocks.0.attn.hook_z"], {"head": 2}) == (slice(None), 2)
