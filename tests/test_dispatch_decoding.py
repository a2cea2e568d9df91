"""Incremental decoding on dispatched models equals the plain model (issue 29).

accelerate hands each block on another device (or offloaded) its arguments through `.to`, so the
block sees `Context.to(device)`; that copy must keep the decoding state and the key mask, or the
blocks decode without their past (a 4-block Llama alternating cpu/disk generated
[17, 1, 19, 39, 21, 17] where the plain model gives [17, 17, 17, 17, 17, 17]). Here, on the cpu /
disk map of test_dispatch.py (blocks alternate, the rest offloaded but the embedding): greedy
`generate` (with and without the state) gives the same tokens on every family of tiny_families.py (also
under a knockout, whose cut state the DecodeState carries); step-by-step logits of a left-padded
batch and shared-prefix `ChoiceScorer` scores (prefix state selected per choice) equal the plain
model's up to float32 rounding (one-row products round by the weight's address).
GPU (skipped without CUDA): generate on a cuda:0 + cpu-offload map.
"""

from __future__ import annotations

import pytest
import torch
from test_dispatch import N_LAYERS, _configs, split_map

from tiny_families import FAMILIES

from analysis.interventions.knockout import knockout
from analysis.tasks.scoring import ChoiceScorer
from analysis.tasks.text import Example, char_tokenizer, kv_retrieval, multiple_choice
from hooked.models.base import Context
from hooked.models.decode_state import DecodeState
from loaders import from_pretrained
from loaders.dispatch import entry_of, tie_groups

V = 128  # the char tokenizer's 104 ids fit
ARCHS = list(_configs())
TOKENS = torch.randint(4, 64, (2, 7), generator=torch.Generator().manual_seed(3))
SHORT = TOKENS[:, :6]  # ids of every tiny family's vocabulary


def _config(name: str):
    cfg = _configs()[name]
    cfg.vocab_size = V
    for field in ("n_positions", "max_position_embeddings"):  # room for the scored prompts
        if hasattr(cfg, field):
            setattr(cfg, field, 256)
    return cfg


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """name -> (plain model, model dispatched over cpu and disk), each with a char tokenizer."""
    from conftest import build_tiny_hf

    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            build_tiny_hf(_config(name), perturb=0.05).save_pretrained(d)
            plain = from_pretrained(d)
            offload = tmp_path_factory.mktemp(f"{name}-off")
            model = from_pretrained(d, device_map=split_map(plain), offload_folder=offload)
            plain.tokenizer = model.tokenizer = char_tokenizer()
            made[name] = plain, model
        return made[name]

    return get


def test_context_to_keeps_the_state_and_moves_every_tensor():
    state = DecodeState()
    mask = torch.tensor([[False, True, True]])
    ctx = Context(mask[:, 1:], torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                  torch.zeros(1, 2, 4), state=state, key_mask=mask)
    moved = ctx.to("cpu")
    assert moved is not ctx and moved.state is state
    assert torch.equal(moved.key_mask, mask) and torch.equal(moved.keys_mask(), mask)
    for name in ("attention_mask", "position_ids", "tokens", "embedding"):
        assert torch.equal(getattr(moved, name), getattr(ctx, name)), name
    assert Context(None, torch.zeros(1, 1, dtype=torch.long)).to("cpu").state is None
    on_meta = ctx.to("meta")  # every tensor really moves
    assert all(getattr(on_meta, n).is_meta for n in ("attention_mask", "position_ids", "tokens", "embedding",
                                                      "key_mask")) and on_meta.state is state


@pytest.fixture(scope="module")
def family_pair(tmp_path_factory):
    """name -> (plain, dispatched) of every family of tests/tiny_families.py, saved and loaded back."""
    from conftest import build_tiny_hf
    from tiny_families import CONFIGS

    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            cls, config = CONFIGS[name]()
            build_tiny_hf(config, cls, perturb=0.05).save_pretrained(d)
            plain = from_pretrained(d)
            devices = split_map(plain)
            for names, _ in tie_groups(plain):  # shared blocks (Zamba2's) on the device of the first
                entries = sorted({entry_of(n, devices) for n in names})
                devices.update({e: devices[entries[0]] for e in entries})
            model = from_pretrained(d, device_map=devices, offload_folder=tmp_path_factory.mktemp(f"{name}-off"))
            made[name] = plain, model
        return made[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_equals_the_plain_model(family_pair, name):
    plain, model = family_pair(name)
    assert {"cpu", "disk"} <= set(model.hf_device_map.values())
    for use_state in (True, False):
        kw = dict(max_new_tokens=6, do_sample=False, stop_at_eos=False, use_past_kv_cache=use_state)
        want = plain.generate(SHORT, **kw)
        assert torch.equal(model.generate(SHORT, **kw), want), use_state
    with torch.no_grad():  # greedy: each new token is the argmax of the whole sequence before it
        assert torch.equal(plain(want[:, :-1])[:, -1].argmax(-1), want[:, -1])
    assert all(p.is_meta for n, p in model.named_parameters() if n.startswith("blocks.1."))  # still offloaded


@pytest.mark.parametrize("name", ["llama", "mamba", "mamba2", "zamba2", "falcon_h1"])
def test_generate_under_knockout_equals_the_plain_model(family_pair, name):
    """The knockout's cut state travels with the DecodeState through the dispatched blocks."""
    plain, model = family_pair(name)
    ko = dict(sources=[0, 2, 5], targets=[3, 5, 8, 9], layers=range(plain.cfg.n_layers), cut_conv=True)
    kw = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False)
    with knockout(plain, **ko):
        want = plain.generate(SHORT, **kw)
    with knockout(model, **ko):
        assert torch.equal(model.generate(SHORT, **kw), want)


@pytest.mark.parametrize("name", ARCHS)
def test_decoding_logits_of_a_left_padded_batch_are_identical(pair, name):
    plain, model = pair(name)
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0

    def decode(m):
        state, steps = DecodeState(), []
        with torch.no_grad():
            logits = m(TOKENS, mask, state=state)
            for _ in range(4):
                steps.append(logits[:, -1])
                logits = m(logits[:, -1].argmax(-1)[:, None], state=state)
        return steps

    for got, want in zip(decode(model), decode(plain), strict=True):  # rounding only (see the scores' test)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def _examples():
    """Multi-token choices (continuations read from the selected prefix state), left padding."""
    return (kv_retrieval(3, 2, seed=2) + [multiple_choice("Pick one", ["red", "green", "blue"], 2)]
            + [Example("x is", ["12", "13", "2", "24"], 0)])


@pytest.mark.parametrize("name", ARCHS)
def test_shared_prefix_scores_equal_the_plain_model(pair, name):
    plain, model = pair(name)
    with torch.no_grad():
        want = ChoiceScorer(plain, _examples(), batch_size=3).scores()
        got = ChoiceScorer(model, _examples(), batch_size=3).scores()
        rows = ChoiceScorer(model, _examples(), batch_size=3, shared_prefix=False).scores()
    # One-row matrix products round differently on a weight at another address (an offloaded block's
    # weights are fresh allocations, the plain model's sit at the file's offsets): float32 rounding,
    # where a continuation read without its prefix state would be off by whole nats.
    finite = torch.isfinite(want)
    assert finite.sum() >= 10 and torch.equal(torch.isfinite(got), finite) and torch.equal(torch.isfinite(rows), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[finite], rows[finite], rtol=0, atol=1e-5)  # == the whole-row path


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_generate_on_gpu_with_cpu_offload(pair, tmp_path, cuda, name):
    from conftest import build_tiny_hf

    build_tiny_hf(_config(name), perturb=0.05).save_pretrained(tmp_path)
    plain = from_pretrained(tmp_path, device=cuda)
    devices = {k: (0 if v == "cpu" else "cpu") for k, v in split_map(plain).items()}  # cpu entries: offloaded
    model = from_pretrained(tmp_path, device_map=devices)
    kw = dict(max_new_tokens=6, do_sample=False, stop_at_eos=False)
    tokens = TOKENS.to(cuda)
    assert torch.equal(model.generate(tokens, **kw), plain.generate(tokens, **kw))
    assert N_LAYERS == plain.cfg.n_layers
