"""Path patching: TL 3.9's direct path patching numbers on a tiny GPT-2; a brute-force construction on SSMs.

GPT-2: ours (`norm="frozen"`) equals `transformer_lens.tools.analysis.direct_path_patching.
get_act_patch_direct_path` for every source head, destination head and component, both models processed
TL's way (fold_ln, centred writers). Mamba-2 and Zamba2 (exact norm): a path's metric equals a
two-forward construction written here from hook names alone: cache both runs, then rerun base with the
receiver's rows of in_proj recomputed from ln1(hook_mixer_in + sender's change), or, for Zamba2's shared
block, its hook_in's residual half shifted by the sender's change.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import tiny

from analysis.circuits.paths import path_patch, path_patch_sweep


def _tl_pair():
    from hooked.processing import process_weights
    from tests.tl_oracle import pair, tl_model

    ours, _, tokenizer, hf = pair("gpt2")
    process_weights(ours, fold_ln=True, center_writing_weights=True, center_unembed=False, fold_value_biases=False)
    theirs = tl_model("gpt2", hf, tokenizer, fold_ln=True, center_writing_weights=True)
    return ours, theirs


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated")
def test_direct_path_patching_equals_tls():
    pytest.importorskip("transformer_lens")
    from transformer_lens.tools.analysis.direct_path_patching import get_act_patch_direct_path

    ours, theirs = _tl_pair()
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(4, 48, (2, 7), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 1:4] = torch.randint(4, 48, (2, 3), generator=gen)
    answer = clean[:, -1]

    def metric(logits):
        return logits[torch.arange(2), -1, answer].mean()

    with torch.no_grad():
        _, clean_cache = theirs.run_with_cache(clean)
        _, corrupted_cache = theirs.run_with_cache(corrupted)
    n_layers, n_heads = ours.cfg.n_layers, ours.cfg.n_heads
    with torch.no_grad():
        unpatched = float(metric(theirs(corrupted)))
    moved = 0.0
    for src_layer in range(n_layers - 1):
        for src_head in range(n_heads):
            for component in ("q", "k", "v"):
                with torch.no_grad():
                    tl_grid = get_act_patch_direct_path(theirs, corrupted, clean_cache, corrupted_cache, metric,
                                                        src_layer, src_head, component, verbose=False)
                receivers = [f"L{l}H{h}.{component}" for l in range(src_layer + 1, n_layers) for h in range(n_heads)]
                mine = path_patch_sweep(ours, corrupted, clean, metric, [f"L{src_layer}H{src_head}"], receivers,
                                        norm="frozen")[0].reshape(n_layers - src_layer - 1, n_heads)
                torch.testing.assert_close(mine.float(), tl_grid[src_layer + 1:].float(), rtol=1e-4, atol=1e-4)
                moved = max(moved, float((tl_grid[src_layer + 1:] - unpatched).abs().max()))
    assert moved > 1e-2  # the paths move the metric: the comparison is not of constants


# ------------------------------------------------------------------------------ brute force on SSMs
def _metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


def _rows(mixer, h):
    """in_proj rows of Mamba-2 head h's own input: z, x and dt (mamba2.py's split)."""
    p, di = mixer.d_head, mixer.d_inner
    return torch.cat([torch.arange(h * p, (h + 1) * p), torch.arange(di + h * p, di + (h + 1) * p),
                      torch.tensor([di + mixer.conv_dim + h])])


def _head_write(cache, layer, h):
    return cache[f"blocks.{layer}.mixer.hook_head_out"][:, :, h]


def _brute_rows(model, base, source, delta_of, layer, h):
    """Metric of base with in_proj rows of head h at `layer` recomputed from ln1(mixer_in + delta)."""
    block = model.blocks[layer]
    names = [f"blocks.{layer}.hook_mixer_in"]
    with torch.no_grad():
        _, cache = model.run_with_cache(base, names_filter=names)
        _, cache_b = model.run_with_cache(base, names_filter=lambda n: "hook_head_out" in n or "shared_out" in n)
        _, cache_s = model.run_with_cache(source, names_filter=lambda n: "hook_head_out" in n or "shared_out" in n)
    delta = delta_of(cache_s) - delta_of(cache_b)
    patched_in = block.ln1(cache[names[0]] + delta)
    rows = _rows(block.mixer, h)

    def fwd(module, args, out):
        out = out.clone()
        out[..., rows] = module.forward(patched_in)[..., rows]
        return out

    handle = block.mixer.in_proj.register_forward_hook(fwd)
    try:
        with torch.no_grad():
            return float(_metric(model(base)))
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["mamba2", "zamba2"])
def test_path_patching_equals_brute_force_on_ssms(name):
    model = copy.deepcopy(tiny(name)).double()
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(1, 64, (2, 7), generator=gen)
    source = torch.randint(1, 64, (2, 7), generator=gen)
    last = model.cfg.n_layers - 1
    for h_send, h_recv in ((0, 1), (3, 2)):
        mine = path_patch(model, base, source, _metric, [f"L0H{h_send}"], [f"L{last}H{h_recv}.x"])
        brute = _brute_rows(model, base, source, lambda c: _head_write(c, 0, h_send), last, h_recv)
        assert abs(mine - brute) <= 1e-10 * max(1.0, abs(brute)), (name, h_send, h_recv, mine, brute)
        with torch.no_grad():
            assert abs(mine - float(_metric(model(base)))) > 1e-6  # the path moves the metric
    if name == "zamba2":
        hybrid = model.cfg.hybrid_layer_ids[0]
        # the shared block's output into its own layer's mixer (head 1's rows)
        mine = path_patch(model, base, source, _metric, [f"shared{hybrid}"], [f"L{hybrid}H1.x"])
        brute = _brute_rows(model, base, source, lambda c: c[f"blocks.{hybrid}.hook_shared_out"], hybrid, 1)
        assert abs(mine - brute) <= 1e-10 * max(1.0, abs(brute))
        # a head into the shared block: its hook_in's residual half shifted
        mine = path_patch(model, base, source, _metric, ["L0H2"], [f"shared{hybrid}"])
        with torch.no_grad():
            _, cb = model.run_with_cache(base, names_filter=lambda n: "hook_head_out" in n)
            _, cs = model.run_with_cache(source, names_filter=lambda n: "hook_head_out" in n)
        delta = _head_write(cs, 0, 2) - _head_write(cb, 0, 2)
        d = model.cfg.d_model

        def shift(x, hook):
            x = x.clone()
            x[..., :d] += delta
            return x

        with torch.no_grad(), model.hooks(fwd_hooks=[(f"blocks.{hybrid}.shared.hook_in", shift)]):
            brute = float(_metric(model(base)))
        assert abs(mine - brute) <= 1e-10 * max(1.0, abs(brute))


def test_path_patching_refuses_a_backward_path_and_unknown_nodes():
    model = tiny("llama")
    tokens = torch.randint(1, 64, (1, 5))
    with pytest.raises(ValueError, match="no path"):
        path_patch(model, tokens, tokens, _metric, ["L1H0"], ["L0H0.q"])
    with pytest.raises(KeyError, match="no sender 'L9H0'"):
        path_patch(model, tokens, tokens, _metric, ["L9H0"], ["logits"])
