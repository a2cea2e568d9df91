"""Batched patch sweeps: r different patches in one forward, one per block of batch rows,
equal one patch per forward; the tiling rule; screened_patch's batched verification.

Glossary
    replicas   patches per forward (act_patch / screened_patch `replicas=`); 1 = one patch per forward
"""

from __future__ import annotations

import pytest
import torch
from test_patching import _model, _padded, _pair

from analysis.interventions.batching import CPU_ELEMENTS, MAX_REPLICAS, tiles_for
from analysis.interventions.patching import act_patch, logit_diff, patch_replicas, screened_patch, set_slice

# (arch, hook template, axes swept): residual, head (hook_z, hook_result, pattern) and SSM-state hooks
CASES = [("gpt2", "blocks.{layer}.hook_resid_pre", ("layer", "pos")),
         ("gpt2", "blocks.{layer}.attn.hook_z", ("layer", "pos", "head")),
         ("gpt2", "blocks.{layer}.attn.hook_pattern", ("layer", "head")),
         ("llama", "blocks.{layer}.hook_resid_mid", ("layer", "pos")),
         ("llama", "blocks.{layer}.attn.hook_result", ("layer", "head")),
         ("mamba", "blocks.{layer}.mixer.hook_h", ("layer", "pos", "channel")),
         ("mamba", "blocks.{layer}.hook_resid_post", ("layer", "pos")),
         ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "pos", "head")),
         ("mamba2", "blocks.{layer}.mixer.hook_kernel", ("layer", "head")),
         ("zamba2", "blocks.{layer}.shared.attn.hook_z", ("layer", "head"))]


def _filter(template):
    head, _, tail = template.partition("{layer}")
    return lambda n: n.startswith(head) and n.endswith(tail)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("arch, template, over", CASES, ids=[f"{a}-{t.split('.')[-1]}-{len(o)}" for a, t, o in CASES])
def test_batched_sweep_equals_one_patch_per_forward(arch, template, over, padded):
    model = _model(arch)
    clean, corrupted = _pair(n=6, flip=(1, 3))
    mask = _padded(clean) if padded else None
    metric = logit_diff(3, 4)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, mask, names_filter=_filter(template))
        one = act_patch(model, corrupted, cache, metric, template, over, attention_mask=mask, replicas=1)
        # 5 does not divide most sweeps: the last forward of a layer holds fewer patches
        many = act_patch(model, corrupted, cache, metric, template, over, attention_mask=mask, replicas=5)
        full = act_patch(model, corrupted, cache, metric, template, over, attention_mask=mask, replicas=5,
                         reuse_prefix=False)
    assert torch.equal(one.isnan(), many.isnan()) and (~one.isnan()).sum() > 5
    ok = ~one.isnan()
    torch.testing.assert_close(many[ok], one[ok], rtol=0, atol=1e-6)
    torch.testing.assert_close(full[ok], one[ok], rtol=0, atol=1e-6)
    assert one[ok].std() > 1e-5, "every patch gave the same value: the test cannot fail"


def test_a_custom_setter_gets_each_block_alone():
    model = _model("llama")
    clean, corrupted = _pair(n=5)
    seen = []

    def scaled(act, source, index):  # patch half the way: a setter that is not set_slice
        seen.append(act.shape[0])
        out = act.clone()
        full = (slice(None),) + index
        out[full] = 0.5 * (act[full] + source[full])
        return out

    metric = logit_diff(3, 4)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=_filter("blocks.{layer}.hook_resid_pre"))
        one = act_patch(model, corrupted, cache, metric, "blocks.{layer}.hook_resid_pre", setter=scaled, replicas=1)
        many = act_patch(model, corrupted, cache, metric, "blocks.{layer}.hook_resid_pre", setter=scaled, replicas=4)
        plain = act_patch(model, corrupted, cache, metric, "blocks.{layer}.hook_resid_pre", replicas=4)
    assert set(seen) == {clean.shape[0]}  # the setter never sees the tiled batch
    torch.testing.assert_close(many, one, rtol=0, atol=1e-6)
    assert not torch.allclose(one, plain)


@pytest.mark.parametrize("arch, template, over", [("llama", "blocks.{layer}.attn.hook_z", ("layer", "head")),
                                                  ("mamba2", "blocks.{layer}.mixer.hook_h", ("layer", "pos"))])
def test_screened_patch_batched_verification_equals_one_per_forward(arch, template, over):
    model = _model(arch)
    clean, corrupted = _pair(n=6)
    _, cache = model.run_with_cache(clean, names_filter=_filter(template))
    metric = logit_diff(3, 5)
    one = screened_patch(model, corrupted, cache, metric, template, over, verify_top=6, n_control=2, replicas=1)
    many = screened_patch(model, corrupted, cache, metric, template, over, verify_top=6, n_control=2, replicas=3)
    assert torch.equal(one["verified"], many["verified"]) and int(one["verified"].sum()) == 8
    v = one["verified"]
    torch.testing.assert_close(many["exact"][v], one["exact"][v], rtol=0, atol=1e-6)


def test_the_rule_tiles_small_cpu_runs_and_caps():
    model = _model("llama")  # d_model 32
    assert tiles_for(model, 2, 8) == min(MAX_REPLICAS, CPU_ELEMENTS // (2 * 8 * 32)) == 32
    assert tiles_for(model, 64, 64) == 1 and tiles_for(model, 8, 16) == CPU_ELEMENTS // (8 * 16 * 32)
    assert tiles_for(model, 2, 8, limit=3) == 3
    # a lazy state larger than the stream counts instead of it (Mamba's hook_h: pos x d_inner x d_state)
    assert tiles_for(model, 2, 8, per_row=2**15) == 2 and tiles_for(model, 2, 8, per_row=100) == 32
    mamba = _model("mamba")
    clean, _ = _pair(n=64)
    _, cache = mamba.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_h"))
    state = cache["blocks.0.mixer.hook_h"]
    assert patch_replicas(mamba, clean, None, state) == tiles_for(mamba, 2, 64, per_row=state[0].numel()) == 8 \
        < patch_replicas(mamba, clean, None)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert patch_replicas(model, tokens, None) == 32 and patch_replicas(model, tokens, 4) == 4
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"^replicas(=|: expected)"):  # a WrongType is a ValueError too
            patch_replicas(model, tokens, bad)


def test_a_source_of_the_wrong_batch_is_refused_in_a_batched_sweep():
    model = _model("gpt2")
    clean, corrupted = _pair(n=5, batch=2)
    _, cache = model.run_with_cache(clean[:1], names_filter=_filter("blocks.{layer}.hook_resid_pre"))
    with pytest.raises(ValueError, match="source has shape"):
        act_patch(model, corrupted, cache, logit_diff(3, 4), "blocks.{layer}.hook_resid_pre", replicas=3)
    assert set_slice  # the default setter stays importable from patching
