"""GPT-2 parity with HF transformers' eager attention, on tiny random models (every parameter perturbed).

Compared: logits, the embedding (resid_pre of block 0), every block's resid_post (HF: forward hooks
on `transformer.h`), and ln_final's output (HF's last hidden state is after the final norm), at real
(non-padding) positions only, within `rel` times the HF tensor's max magnitude. HF gets the
position ids we use (counted over real tokens), so left padding does not shift its position
embeddings.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import Tensor

from loaders.gpt2 import config_from_hf, key_map
from loaders.load import from_hf

import attention_parity
from hooked.models.families import build
from attention_parity import compare

VOCAB = 101
BASE = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=80, bos_token_id=1, eos_token_id=1)

CONFIGS = {  # name -> GPT2Config overrides
    "tied": dict(),
    "untied": dict(tie_word_embeddings=False),
    "gelu_exact_n_inner": dict(activation_function="gelu", n_inner=96),
    "gelu_tanh_3_layers": dict(activation_function="gelu_pytorch_tanh", n_layer=3),
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "unscaled": dict(scale_attn_weights=False),
}
INPUTS = {  # name -> (real lengths per row, padding side)
    "len1": ([1, 1], "left"),
    "len67": ([67], "left"),
    "left_pad": ([67, 40, 1], "left"),
    "right_pad": ([23, 67], "right"),
}


@pytest.fixture
def make_hf(tiny_hf):
    def make(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             model_cls=transformers.GPT2LMHeadModel):
        config = transformers.GPT2Config(**{**BASE, **CONFIGS[name]})
        return tiny_hf(config, model_cls, perturb=0.1, dtype=dtype, device=device)

    return make


def make_batch(lengths: list[int], side: str, seed: int = 1, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
    return attention_parity.make_batch(lengths, side, VOCAB, seed, device)


@pytest.fixture
def check_parity(assert_rel_close):
    def check(hf, model, tokens: Tensor, mask: Tensor, rel: float) -> None:
        compare(hf, hf.transformer.h, model, tokens, mask, rel, assert_rel_close)

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
@pytest.mark.parametrize("name", ["tied", "inverse_layer_idx"])
def test_padded_rows_equal_prompt_alone(name: str, inputs: str, dtype: torch.dtype, rel: float, make_hf,
                                        assert_rel_close) -> None:
    model = from_hf(make_hf(name, dtype=dtype))
    tokens, mask = make_batch(*INPUTS[inputs])
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask)
        assert not batched.isnan().any()
        for b in range(tokens.shape[0]):
            real = mask[b].bool()
            alone = model(tokens[b, real][None])
            assert_rel_close(batched[b, real], alone[0], rel, f"row {b}")


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-10), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_parity_cpu_other_dtypes(name: str, dtype: torch.dtype, rel: float, make_hf, check_parity) -> None:
    """float64 end to end; bf16 on the CPU (HF GPT-2's softmax is bf16, ours float32)."""
    hf = make_hf(name, dtype=dtype)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {dtype}
    for inputs in ("len67", "left_pad"):
        tokens, mask = make_batch(*INPUTS[inputs])
        check_parity(hf, model, tokens, mask, rel=rel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["tied", "untied", "inverse_layer_idx"])
def test_parity_gpu(name: str, dtype: torch.dtype, rel: float, cuda: torch.device, make_hf, check_parity) -> None:
    hf = make_hf(name, dtype=dtype, device=cuda)
    model = from_hf(hf)
    assert next(model.parameters()).device.type == "cuda"
    for inputs in ("len67", "left_pad"):
        tokens, mask = make_batch(*INPUTS[inputs], device=cuda)
        check_parity(hf, model, tokens, mask, rel=rel)


# --------------------------------------------------------------------------- config and keys
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_key_map(name: str, make_hf) -> None:
    hf = make_hf(name)
    hc = hf.config
    cfg = config_from_hf(hc.to_dict())
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_mlp, cfg.d_vocab, cfg.n_ctx) == (
        hc.n_layer, hc.n_embd, hc.n_head, hc.n_inner or 4 * hc.n_embd, hc.vocab_size, hc.n_positions)
    assert (cfg.act_fn, cfg.eps, cfg.tied) == (hc.activation_function, hc.layer_norm_epsilon,
                                                              hc.tie_word_embeddings)
    model = build(cfg)
    assert set(key_map(cfg)) == {n for n, _ in model.named_parameters()}
    hf_names = set(hf.state_dict())
    assert all(any(k in hf_names for k in key.names) for key in key_map(cfg).values())


def test_bare_gpt2_model_keys_without_prefix(make_hf, assert_rel_close) -> None:
    """The original "gpt2" hub files are a GPT2Model: keys `h.0...`, no lm_head (tied)."""
    hf = make_hf("tied", model_cls=transformers.GPT2Model)
    assert not any(k.startswith("transformer.") for k in hf.state_dict())
    model = from_hf(hf)
    tokens, mask = make_batch(*INPUTS["len67"])
    with torch.no_grad():
        expected = hf(tokens).last_hidden_state @ hf.wte.weight.T
        assert_rel_close(model(tokens), expected, 1e-4, "logits")


def test_tied_embedding_is_one_parameter_after_loading(make_hf) -> None:
    model = from_hf(make_hf("tied"))
    assert model.unembed.weight is model.embed.weight
    assert "unembed.weight" not in dict(model.named_parameters())
    untied = from_hf(make_hf("untied"))
    assert untied.unembed.weight is not untied.embed.weight


def test_sequence_longer_than_n_ctx_raises(make_hf) -> None:
    model = from_hf(make_hf("tied"))
    with pytest.raises(ValueError, match="n_ctx=80"):
        model(torch.ones(1, 81, dtype=torch.long))
