"""HookedMamba2 against Hugging Face's Mamba2ForCausalLM (torch path): logits and every residual.

Tiny random HF models (every parameter perturbed, so a weight loaded into the wrong place shows)
with HF's own chunk_size; tolerance 1e-4 relative to the reference tensor's max magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from loaders.load import from_hf
from loaders.mamba2 import config_from_hf, key_map

RTOL = 1e-4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# name: (HF Mamba2Config overrides, sequence length)
CASES = {
    "g1_p8_untied": (dict(n_groups=1, head_dim=8, num_heads=4), 13),
    "g2_p8_tied": (dict(n_groups=2, head_dim=8, num_heads=4, tie_word_embeddings=True), 13),
    "g1_p16_tied": (dict(n_groups=1, head_dim=16, num_heads=2, tie_word_embeddings=True), 21),
    "g2_p16_untied": (dict(n_groups=2, head_dim=16, num_heads=4, expand=4), 21),
    "len_1": (dict(n_groups=2, head_dim=8, num_heads=4), 1),
    "len_chunk_multiple": (dict(n_groups=1, head_dim=8, num_heads=4), 16),
    "len_under_chunk": (dict(n_groups=2, head_dim=8, num_heads=4), 5),
    "biases_no_conv_bias": (dict(n_groups=2, head_dim=8, num_heads=4, use_bias=True, use_conv_bias=False), 11),
    "dt_clamped": (dict(n_groups=1, head_dim=8, num_heads=4, time_step_limit=(0.002, 0.01)), 17),
    "d_state_16_chunk_4": (dict(n_groups=2, head_dim=8, num_heads=4, state_size=16, chunk_size=4), 10),
}


def make_hf(seed: int = 0, **overrides) -> transformers.Mamba2ForCausalLM:
    torch.manual_seed(seed)
    kw = dict(hidden_size=16, num_heads=4, head_dim=8, expand=2, state_size=8, n_groups=1, num_hidden_layers=3,
              vocab_size=61, chunk_size=8, conv_kernel=4, tie_word_embeddings=False)
    kw.update(overrides)
    hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = RTOL) -> None:
    torch.testing.assert_close(ours, ref, rtol=0, atol=rel * ref.abs().max().item(), msg=lambda m: f"{what}: {m}")


def check_against_hf(hf, model, tokens, attention_mask=None, rel: float = RTOL) -> None:
    with torch.no_grad():
        out = hf(tokens, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(tokens, attention_mask=attention_mask,
                                             names_filter=lambda n: "resid_post" in n or n.startswith("ln_final"))
    n = model.cfg.n_layers
    assert len(out.hidden_states) == n + 1  # each layer's output, then the final norm's
    for layer in range(n):
        assert_rel_close(cache[f"blocks.{layer}.hook_resid_post"], out.hidden_states[layer], f"resid {layer}", rel)
    assert_rel_close(cache["ln_final.hook_normalized"], out.hidden_states[n], "ln_final", rel)
    assert_rel_close(logits.float(), out.logits.float(), "logits", rel)


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, seq_len = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    assert model.cfg.chunk_size == hf.config.chunk_size
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


def left_padded(lengths: list[int], width: int, vocab: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        tokens[b, : width - n] = 0  # pad id: whatever it is must not matter
    return tokens, mask


@pytest.mark.parametrize("n_groups,head_dim", [(1, 8), (2, 16)])
def test_parity_left_padding(n_groups, head_dim):
    hf = make_hf(n_groups=n_groups, head_dim=head_dim, num_heads=32 // head_dim)
    model = from_hf(hf)
    tokens, mask = left_padded([19, 11, 1, 8], 19, hf.config.vocab_size)
    check_against_hf(hf, model, tokens, mask)


@pytest.mark.parametrize("use_bias", [False, True])
def test_left_padded_row_equals_prompt_alone(use_bias):
    """Padding enters as zeros, so the state is still zero at the first real token."""
    model = from_hf(make_hf(n_groups=2, use_bias=use_bias))
    lengths = [17, 9, 4, 1]
    tokens, mask = left_padded(lengths, 17, model.cfg.d_vocab)
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask)
        for b, n in enumerate(lengths):
            alone = model(tokens[b:b + 1, 17 - n:])
            assert_rel_close(batched[b:b + 1, 17 - n:], alone, f"row {b}", rel=1e-5)


@pytest.mark.parametrize("layout", ["hf", "state_spaces"])
@pytest.mark.parametrize("tied", [False, True])
def test_from_pretrained_directory(tmp_path, layout, tied):
    """A saved checkpoint loads through the full loader; the original state-spaces checkpoints name
    the embedding `backbone.embedding.weight` (HF renames it on load), and so must we."""
    from safetensors.torch import load_file, save_file

    from loaders.load import from_pretrained

    hf = make_hf(n_groups=2, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    if layout == "state_spaces":
        state = load_file(tmp_path / "model.safetensors")
        state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in state.items()}
        assert "backbone.embedding.weight" in state
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = from_pretrained(tmp_path)
    assert set(key_map(model.cfg)) == {n for n, _ in model.named_parameters()}
    assert model.cfg.tied == tied
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    check_against_hf(hf, model, tokens)


def test_config_mapping():
    hf = make_hf(n_groups=2, head_dim=8, num_heads=8, expand=4, time_step_limit=(0.01, 2.0))
    cfg = config_from_hf(hf.config.to_dict())
    assert (cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_inner) == (16, 8, 8, 64)
    assert (cfg.n_groups, cfg.d_state, cfg.chunk_size, cfg.n_layers) == (2, 8, 8, 3)
    assert cfg.dt_limit == (0.01, 2.0) and cfg.conv_dim == 64 + 2 * 2 * 8
    assert config_from_hf(make_hf().config.to_dict()).dt_limit == (0.0, math.inf)
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**hf.config.to_dict(), "hidden_act": "gelu"})


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["g1_p8_untied", "g2_p16_untied", "len_1", "dt_clamped"])
def test_parity_gpu_float32(name):
    overrides, seq_len = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq_len), device="cuda")
    check_against_hf(hf, model, tokens)
    tokens, mask = left_padded([seq_len, max(seq_len // 2, 1)], seq_len, hf.config.vocab_size)
    check_against_hf(hf, model, tokens.cuda(), mask.cuda())


@CUDA
@pytest.mark.gpu
def test_parity_gpu_bfloat16():
    hf = make_hf(n_groups=2, head_dim=16, num_heads=4, expand=4).to("cuda", torch.bfloat16)
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 21), device="cuda")
    check_against_hf(hf, model, tokens, rel=2e-2)


def test_parity_bfloat16_cpu():
    """bf16 weights: the scan runs in float32 like HF's; HF also keeps its residual in float32
    (residual_in_fp32), ours stays bf16, hence the 2e-2 bound of DESIGN.md section 6."""
    hf = make_hf(n_groups=2, head_dim=16, num_heads=4, expand=4).to(torch.bfloat16)
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: "resid_post" in n)
    for layer in range(model.cfg.n_layers):
        ours = cache[f"blocks.{layer}.hook_resid_post"]
        assert ours.dtype == torch.bfloat16
        assert_rel_close(ours.float(), out.hidden_states[layer].float(), f"resid {layer}", 2e-2)
    assert_rel_close(logits.float(), out.logits.float(), "logits", 2e-2)
