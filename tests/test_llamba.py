"""Llamba (hooked/models/llamba.py, loaders/llamba.py) against tests/llamba_reference.py, an independent
loop over positions in Cartesia's checkpoint layout.

Logits and every resid_post equal the reference (float64 1e-10, float32 1e-5 relative) on
multi-head, grouped (n_qk_heads < n_v_heads) and single-group B/C, with and without biases, tied
or not, at lengths across chunk boundaries (chunk_size 4); a Cartesia checkpoint directory loads by
`from_pretrained` (config.json with or without model_type, vocabulary padded); Llamba-8B's config
builds on meta with its parameter count; the Mamba-2 hook contract (test_hooks_mamba2's table) and
invariants: kernel reconstruction, state edits == the reference recurrence from the edited state,
knockout == the brute-force recurrence and == the zeroed dense kernel (test_knockout's helpers),
left padding == the prompt alone, decoding with the state == recomputing.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_close
from llamba_reference import LlambaReference, LlambaReferenceConfig
from safetensors.torch import load_file, save_file
from test_hooks_mamba2 import LAZY, MIXER_HOOKS, run_layer
from test_knockout import close, masks, run, ssm_reference

from analysis.interventions import knockout
from hooked.models.decode_state import DecodeState
from hooked.models.llamba import DiscreteMamba2Mixer
from loaders.checks import ConfigError
from loaders.llamba import config_from_hf
from loaders.load import CheckpointError, from_hf, from_pretrained
from loaders.meta import build_on_meta
from loaders.registry import find_architecture

SSM = dict(d_state=8, n_v_heads=4, n_qk_heads=2, expand=1, chunk_size=4, activation="identity", bias=False)
CASES = {  # name -> LlambaReferenceConfig keywords
    "gqa": {},
    "mha": dict(ssm_cfg=SSM | dict(n_qk_heads=4)),
    "one_group_expand2": dict(ssm_cfg=SSM | dict(n_qk_heads=1, expand=2, d_conv=3)),
    "biases_no_conv_bias": dict(ssm_cfg=SSM | dict(bias=True, conv_bias=False),
                                mlp_cfg=dict(intermediate_size=20, bias=True, act_fn="silu")),
    "tied_no_model_type": dict(tie_embeddings=True, model_type=None, n_layer=3),
}
LENGTHS = [1, 4, 5, 13]
V = 61  # padded to 64


def reference(name: str = "gqa", dtype: torch.dtype = torch.float64, seed: int = 0) -> LlambaReference:
    torch.manual_seed(seed)
    ref = LlambaReference(LlambaReferenceConfig(**CASES[name])).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return ref.to(dtype)


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- the recurrence
@pytest.mark.parametrize("pos", LENGTHS)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_logits_and_resid_equal_the_recurrence(name, pos, dtype, rel):
    ref = reference(name, dtype)
    model = from_hf(ref).eval()
    toks = tokens(pos=pos)
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
        want = ref(toks)
        posts = ref.resid_posts(toks)
    assert logits.shape == (2, pos, 64) and logits.dtype == dtype
    rel_close(logits, want, rel, "logits")
    for layer, post in enumerate(posts):
        rel_close(cache[f"blocks.{layer}.hook_resid_post"], post, rel, f"resid_post {layer}")


def test_groupings_differ():
    """n_qk_heads is read: the grouped case is not the multi-head one with B and C repeated by accident."""
    mixer = from_hf(reference("gqa")).blocks[0].mixer
    assert isinstance(mixer, DiscreteMamba2Mixer) and (mixer.n_heads, mixer.n_groups) == (4, 2)
    assert torch.equal(mixer.A(), -torch.ones(4, dtype=torch.float64))


# ------------------------------------------------------------------------------ the checkpoint
@pytest.mark.parametrize("name", ["gqa", "tied_no_model_type", "biases_no_conv_bias"])
def test_cartesia_checkpoint_directory_loads(tmp_path, name):
    ref = reference(name, torch.float32)
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["vocab_size"] == V and ("model_type" in raw) == (name != "tied_no_model_type")
    model = from_pretrained(tmp_path)
    assert model.cfg.d_vocab == 64 and model.cfg.tied == (name == "tied_no_model_type")
    toks = tokens()
    with torch.no_grad():
        rel_close(model(toks), ref(toks), 1e-5, "logits")
    assert find_architecture(raw).name == "llamba"


def test_a_checkpoint_missing_a_tensor_is_named(tmp_path):
    reference("gqa", torch.float32).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["backbone.layers.1.mixer.z_bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.z_bias"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("change, match", [
    (dict(ssm_cfg=SSM | dict(activation="silu")), "activation='silu' is not supported"),
    (dict(lm_head_bias=True), "lm_head_bias=True is not supported"),
    (dict(ssm_cfg=SSM | dict(n_qk_heads=3)), "n_groups .3. must divide n_heads .4."),
])
def test_unsupported_configs_are_refused(tmp_path, change, match):
    ref = reference("gqa", torch.float32)
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises((ConfigError, ValueError), match=match):
        from_pretrained(tmp_path)


LLAMBA_8B = {  # cartesia-ai/Llamba-8B's config.json fields (LlambaConfig's defaults are the 8B sizes)
    "d_model": 4096, "n_layer": 32, "vocab_size": 128256, "pad_vocab_size_multiple": 8, "tie_embeddings": True,
    "lm_head_bias": False, "norm_epsilon": 1e-5, "resid_dropout": 0.0,
    "mlp_cfg": {"intermediate_size": 14336, "bias": False, "act_fn": "silu"},
    "ssm_cfg": {"d_state": 64, "n_v_heads": 32, "n_qk_heads": 32, "expand": 1, "chunk_size": 128,
                "activation": "identity", "bias": False},
}


LLAMBA_3B = LLAMBA_8B | {"d_model": 3072, "n_layer": 28, "mlp_cfg": {"intermediate_size": 8192}}


@pytest.mark.parametrize("config, count", [
    (LLAMBA_8B, 8_315_868_160),
    (LLAMBA_8B | {"tie_embeddings": False}, 8_841_204_736),  # cartesia-ai/Llamba-8B-untied
    (LLAMBA_3B, 3_656_994_688),  # x 4 bytes = 14.63 GB: the hub's float32 model.safetensors of Llamba-3B (14.6 GB)
])
def test_llamba_builds_on_meta_with_its_parameter_count(config, count):
    cfg = config_from_hf(config)
    model = build_on_meta(find_architecture(config).build, cfg)
    assert sum(p.numel() for p in model.parameters()) == count
    if cfg.d_model != 4096:
        return
    mixer = model.blocks[0].mixer
    assert mixer.in_proj.weight.shape == (2 * 4096 + 2 * 32 * 64 + 32, 4096)  # x, B, C, z, dt
    assert mixer.conv_weight.shape == (4096 + 2 * 32 * 64, 4) and mixer.z_bias.shape == (4096,)
    assert all(p.is_meta for p in model.parameters())


# ----------------------------------------------------------------------------- the hook contract
def test_every_mamba2_hook_fires_once_in_order_with_its_shape():
    model = from_hf(reference("gqa"))
    cfg, toks = model.cfg, tokens(pos=9)
    seen = []
    hooks = [(f"blocks.1.mixer.{h}", lambda x, hook: seen.append((hook.name.split(".")[-1], tuple(x.shape))))
             for h in MIXER_HOOKS]
    with torch.no_grad():
        model.run_with_hooks(toks, fwd_hooks=hooks)
    assert seen == [(h, fn(cfg, 2, 9)) for h, fn in MIXER_HOOKS.items()]


def test_identity_hooks_keep_logits_bit_identical():
    model, toks = from_hf(reference("gqa")), tokens()
    with torch.no_grad():
        plain = model(toks)
        hooked = model.run_with_hooks(toks, fwd_hooks=[(lambda n: ".mixer." in n, lambda x, hook: x)])
        _, cache = model.run_with_cache(toks, incl_lazy=True)
    assert torch.equal(plain, hooked)
    assert all(f"blocks.0.mixer.{h}" in cache.keys() for h in LAZY)


@pytest.mark.parametrize("pos", [1, 4, 13])
def test_kernel_reconstructs_y(pos):
    model = from_hf(reference("gqa"))
    _, cache = model.run_with_cache(tokens(pos=pos), names_filter=lambda n: n.split(".")[-1] in (
        "hook_kernel", "hook_ssm_in", "hook_y", "hook_conv", "hook_dt"))
    for layer in range(model.cfg.n_layers):
        pre = f"blocks.{layer}.mixer."
        kernel, u = cache[pre + "hook_kernel"], cache[pre + "hook_ssm_in"]
        assert torch.equal(kernel.triu(1), torch.zeros_like(kernel))
        torch.testing.assert_close(torch.einsum("bhji,bihp->bjhp", kernel, u), cache[pre + "hook_y"],
                                   rtol=0, atol=1e-12)
        x = cache[pre + "hook_conv"][..., :16].unflatten(-1, (4, 4))
        torch.testing.assert_close(u * cache[pre + "hook_dt"][..., None], x, rtol=0, atol=1e-12)  # u = x / dt


@pytest.mark.parametrize("positions", [(0,), (5,), (12,)])  # one position: added and set edits agree
def test_state_edit_equals_the_recurrence_from_the_edited_state(positions):
    model, toks, layer = from_hf(reference("gqa")), tokens(), 1
    g = torch.Generator().manual_seed(5)
    deltas = {t: torch.randn(2, 4, 4, 8, generator=g, dtype=torch.float64) for t in positions}

    def edit(h, hook):
        h = h.clone()
        for t, d in deltas.items():
            h[:, t] += d
        return h

    x, out = run_layer(model, toks, layer, [(f"blocks.{layer}.mixer.hook_h", edit)])
    ref_mixer = reference("gqa").backbone.layers[layer].mixer
    with torch.no_grad():
        want = ref_mixer(x, h_delta=deltas)
        clean = ref_mixer(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12 * want.abs().max().item())
    assert (out - clean).abs().max() > 1e-3


@pytest.mark.parametrize("t_edit", [0, 6, 12])
def test_a_dt_edit_changes_the_discretisation_not_the_input(t_edit):
    """hook_dt edited at one position: exp(dt' A) and dt' B there, with u = x / dt as computed before the hook."""
    model, toks, layer = from_hf(reference("gqa")), tokens(), 0
    factor = 1 + torch.rand(2, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def edit(dt, hook):
        dt = dt.clone()
        dt[:, t_edit] *= factor
        return dt

    x, out = run_layer(model, toks, layer, [(f"blocks.{layer}.mixer.hook_dt", edit)])
    ref_mixer = reference("gqa").backbone.layers[layer].mixer
    with torch.no_grad():
        want = ref_mixer(x, dt_factor={t_edit: factor})
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12 * want.abs().max().item())


# -------------------------------------------------------------------------------------- knockout
@pytest.mark.parametrize("layers, sources, targets, channels, conv", [
    ([1], [2, 3], [-1], None, False),
    ([0, 1], [0, 4, 5], [6, -1], None, True),
    ([1], [8, 9], [-1, 9], [1, 3], False),
])
def test_knockout_equals_the_brute_force_recurrence(layers, sources, targets, channels, conv):
    model, toks = from_hf(reference("gqa")), tokens(pos=11)
    clean = run(model, toks)
    with torch.no_grad(), knockout(model, sources, targets, layers, channels=channels, cut_conv=conv):
        cut = model(toks)
    close(cut, run(model, toks, ssm_reference(model, layers, sources, targets, channels, conv)))
    assert (cut - clean).abs().max() > 1e-6


def test_knockout_equals_the_zeroed_dense_kernel():
    model, toks, layers, src, tgt = from_hf(reference("gqa")), tokens(pos=11), [0, 1], [1, 4, 5], [5, -1]

    def zero(kernel, hook):
        cut = masks(tgt, kernel.shape[0], 11)[:, :, None] & masks(src, kernel.shape[0], 11)[:, None, :]
        return kernel.masked_fill(cut[:, None], 0.0)
    with torch.no_grad(), knockout(model, src, tgt, layers):
        cut = model(toks)
    close(cut, run(model, toks, [(f"blocks.{l}.mixer.hook_kernel", zero) for l in layers]))


# ------------------------------------------------------------------------- padding and decoding
@pytest.mark.parametrize("name", ["gqa", "biases_no_conv_bias"])
def test_left_padding_equals_the_prompt_alone(name):
    model, toks = from_hf(reference(name, torch.float32)), tokens(pos=9)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0
    with torch.no_grad():
        batched = model(toks, attention_mask=mask)
        alone = model(toks[1:, 3:])
    rel_close(batched[1, 3:], alone[0], 1e-5, "padded row")


@pytest.mark.parametrize("name", ["gqa", "one_group_expand2"])
def test_decoding_with_the_state_equals_recomputing(name):
    model, toks = from_hf(reference(name)), tokens(pos=11)
    state, steps = DecodeState(), []
    with torch.no_grad():
        steps.append(model(toks[:, :6], state=state))
        for t in range(6, 11):
            steps.append(model(toks[:, t:t + 1], state=state))
        whole = model(toks)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-10)


# ------------------------------------------------------------------ the analyses, with no edits
def test_the_analyses_run_on_llamba_and_agree_with_the_weights():
    """knockout, ablate_heads (== out_proj columns zeroed), kernel_rows (== hook_kernel's rows), act_patch,
    rank_heads, ga_scores and info_flow run on Llamba as they do on Mamba-2."""
    from analysis.ga import ga_scores, head_units, rank_heads
    from analysis.info_flow import info_flow
    from analysis.interventions import ablate_heads, act_patch
    from analysis.kernel_rows import kernel_rows
    from analysis.tasks.known_facts import load_facts
    from analysis.tasks.text import char_tokenizer, kv_retrieval

    torch.manual_seed(0)
    ref = LlambaReference(LlambaReferenceConfig(vocab_size=128, n_layer=3)).double().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model = from_hf(ref)
    model.tokenizer = char_tokenizer()
    toks = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    units = head_units(model)
    assert [u.label for u in units][:4] == ["L0H0", "L0H1", "L0H2", "L0H3"] and len(units) == 12  # the paper's labels
    with torch.no_grad():
        plain, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_kernel", "hook_resid_pre")))
        with ablate_heads(model, [(1, 2)]):
            ablated = model(toks)
        out = model.blocks[1].mixer.out_proj
        kept = out.weight.clone()
        out.weight[:, 8:12] = 0  # head 2's d_head = 4 columns
        zeroed = model(toks)
        out.weight.copy_(kept)
    torch.testing.assert_close(ablated, zeroed, rtol=0, atol=1e-12)
    rows = kernel_rows(model, toks, [3, 8])
    for layer in range(3):
        dense = cache[f"blocks.{layer}.mixer.hook_kernel"]
        torch.testing.assert_close(rows[f"blocks.{layer}.mixer"], dense[:, :, [3, 8]], rtol=0, atol=1e-12)
    sweep = act_patch(model, toks, cache, lambda logits: logits[:, -1, 0].sum(), "blocks.{layer}.hook_resid_pre")
    assert sweep.shape == (3, 9) and torch.allclose(sweep, plain[:, -1, 0].sum().expand(3, 9))  # patched with itself
    examples = kv_retrieval(2, 2, seed=3)
    scores = ga_scores(model, examples, units, batch_size=2)
    assert set(scores) == {u.label for u in units} and all(0 <= v["gather"] <= 1 for v in scores.values())
    ranking = rank_heads(model, examples, units[:4], batch_size=2, progress=False, pairs_top_k=0)
    assert ranking.matrix().shape[0] >= 1
    flow = info_flow(model, load_facts()[:2], window=1, sources=("last",), batch_size=2, require_correct=False,
                     progress=False)
    assert flow.changes.shape == (2, 1, 3) and torch.isfinite(flow.changes).all()


@pytest.mark.parametrize("scan", ["chunked", "fused"])
def test_every_scan_backend_gives_the_loops_logits_and_decoding(scan):
    """"chunked" (two-level scan) and "fused" (mamba-ssm's kernels, or on a CPU their stand-ins; float32,
    a kernel dtype) as "loop", whole sequences and decoding steps."""
    from hooked import backends

    model, toks = from_hf(reference("gqa", torch.float32)), tokens(pos=13)
    with torch.no_grad():
        want = model(toks)
        with backends.use(scan=scan):
            got = model(toks)
            ran = backends.active(model)["blocks.0.mixer"]
            state = DecodeState()
            stepped = torch.cat([model(toks[:, :7], state=state)] + [model(toks[:, t:t + 1], state=state)
                                                                     for t in range(7, 13)], 1)
    assert ran == scan
    rel_close(got, want, 1e-5, scan)
    rel_close(stepped, want, 1e-5, f"{scan}, decoding")
