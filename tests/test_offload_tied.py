"""Disk offload of tied and shared weights (loaders/dispatch.py `_lend`): a model bigger than `max_memory`.

A tied embedding is lent to the unembedding's forward. Offloaded, the pair shares one stored tensor (the
offload index names it under both names), and the unembedding's forward onloads the embedding's weight
first and drops it after. Zamba2's shared block is one set of modules in every invocation, offloaded
once. On a tied Mamba, a tied Llama and Zamba2, `device_map="auto"` (and "sequential") with `max_memory`
below the model size puts the embedding on disk; logits, a cache and a knockout then equal the resident
model bit for bit, and the embedding is meta again after each forward. Until this, such a call was
refused ("embed lends its weight to unembed, so it cannot be offloaded").
"""

from __future__ import annotations

import pytest
import torch

from analysis.interventions import knockout
from loaders import from_pretrained
from loaders.dispatch import entry_of

TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def _configs():
    import transformers as t

    return {
        "mamba_tied": t.MambaConfig(vocab_size=512, hidden_size=32, state_size=4, num_hidden_layers=4, expand=2),
        "llama_tied": t.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "zamba2_shared": t.Zamba2Config(vocab_size=512, hidden_size=16, num_hidden_layers=4, mamba_d_state=8,
                                        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4,
                                        mamba_ngroups=2, num_attention_heads=4, intermediate_size=24, chunk_size=8,
                                        adapter_rank=3, max_position_embeddings=64,
                                        use_shared_attention_adapter=True),
    }


# (family, planner, max_memory as a fraction of the model's bytes)
CASES = [("mamba_tied", "auto", 0.3), ("llama_tied", "auto", 0.3), ("zamba2_shared", "auto", 0.3),
         ("mamba_tied", "sequential", 0.1), ("zamba2_shared", "sequential", 0.5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import build_tiny_hf

    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            build_tiny_hf(_configs()[name], perturb=0.02).save_pretrained(d)
            made[name] = d
        return made[name]

    return get


def _size(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _offloaded_pair(checkpoint, tmp_path, name, planner, fraction):
    d = checkpoint(name)
    plain = from_pretrained(d)
    model = from_pretrained(d, device_map=planner, max_memory={"cpu": int(_size(plain) * fraction)},
                            offload_folder=tmp_path)
    return plain, model


@pytest.mark.parametrize("name, planner, fraction", CASES)
def test_tied_embedding_goes_to_disk_and_logits_match(checkpoint, tmp_path, name, planner, fraction):
    plain, model = _offloaded_pair(checkpoint, tmp_path, name, planner, fraction)
    devices = model.hf_device_map
    assert devices[entry_of("embed.weight", devices)] == "disk"
    assert model.unembed.tied and model.embed.weight.is_meta  # offloaded, and lent to the unembedding
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))
        assert torch.equal(model(TOKENS, mask), plain(TOKENS, mask))
    assert model.embed.weight.is_meta  # dropped again after the unembedding read it


@pytest.mark.parametrize("name, planner, fraction", CASES[:3])
def test_cache_and_knockout_match(checkpoint, tmp_path, name, planner, fraction):
    plain, model = _offloaded_pair(checkpoint, tmp_path, name, planner, fraction)
    with torch.no_grad():
        _, want = plain.run_with_cache(TOKENS)
        _, got = model.run_with_cache(TOKENS)
        assert list(got.keys()) == list(want.keys()) and len(want.keys()) > 20
        for k in want.keys():
            assert torch.equal(got[k], want[k]), k
        with knockout(plain, sources=[1, 2], targets=[-1], layers=range(4)):
            cut = plain(TOKENS)
        with knockout(model, sources=[1, 2], targets=[-1], layers=range(4)):
            assert torch.equal(model(TOKENS), cut)
    assert not torch.equal(cut, plain(TOKENS))  # the knockout changed something


def test_lent_weight_on_disk_with_the_blocks_resident(checkpoint, tmp_path):
    """A dict map: the tied pair on disk, the blocks on cpu; the unembedding reads the embedding's weight
    through the embedding's offload hook."""
    d = checkpoint("llama_tied")
    plain = from_pretrained(d)
    devices = {"embed": "disk", "blocks": "cpu", "ln_final": "cpu", "unembed": "disk"}
    model = from_pretrained(d, device_map=devices, offload_folder=tmp_path)
    assert model.embed.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))
    assert model.embed.weight.is_meta
