"""Careless analysis arguments: refused with the argument's name and valid range, never rounded,
wrapped or split, and the validation layer itself.

A refused call leaves no hook behind and the model's logits bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, act_patch, attribution_patch, decay_split, knockout, patch
from analysis.interventions.ablation import replace_block
from analysis.tasks.text import kv_retrieval
from hooked.validate import IndexOutOfRange, NotAnIndex, WrongType, index_list, index_mask, position_mask, positive_int
from loaders.load import from_hf

TOKENS = torch.tensor([[1, 5, 9, 13, 17, 21]])


@pytest.fixture(scope="module")
def llama():
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    return from_hf(hf)


@pytest.fixture(scope="module")
def mamba():
    import transformers

    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2)).eval()
    return from_hf(hf)


def unchanged(model, reference):
    assert torch.equal(model(TOKENS), reference)
    assert not any(p.has_hooks for p in model.hook_dict.values())


def run_knockout(model, **kw):
    args = dict(sources=[0], targets=[-1], layers=[0]) | kw
    with knockout(model, **args):
        return model(TOKENS)


# ------------------------------------------------------------------- floats, strings
KNOCKOUT_CASES = {  # name -> (model, kwargs, error, message)
    "layers float": ("llama", {"layers": [1.7]}, NotAnIndex, r"layers: expected an integer index .* got 1\.7"),
    "layers bool": ("llama", {"layers": [True]}, NotAnIndex, r"got True"),
    "layers out of range": ("llama", {"layers": [2]}, IndexOutOfRange, r"layers=2: must be in \[-2, 2\)"),
    "sources float": ("llama", {"sources": [1.5]}, NotAnIndex, r"sources: expected an integer index .* 1\.5"),
    "sources string": ("llama", {"sources": "12"}, NotAnIndex, r"sources: expected integer indices, got the string"),
    "targets float tensor": ("llama", {"targets": torch.tensor([1.0])}, NotAnIndex, r"targets"),
    "sources out of range": ("llama", {"sources": [6]}, IndexOutOfRange, r"sources=6: must be in \[-6, 6\)"),
    "sources mask shape": ("llama", {"sources": torch.ones(5, dtype=torch.bool)}, ValueError, r"sources: mask"),
    "channels float": ("mamba", {"channels": [0.5]}, NotAnIndex, r"channels: expected an integer index .* 0\.5"),
    "channels out of range": ("mamba", {"channels": [32]}, IndexOutOfRange, r"channels=32: must be in \[-32, 32\) \(the 32 channels of blocks\.0\.mixer\)"),
    "channels mask shape": ("mamba", {"channels": torch.ones(3, dtype=torch.bool)}, ValueError, r"shape \(32,\)"),
}


@pytest.mark.parametrize("case", list(KNOCKOUT_CASES))
def test_knockout_refuses(request, case):
    which, kw, error, message = KNOCKOUT_CASES[case]
    model = request.getfixturevalue(which)
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        run_knockout(model, **kw)
    unchanged(model, reference)


def test_knockout_negative_layer_is_explicit(llama):
    assert torch.equal(run_knockout(llama, layers=[-1]), run_knockout(llama, layers=[1]))


@pytest.mark.parametrize("head, error, message", [
    ((0, 1.5), NotAnIndex, r"head \(0, 1\.5\): expected an integer index"),
    ((0.5, 1), NotAnIndex, r"the layer of head \(0\.5, 1\)"),
    ((0, 4), IndexOutOfRange, r"head \(0, 4\) is 4: must be in \[-4, 4\)"),
    ((5, 0), IndexOutOfRange, r"the layer of head \(5, 0\) is 5: must be in \[-2, 2\)"),
    ((0, "1"), NotAnIndex, r"got '1'"),
])
def test_ablate_heads_refuses(llama, head, error, message):
    reference = llama(TOKENS)
    with pytest.raises(error, match=message):
        with ablate_heads(llama, [head]):
            pass
    unchanged(llama, reference)


# ------------------------------------------------------------------------ no modulo
def test_decay_split_layer_out_of_range(mamba):
    with pytest.raises(IndexOutOfRange, match=r"layer=99: must be in \[-2, 2\)"):
        decay_split(mamba, 99)


def test_act_patch_layers_out_of_range(llama):
    _, cache = llama.run_with_cache(TOKENS)
    with pytest.raises(IndexOutOfRange, match=r"layers=9: must be in \[-2, 2\)"):
        act_patch(llama, TOKENS, cache, lambda l: l[0, -1, 0], "blocks.{layer}.hook_resid_pre", layers=[9])


def test_info_flow_starts_out_of_range(llama):
    with pytest.raises(IndexOutOfRange, match=r"starts=99: must be in \[-2, 2\)"):
        info_flow(llama, [], starts=[99])


# --------------------------------------------------------- attribution cache shape
@pytest.mark.parametrize("source", [TOKENS[:, :1], TOKENS.expand(2, -1), torch.arange(8)[None]],
                         ids=["1 token", "batch 2", "8 tokens"])
def test_attribution_patch_cache_shape_checked(llama, source):
    _, cache = llama.run_with_cache(source)
    with pytest.raises(ValueError, match=r"the source cache has shape .* the base run"):
        attribution_patch(llama, TOKENS, cache, lambda l: l[0, -1, 0], "blocks.{layer}.hook_resid_pre")


# ---------------------------------------------------------------- axes that exist
def test_act_patch_layer_axis_needs_a_layer_template(llama):
    _, cache = llama.run_with_cache(TOKENS)
    with pytest.raises(ValueError, match=r"over has 'layer' but the template .* has no \{layer\}"):
        act_patch(llama, TOKENS, cache, lambda l: l[0, -1, 0], "blocks.0.hook_resid_pre", over=("layer", "pos"))
    with pytest.raises(ValueError, match=r"has \{layer\} but over"):
        act_patch(llama, TOKENS, cache, lambda l: l[0, -1, 0], "blocks.{layer}.hook_resid_pre", over=("pos",))


def test_patch_head_index_on_a_stream_refused(llama):
    _, cache = llama.run_with_cache(TOKENS)
    with pytest.raises(ValueError, match=r"blocks\.0\.hook_resid_pre has no 'head' axis"):
        patch(llama, TOKENS, cache, "blocks.0.hook_resid_pre", index={"head": 0})
    with pytest.raises(NotAnIndex, match=r"index .* axis 1"):
        patch(llama, TOKENS, cache, "blocks.0.hook_resid_pre", index={"pos": 1.5})
    with pytest.raises(IndexOutOfRange):
        patch(llama, TOKENS, cache, "blocks.0.attn.hook_z", index={"head": 7})


def test_patch_head_index_where_heads_exist(llama):
    _, clean = llama.run_with_cache(TOKENS)
    corrupted = TOKENS.flip(-1)
    out = patch(llama, corrupted, clean, "blocks.0.attn.hook_z", index={"head": -1})

    def by_hand(z, hook):
        z = z.clone()
        z[:, :, 3] = clean["blocks.0.attn.hook_z"][:, :, 3]
        return z

    assert torch.equal(out, llama.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.attn.hook_z", by_hand)]))


# ------------------------------------------------------------------ distinct keys
def test_kv_retrieval_refuses_repeated_words():
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        kv_retrieval(2, 3, words=("a", "a", "b"))
    with pytest.raises(ValueError, match="without ':'"):
        kv_retrieval(2, 3, words=("a:b", "c", "d"))
    with pytest.raises(WrongType, match="n_pairs"):  # a count, not an index
        kv_retrieval(2.5, 3)
    for ex in kv_retrieval(3, 20, words=("a", "b", "c", "d")):
        assert len(set(ex.meta["keys"])) == 3


# ------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv, message", [
    (["knockout", "M", "--n", "-1"], r"--n=-1: must be >= 1"),
    (["knockout", "M", "--n", "0"], r"--n=0: must be >= 1"),
    (["knockout", "M", "--window", "0"], r"--window=0"),
    (["ga", "M", "--n", "0"], r"--n=0: must be >= 1"),
    (["ga", "M", "--pairs", "3,x"], r"--pairs must be comma-separated integers"),
    (["ga", "M", "--pairs", "0"], r"--pairs=0"),
])
def test_cli_refuses_bad_counts(argv, message, capsys, tmp_path):
    from analysis.cli import main

    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and pytest.importorskip("re").search(message, err), err


@pytest.mark.parametrize("command", ["knockout", "ga"])
def test_cli_checks_the_output_directory_first(command, capsys, tmp_path):
    from analysis.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main([command, str(tmp_path / "no_model"), "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a writable directory" in err, err  # before the model is even loaded


# ----------------------------------------------------------------- widths checked
def test_start_at_layer_refuses_a_residual_of_another_width(llama):
    with pytest.raises(ValueError, match=r"d_model=32\] with pos >= 1, got shape \(1, 6, 16\)"):
        llama(torch.zeros(1, 6, 16), start_at_layer=1)
    with pytest.raises(ValueError, match=r"dtype must be the model's"):
        llama(torch.zeros(1, 6, 32, dtype=torch.float64), start_at_layer=1)
    with pytest.raises(TypeError, match=r"start_at_layer"):  # jaxtyping under pytest, ours otherwise
        llama(torch.zeros(1, 6, 32), start_at_layer=1.0)


def test_replace_block_refuses_a_block_of_another_width(llama, mamba):
    reference = llama(TOKENS)
    with pytest.raises(ValueError, match=r"the block for layer 1 does not run on this model's residual"):
        with replace_block(llama, 1, mamba.blocks[0]):
            pass
    with pytest.raises(ValueError, match="widths differ"):
        with replace_block(llama, 1, mamba):
            pass
    with pytest.raises(IndexOutOfRange, match=r"donor_layer=5: must be in \[-2, 2\)"):
        with replace_block(llama, 1, llama, donor_layer=5):
            pass
    unchanged(llama, reference)
    with replace_block(llama, 1, llama, donor_layer=1):
        assert torch.equal(llama(TOKENS), reference)


# ------------------------------------------------------------------- the validation layer
GOOD = [  # (spec, n, expected indices)
    (3, 5, [3]), (-1, 5, [4]), ([0, -1], 5, [0, 4]), (range(2), 5, [0, 1]), (torch.tensor([1, 2]), 5, [1, 2]),
    (np.array([4]), 5, [4]), (np.int64(2), 5, [2]), (torch.tensor(0), 5, [0]), ([], 5, []), ({2, 0}, 5, [0, 2]),
]
BAD = [  # (spec, n, error)
    (1.0, 5, NotAnIndex), ([1.7], 5, NotAnIndex), ("1", 5, NotAnIndex), (True, 5, NotAnIndex), ([False], 5, NotAnIndex),
    (None, 5, NotAnIndex), ([[1]], 5, NotAnIndex), (torch.tensor([0.5]), 5, NotAnIndex), (np.array([1.0]), 5, NotAnIndex),
    (5, 5, IndexOutOfRange), (-6, 5, IndexOutOfRange), ([0, 9], 5, IndexOutOfRange), (torch.zeros(2, 2, dtype=torch.long), 5,
                                                                                      ValueError),
    (torch.tensor([True]), 5, NotAnIndex), (b"1", 5, NotAnIndex), (object(), 5, NotAnIndex),
]


@pytest.mark.parametrize("spec, n, expected", GOOD, ids=[repr(g[0]) for g in GOOD])
def test_index_list_accepts(spec, n, expected):
    assert index_list(spec, n, "x") == expected


@pytest.mark.parametrize("spec, n, error", BAD, ids=[repr(b[0])[:20] for b in BAD])
def test_index_list_refuses(spec, n, error):
    with pytest.raises(error, match=r"^x"):
        index_list(spec, n, "x")


def test_masks_and_counts():
    assert index_mask([True, False, True], 3, "m").tolist() == [True, False, True]
    assert index_mask([-1], 3, "m").tolist() == [False, False, True]
    with pytest.raises(ValueError, match=r"m: a bool mask must have shape \(3,\)"):
        index_mask([True, False], 3, "m")
    assert position_mask([0, -1], 2, 3, what="p").tolist() == [[True, False, True]] * 2
    with pytest.raises(ValueError, match=r"p: mask has shape \(2, 2\)"):
        position_mask(torch.ones(2, 2, dtype=torch.bool), 2, 3, what="p")
    assert positive_int(np.int64(3), "n") == 3
    for bad, error in ((0, ValueError), (2.0, WrongType), (True, WrongType), ("3", WrongType)):
        with pytest.raises(error, match="^n"):
            positive_int(bad, "n")


# ------------------------------------------------------------------ confusing: facts files
@pytest.mark.parametrize("content, message", [
    ('[{"subject": ["a", "b", "c"], "attribute": "x", "prompt": "a is"}]', r"must be non-empty strings: 0\.subject"),
    ('[{"subject": "a", "prompt": "a is"}]', r"facts \[0\] lack one of"),
    ('{"subject": "a"}', r"expected a JSON list of fact objects"),
    ('[{"subject": "a",', r"not a JSON facts file"),
])
def test_malformed_facts_file_named(tmp_path, content, message):
    from analysis.tasks.known_facts import load_facts

    path = tmp_path / "facts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_facts(path)
    assert "facts.json" in str(info.value)
