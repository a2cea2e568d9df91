"""Hybrid families through the disk path and the CLI: save_pretrained (the original layouts: per-expert
tensors, `backbone.`, GraniteMoe names) -> from_pretrained == HF; `hooked hooks` lists every family's
hooks (MoE routing hooks included), each fires once, identity hooks keep logits bit-identical, and the
residual decomposition sums to the residual (multipliers applied in hook_*_out).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from analysis.cli import hook_shapes, main
from hooked import backends
from loaders import from_hf as from_hf_
from loaders import from_pretrained
from loaders.checkpoint_view import expert_view
from loaders.safetensors_io import MappingSource
from tests.hybrid_checks import check_against_hf
from tests.test_hybrid_analysis import FAMILIES, family

ORIGINAL_NAMES = {  # a name only the original layout has
    "granite": "model.layers.0.block_sparse_moe.input_linear.weight",
    "nemotron_h": "backbone.layers.2.mixer.experts.3.up_proj.weight",
    "jamba": "model.layers.1.feed_forward.experts.2.gate_proj.weight",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    hf, _ = family(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_save_pretrained_and_reload(saved):
    name, hf, path = saved
    if name in ORIGINAL_NAMES:
        with safe_open(path / "model.safetensors", "pt") as f:
            assert ORIGINAL_NAMES[name] in set(f.keys())
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    check_against_hf(hf, from_pretrained(path), tokens)


def test_cli_hooks_lists_every_hook(saved, capsys):
    name, _, path = saved
    assert main(["hooks", str(path), "--prompt", "a:1\nb:2"]) == 0
    out = capsys.readouterr().out
    model = from_pretrained(path)
    for hook in model.hook_dict:
        assert f"| {hook} " in out, hook
    if name in ("granite", "nemotron_h", "jamba"):
        assert "mlp.hook_routing_weights" in out and "mlp.hook_chosen" in out and "int64" in out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hooks_fire_once_identity_is_bit_identical_and_resid_decomposes(name):
    _, model = family(name)
    model = model.double()
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    fired: list[str] = []
    with torch.no_grad():
        with backends.use(attention="eager"):  # the hooks below put every layer on the exact path
            plain = model(tokens)
        hooked = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda t, hook: fired.append(hook.name) or t.clone())])
    assert torch.equal(plain, hooked)
    assert sorted(fired) == sorted(model.hook_dict) and len(fired) == len(set(fired))
    rows = hook_shapes(model, tokens)
    assert [r[0] for r in rows] == list(model.hook_dict)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    last = model.cfg.n_layers - 1
    parts = cache.decompose_resid(layer=None)
    torch.testing.assert_close(parts.sum(0), cache[f"blocks.{last}.hook_resid_post"], rtol=0, atol=1e-10)


def test_expert_view_refuses_gaps_and_passes_other_sources_through():
    plain = MappingSource({"a.weight": torch.zeros(2)}, origin="t")
    adapt = expert_view(stacks={"down_proj": ("down_proj",)})
    assert adapt(plain) is plain
    gap = MappingSource({"m.experts.0.down_proj.weight": torch.zeros(2, 3), "m.experts.2.down_proj.weight": torch.zeros(2, 3)},
                        origin="t")
    with pytest.raises(ValueError, match="not numbered"):
        adapt(gap)
    both = MappingSource({f"m.experts.{i}.{p}.weight": torch.full((2, 3), float(i)) for i in range(3)
                          for p in ("gate_proj", "up_proj")}, origin="t")
    view = expert_view(stacks={"gate_up_proj": ("gate_proj", "up_proj")})(both)
    assert view.keys() == ["m.experts.gate_up_proj"] and view.shape("m.experts.gate_up_proj") == (3, 4, 3)
    assert torch.equal(view.read("m.experts.gate_up_proj")[2], torch.full((4, 3), 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_parity_gpu_bfloat16(name):
    hf, _ = family(name)
    hf = hf.to("cuda", torch.bfloat16)
    model = from_hf_(hf)
    tokens = torch.randint(0, 128, (2, 21), device="cuda")
    check_against_hf(hf, model, tokens, rel=2e-2)
