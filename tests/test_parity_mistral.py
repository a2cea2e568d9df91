"""Mistral parity with HF transformers' eager attention, on tiny random models (every parameter perturbed).

As tests/test_parity_llama.py: logits, the embedding, every block's resid_post and ln_final's output
at real positions, within `rel` of the HF tensor's max magnitude. The window (16 or 1) is shorter
than the long inputs (67 tokens), so the sliding mask is exercised, with and without padding.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attention_parity
from attention_parity import build_hf, compare, config_matches, key_map_matches
from hooked.models.mistral import Mistral
from loaders.load import from_hf
from loaders.mistral import ARCHITECTURE, config_from_hf

VOCAB = 101
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0, sliding_window=16)
CONFIGS = {  # name -> MistralConfig overrides
    "gqa_2": dict(num_key_value_heads=2),
    "mha": dict(num_key_value_heads=4),
    "mqa_3_layers": dict(num_key_value_heads=1, num_hidden_layers=3),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "window_1": dict(num_key_value_heads=2, sliding_window=1),  # each token reads only itself
    "no_window": dict(num_key_value_heads=2, sliding_window=None),
    "head_dim_24_theta": dict(num_key_value_heads=2, head_dim=24, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
}
INPUTS = {  # name -> (real lengths per row, padding side)
    "len1": ([1, 1], "left"),
    "len67": ([67], "left"),
    "left_pad": ([67, 40, 1], "left"),
    "right_pad": ([23, 67], "right"),
}


def make_hf(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    return build_hf(transformers.MistralConfig(**{**BASE, **CONFIGS[name]}), transformers.MistralForCausalLM,
                    dtype, device)


def make_batch(lengths, side, device="cpu"):
    return attention_parity.make_batch(lengths, side, VOCAB, 1, device)


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_cpu_float32(name: str, inputs: str, assert_rel_close) -> None:
    hf = make_hf(name)
    model = from_hf(hf)
    assert isinstance(model, Mistral)
    tokens, mask = make_batch(*INPUTS[inputs])
    compare(hf, hf.model.layers, model, tokens, mask, 1e-4, assert_rel_close)


@pytest.mark.parametrize("dtype, rel, inputs", [(torch.float64, 1e-4, ["len67"]),
                                                 (torch.bfloat16, 2e-2, ["len67", "right_pad", "left_pad"])])
@pytest.mark.parametrize("name", ["gqa_2", "tied"])
def test_parity_cpu_other_dtypes(name: str, dtype: torch.dtype, rel: float, inputs: list[str], assert_rel_close) -> None:
    """float64 and bf16 on the CPU. No padding in float64: HF's float32 softmax turns its float64
    mask into -inf, so a query that sees no key (a left-padding query; with a window, a right-padding
    query past the window) is NaN in HF, and the NaN reaches real rows through 0 * NaN in the next
    layer (see test_parity_llama). Ours stays finite: test_parity_llama checks padded rows there."""
    hf = make_hf(name, dtype=dtype)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {dtype}
    for inputs in inputs:
        compare(hf, hf.model.layers, model, *make_batch(*INPUTS[inputs]), rel, assert_rel_close)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["gqa_2", "tied", "window_1"])
def test_parity_gpu(name: str, dtype: torch.dtype, rel: float, cuda: torch.device, assert_rel_close) -> None:
    hf = make_hf(name, dtype=dtype, device=cuda)
    model = from_hf(hf)
    assert next(model.parameters()).device.type == "cuda"
    for inputs in ("len67", "left_pad"):
        compare(hf, hf.model.layers, model, *make_batch(*INPUTS[inputs], device=cuda), rel, assert_rel_close)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_key_map(name: str) -> None:
    hf = make_hf(name)
    cfg = config_from_hf(hf.config.to_dict())
    config_matches(cfg, hf.config)
    assert cfg.sliding_window == hf.config.sliding_window
    model = Mistral(cfg)
    assert [b.attn.window for b in model.blocks] == [hf.config.sliding_window] * cfg.n_layers
    key_map_matches(ARCHITECTURE, cfg, model, hf)


def test_window_is_in_the_pattern() -> None:
    """hook_pattern is zero for keys W or more tokens back, and each row still sums to one."""
    model = from_hf(make_hf("gqa_2"))
    tokens, _ = make_batch([40], "left")
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    q, k = torch.arange(40)[:, None], torch.arange(40)[None]
    outside = (k <= q - 16) | (k > q)
    for l in range(model.cfg.n_layers):
        pattern = cache["pattern", l]
        assert (pattern[..., outside] == 0).all() and (pattern[..., ~outside] > 0).all()
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


def test_ministral_layer_types_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="Ministral"):
        config_from_hf({**BASE, "num_key_value_heads": 2, "layer_types": ["sliding_attention", "full_attention"]})
