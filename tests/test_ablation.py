"""Head ablation, layer skipping, pruning sweeps and block replacement against weight-edited HF models.

The oracle is the G&A procedure itself: the HF model with the heads' output-projection columns
zeroed (or its layers deleted). Ours must equal it through hooks alone and leave the weights as
they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import build_tiny_hf, rel_close

from analysis.interventions.ablation import (ablate_heads, head_layout, parse_head, prune_from_end, remove_and_restore,
                               replace_block, resolve_heads, skip_layers)
from loaders.load import from_hf

V = 96


def _gpt2(bias: bool = True):
    return transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64)


def _llama(bias: bool = False):
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)


def _mamba(bias: bool = False):
    return transformers.MambaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=3, state_size=4, expand=2,
                                    use_bias=bias)


def _mamba2(bias: bool = False):
    return transformers.Mamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2,
                                     head_dim=8, num_heads=8, n_groups=2, chunk_size=8, use_bias=bias)


# name: (config, HF output projection of layer l, does its weight take heads on axis 0 (Conv1D), HF layer list)
ARCHS = {
    "gpt2": (_gpt2, lambda hf, l: hf.transformer.h[l].attn.c_proj, 0, ("transformer", "h"), "n_layer"),
    "llama": (_llama, lambda hf, l: hf.model.layers[l].self_attn.o_proj, 1, ("model", "layers"), "num_hidden_layers"),
    "mamba": (_mamba, lambda hf, l: hf.backbone.layers[l].mixer.out_proj, 1, ("backbone", "layers"), "num_hidden_layers"),
    "mamba2": (_mamba2, lambda hf, l: hf.backbone.layers[l].mixer.out_proj, 1, ("backbone", "layers"),
               "num_hidden_layers"),
}
# heads to ablate, per architecture: (layer, head); Mamba-1 heads are channels of d_inner = 32
HEADS = {"gpt2": [(0, 1), (2, 0), (2, 3)], "llama": [(0, 1), (2, 0), (2, 3)], "mamba": [(0, 5), (2, 0), (2, 31)],
         "mamba2": [(0, 1), (2, 0), (2, 7)]}


def _pair(arch: str, bias: bool = False, seed: int = 0):
    hf = build_tiny_hf(ARCHS[arch][0](bias), seed=seed, perturb=0.1)
    return hf, from_hf(hf)


def _tokens(n: int = 11, batch: int = 2, seed: int = 1):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _edit_out_proj(hf, arch: str, heads: dict[int, list[int]], width: int, mean: dict[int, torch.Tensor] | None = None):
    """Zero the heads' input columns of each layer's output projection; optionally fold a mean into the bias."""
    _, out_proj, axis, _, _ = ARCHS[arch]
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for layer, hs in heads.items():
            proj = out_proj(hf, layer)
            w = proj.weight if axis == 1 else proj.weight.T  # [d_out, d_in] view
            for h in hs:
                cols = slice(h * width, (h + 1) * width)
                if mean is not None:
                    proj.bias += w[:, cols] @ mean[layer][cols].to(w)
                w[:, cols] = 0
    return hf


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights_unchanged(model, before):
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"weight {k} changed"


def _grouped(model, heads):
    """{layer: [heads]} from (layer, h) specs; also the per-head width at the write hook."""
    chosen = resolve_heads(model, heads)
    layout = head_layout(model)
    width = next(iter(layout.values())).width
    return {layout[p].layer: hs for p, hs in chosen.items()}, width


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ablate_heads_equals_zeroed_output_columns(arch):
    hf, model = _pair(arch)
    tokens = _tokens()
    heads = HEADS[arch]
    grouped, width = _grouped(model, heads)
    with torch.no_grad():
        expected = _edit_out_proj(hf, arch, grouped, width)(tokens).logits
        plain = model(tokens)
        before = _snapshot(model)
        with ablate_heads(model, heads):
            got = model(tokens)
        after = model(tokens)
    rel_close(got, expected, 1e-5, f"{arch} ablated logits")
    assert (got - plain).abs().max() > 1e-4 * plain.abs().max(), "ablation changed nothing: the test cannot fail"
    assert torch.equal(after, plain), "hooks left behind"
    _assert_weights_unchanged(model, before)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_keep_only_equals_zeroing_every_other_head(arch):
    hf, model = _pair(arch)
    tokens = _tokens()
    keep = [h for h in HEADS[arch] if h[0] == 2]
    layout = head_layout(model)
    n_heads = layout["blocks.2." + ("attn" if "blocks.2.attn" in layout else "mixer")].n_heads
    grouped, width = _grouped(model, keep)
    others = {2: [h for h in range(n_heads) if h not in grouped[2]]}
    with torch.no_grad():
        expected = _edit_out_proj(hf, arch, others, width)(tokens).logits
        before = _snapshot(model)
        with ablate_heads(model, keep, keep=True):
            got = model(tokens)
    rel_close(got, expected, 1e-5, f"{arch} keep-only logits")
    _assert_weights_unchanged(model, before)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mean_ablation_equals_mean_folded_into_bias(arch):
    hf, model = _pair(arch, bias=True)
    tokens, reference = _tokens(), _tokens(batch=3, seed=7)
    heads = HEADS[arch]
    grouped, width = _grouped(model, heads)
    layout = head_layout(model)
    hooks = [m.hook for m in layout.values()]
    with torch.no_grad():
        _, mean_cache = model.run_with_cache(reference, names_filter=hooks)
        means = {m.layer: mean_cache[m.hook].mean((0, 1)).reshape(-1) for m in layout.values()}
        expected = _edit_out_proj(hf, arch, grouped, width, mean=means)(tokens).logits
        with ablate_heads(model, heads, mode="mean", mean_cache=mean_cache):
            got = model(tokens)
    rel_close(got, expected, 1e-5, f"{arch} mean-ablated logits")


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layers", [[1], [0, 2]], ids=["one", "two"])
def test_skip_layers_equals_hf_without_those_layers(arch, layers):
    hf, model = _pair(arch)
    tokens = _tokens()
    *_, (owner, attr), n_attr = ARCHS[arch]
    pruned = copy.deepcopy(hf)
    parent = getattr(pruned, owner)
    kept = [b for i, b in enumerate(getattr(parent, attr)) if i not in layers]
    setattr(parent, attr, torch.nn.ModuleList(kept))
    setattr(pruned.config, n_attr, len(kept))
    with torch.no_grad():
        expected = pruned(tokens, use_cache=False).logits
        before = _snapshot(model)
        with skip_layers(model, layers):
            got, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(("resid_pre", "resid_post")))
    rel_close(got, expected, 1e-5, f"{arch} skipped {layers}")
    for l in layers:  # exact pass-through
        assert torch.equal(cache[f"blocks.{l}.hook_resid_post"], cache[f"blocks.{l}.hook_resid_pre"])
    _assert_weights_unchanged(model, before)


def test_prune_and_remove_tables():
    _, model = _pair("llama")
    tokens = _tokens()

    def evaluate(m):
        return m(tokens)[:, -1].log_softmax(-1)[:, 3].mean()

    with torch.no_grad():
        full = evaluate(model).item()
        rows = prune_from_end(model, evaluate, progress=False)
        removed = remove_and_restore(model, evaluate, progress=False)
        with skip_layers(model, [1]):
            without_1 = evaluate(model).item()
    assert [r["kept_layers"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["score"] == full
    assert [r["removed_layer"] for r in removed] == [None, 0, 1, 2]
    assert removed[0]["score"] == full and removed[2]["score"] == without_1
    assert len({r["score"] for r in rows}) == 4, "pruning depth changed nothing"


@pytest.mark.parametrize("donor_arch", ["llama", "mamba2"])
def test_replace_block_equals_manual_splice(donor_arch):
    _, model = _pair("llama")
    _, donor = _pair(donor_arch, seed=3)
    tokens = _tokens()
    layer = 1
    original = model.blocks[layer]
    with torch.no_grad():
        before = _snapshot(model)
        resid = model(tokens, stop_at_layer=layer)
        ctx = model.make_context(tokens.shape, None, tokens, tokens.device)
        resid = donor.blocks[layer](resid, ctx)
        expected = model(resid, start_at_layer=layer + 1, tokens=tokens)
        with replace_block(model, layer, donor):
            got = model(tokens)
    assert torch.equal(got, expected)
    assert model.blocks[layer] is original
    _assert_weights_unchanged(model, before)


def test_replace_block_refuses_other_width():
    _, model = _pair("llama")
    _, donor = _pair("mamba")  # d_model 16 vs 32
    with pytest.raises(ValueError, match="widths differ"):
        with replace_block(model, 1, donor):
            pass


def test_hooks_removed_when_body_raises():
    _, model = _pair("gpt2")
    tokens = _tokens()
    with torch.no_grad():
        plain = model(tokens)
        with pytest.raises(RuntimeError, match="boom"):
            with ablate_heads(model, [(1, 2)]), skip_layers(model, [0]):
                raise RuntimeError("boom")
        assert torch.equal(model(tokens), plain)


@pytest.mark.parametrize("heads, match", [([(5, 0)], r"the layer of head \(5, 0\) is 5: must be in \[-3, 3\)"),
                                          ([(0, 4)], r"head \(0, 4\) is 4: must be in \[-4, 4\)"),
                                          ([("blocks.0.mlp", 0)], "not a head module"), ([(0,)], "a head is")])
def test_bad_heads_raise(heads, match):
    _, model = _pair("gpt2")
    with pytest.raises((ValueError, IndexError), match=match):
        with ablate_heads(model, heads):
            pass


def test_parse_head_labels():
    assert parse_head("L3H5") == (3, 5)
    assert parse_head("L5SH3") == ("blocks.5.shared.attn", 3)
    with pytest.raises(ValueError):
        parse_head("layer3")


# ------------------------------------------------------------------------------------- Zamba2
M, H = "mamba", "hybrid"


def _zamba2(seed: int = 0):
    config = transformers.Zamba2Config(hidden_size=16, num_hidden_layers=4, layers_block_type=[M, H, M, H],
                                       mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=2, mamba_expand=2,
                                       num_attention_heads=4, intermediate_size=24, vocab_size=V, chunk_size=8,
                                       adapter_rank=3, max_position_embeddings=64, use_shared_attention_adapter=True)
    hf = build_tiny_hf(config, transformers.Zamba2ForCausalLM, seed=seed, perturb=0.1)
    return hf, from_hf(hf)


def _zero_cols(linear, heads, width=8):
    with torch.no_grad():
        for h in heads:
            linear.weight[:, h * width:(h + 1) * width] = 0


def test_zamba2_ablation_equals_zeroed_columns():
    """Mamba-2 heads of a Mamba layer and of a hybrid layer, and a shared head in every invocation."""
    hf, model = _zamba2()
    tokens = _tokens()
    heads = [(0, 1), (1, 2), ("blocks.1.shared.attn", 3), ("blocks.3.shared.attn", 3)]
    edited = copy.deepcopy(hf)
    _zero_cols(edited.model.layers[0].mamba.out_proj, [1])
    _zero_cols(edited.model.layers[1].mamba_decoder.mamba.out_proj, [2])
    shared = [edited.model.layers[l].shared_transformer.self_attn.o_proj.weight for l in (1, 3)]
    assert shared[0] is shared[1], "HF shares the block's parameters between invocations"
    _zero_cols(edited.model.layers[1].shared_transformer.self_attn.o_proj, [3])  # shared: both invocations
    with torch.no_grad():
        expected = edited(tokens, use_cache=False).logits
        before = _snapshot(model)
        with ablate_heads(model, heads):
            got = model(tokens)
    rel_close(got, expected, 1e-5, "zamba2 ablated logits")
    _assert_weights_unchanged(model, before)


@pytest.mark.parametrize("keep", [False, True], ids=["ablate", "keep_only"])
def test_zamba2_shared_heads_are_per_invocation(keep):
    """("blocks.1.shared.attn", h) touches that invocation only: HF with the block unshared, one copy edited."""
    hf, model = _zamba2()
    tokens = _tokens()
    edited = copy.deepcopy(hf)
    edited.model.layers[3].shared_transformer = copy.deepcopy(edited.model.layers[3].shared_transformer)  # unshare
    _zero_cols(edited.model.layers[1].shared_transformer.self_attn.o_proj, [0, 2, 3] if keep else [1])
    with torch.no_grad():
        expected = edited(tokens, use_cache=False).logits
        with ablate_heads(model, [("blocks.1.shared.attn", 1)], keep=keep):
            got = model(tokens)
    rel_close(got, expected, 1e-5, "zamba2 per-invocation")
    assert (got - model(tokens)).abs().max() > 1e-5


def test_zamba2_skip_layers():
    hf, model = _zamba2()
    tokens = _tokens()
    pruned = copy.deepcopy(hf)  # HF keys shared-block adapters by layer id: drop layers from the end only
    pruned.model.layers = torch.nn.ModuleList(list(pruned.model.layers)[:2])
    pruned.config.num_hidden_layers, pruned.config.layers_block_type = 2, [M, H]
    with torch.no_grad():
        expected = pruned(tokens, use_cache=False).logits
        with skip_layers(model, [2, 3]):
            got = model(tokens)
    rel_close(got, expected, 1e-5, "zamba2 without its last two layers")


@pytest.mark.parametrize("arch", ["llama", "mamba", "zamba2"])
def test_skipping_a_middle_layer_equals_jumping_over_it(arch):
    """Independent of HF: skip layer l == stop before l, then start at l + 1 (bit for bit)."""
    model = _zamba2()[1] if arch == "zamba2" else _pair(arch)[1]
    tokens = _tokens()
    with torch.no_grad():
        for layer in (0, 1):
            resid = model(tokens, stop_at_layer=layer)
            expected = model(resid, start_at_layer=layer + 1, tokens=tokens)
            with skip_layers(model, [layer]):
                assert torch.equal(model(tokens), expected), layer
