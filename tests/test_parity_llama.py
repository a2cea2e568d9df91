"""Llama parity with HF transformers' eager attention, on tiny random models (every parameter perturbed).

Compared: logits, the embedding (resid_pre of block 0), every block's resid_post (HF: forward hooks
on `model.layers`), and ln_final's output (HF's last hidden state is after the final norm), at real
(non-padding) positions only, within `rel` times the HF tensor's max magnitude. HF gets the
position ids we use (counted over real tokens), so left padding does not shift its rotary angles.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import Tensor

from hooked.models.llama import LlamaConfig
from hooked.ops.rotary import Rotary, rope_inv_freq
from loaders.keymaps import rope_from_hf
from loaders.llama import config_from_hf, key_map
from loaders.load import from_hf

import attention_parity
from hooked.models.families import build
from attention_parity import compare

VOCAB = 101
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16, rope_theta=10000.0)

CONFIGS = {  # name -> LlamaConfig overrides
    "mha": dict(num_key_value_heads=4),
    "gqa_2": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=2, rope_parameters=LLAMA3),
    "linear_rope": dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=500.0)),
    "bias": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "head_dim_24": dict(num_key_value_heads=2, head_dim=24),
    "gelu_tanh_3_layers": dict(hidden_act="gelu_pytorch_tanh", num_hidden_layers=3, num_key_value_heads=1),
}
INPUTS = {  # name -> (real lengths per row, padding side)
    "len1": ([1, 1], "left"),
    "len67": ([67], "left"),
    "left_pad": ([67, 40, 1], "left"),
    "right_pad": ([23, 67], "right"),
}


@pytest.fixture
def make_hf(tiny_hf):
    def make(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """The HF model in `dtype`, its rotary frequencies kept in float32 as `from_pretrained(dtype=)`
        keeps them (`.to(dtype)` would round them to bf16 and move every angle)."""
        config = transformers.LlamaConfig(**{**BASE, **CONFIGS[name]})
        hf = tiny_hf(config, transformers.LlamaForCausalLM, perturb=0.1)
        rotary = hf.model.rotary_emb
        fp32 = {n: b.clone() for n, b in rotary.named_buffers()}
        hf = hf.to(device=device, dtype=dtype)
        for n, b in fp32.items():
            setattr(rotary, n, b.to(device))
        return hf

    return make


def make_batch(lengths: list[int], side: str, seed: int = 1, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
    return attention_parity.make_batch(lengths, side, VOCAB, seed, device)


@pytest.fixture
def check_parity(assert_rel_close):
    def check(hf, model, tokens: Tensor, mask: Tensor, rel: float) -> None:
        compare(hf, hf.model.layers, model, tokens, mask, rel, assert_rel_close)

    return check


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_cpu_float32(name: str, inputs: str, make_hf, check_parity) -> None:
    hf = make_hf(name)
    model = from_hf(hf)
    tokens, mask = make_batch(*INPUTS[inputs])
    check_parity(hf, model, tokens, mask, rel=1e-4)


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("inputs", ["left_pad", "right_pad"])
@pytest.mark.parametrize("name", ["gqa_2", "llama3_rope", "bias"])
def test_padded_rows_equal_prompt_alone(name: str, inputs: str, dtype: torch.dtype, rel: float, make_hf,
                                        assert_rel_close) -> None:
    model = from_hf(make_hf(name, dtype=dtype))
    tokens, mask = make_batch(*INPUTS[inputs])
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask)
        assert not batched.isnan().any()  # padding queries see no key: uniform pattern, not NaN
        for b in range(tokens.shape[0]):
            real = mask[b].bool()
            alone = model(tokens[b, real][None])
            assert_rel_close(batched[b, real], alone[0], rel, f"row {b}")


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["gqa_2", "llama3_rope", "tied"])
def test_parity_cpu_other_dtypes(name: str, dtype: torch.dtype, rel: float, make_hf, check_parity) -> None:
    """float64 end to end; bf16 on the CPU. HF's float64 Llama computes its RMSNorm statistic and its
    eager softmax in float32, ours stays in float64, so the two agree to HF's float32 accuracy (1e-4,
    the float32 target; measured ~1e-5). Our own float64 consistency is tested in the float64 tests.

    Right padding only: in float64 HF's float32 softmax turns its finfo(float64).min mask into -inf,
    so a left-padded row is NaN throughout in HF (ours is checked against the prompt alone above).
    """
    hf = make_hf(name, dtype=dtype)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {dtype}
    for inputs in ("len67", "right_pad"):
        tokens, mask = make_batch(*INPUTS[inputs])
        check_parity(hf, model, tokens, mask, rel=rel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["gqa_2", "mqa", "llama3_rope", "bias", "tied"])
def test_parity_gpu(name: str, dtype: torch.dtype, rel: float, cuda: torch.device, make_hf, check_parity) -> None:
    hf = make_hf(name, dtype=dtype, device=cuda)
    model = from_hf(hf)
    assert next(model.parameters()).device.type == "cuda"
    for inputs in ("len67", "left_pad"):
        tokens, mask = make_batch(*INPUTS[inputs], device=cuda)
        check_parity(hf, model, tokens, mask, rel=rel)


# ----------------------------------------------------------------------------- config and rope
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_inv_freq_equals_hf(name: str, make_hf) -> None:
    hf = make_hf(name)
    cfg = from_hf(hf).cfg
    ours = rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_key_map(name: str, make_hf) -> None:
    hf = make_hf(name)
    hc = hf.config
    cfg = config_from_hf(hc.to_dict())
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == (
        hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads, head_dim,
        hc.intermediate_size, hc.vocab_size)
    assert (cfg.tied, cfg.attention_bias, cfg.mlp_bias, cfg.act_fn) == (
        hc.tie_word_embeddings, hc.attention_bias, hc.mlp_bias, hc.hidden_act)
    model = build(cfg)
    assert set(key_map(cfg)) == {n for n, _ in model.named_parameters()}
    hf_names = set(hf.state_dict())
    assert all(any(k in hf_names for k in key.names) for key in key_map(cfg).values())


def test_tied_embedding_is_one_parameter_after_loading(make_hf) -> None:
    model = from_hf(make_hf("tied"))
    assert model.unembed.weight is model.embed.weight
    assert "unembed.weight" not in dict(model.named_parameters())
    untied = from_hf(make_hf("gqa_2"))
    assert untied.unembed.weight is not untied.embed.weight


@pytest.mark.parametrize("hf_config, theta, scaling", [
    ({"rope_theta": 500000.0}, 500000.0, None),
    ({"rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, 5.0, {"rope_type": "linear", "factor": 2.0}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}, 7.0, None),
    ({"rope_parameters": LLAMA3}, 10000.0, {k: v for k, v in LLAMA3.items() if k != "rope_theta"}),
])
def test_rope_config_spellings(hf_config: dict, theta: float, scaling: dict | None) -> None:
    assert rope_from_hf(hf_config) == (theta, scaling)


def test_unsupported_rope_type_raises() -> None:
    with pytest.raises(NotImplementedError, match="longrope"):
        Rotary.of(16, 10000.0, {"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        Rotary.of(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        build(LlamaConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=8, d_vocab=10,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
