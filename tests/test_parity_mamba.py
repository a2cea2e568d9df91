"""Mamba-1 / FalconMamba parity with HF transformers' slow path (the CPU path; no CUDA kernels).

Every case builds a tiny random HF model from a config, perturbs every parameter (HF initialises
conv biases to 0 and D to 1, which would hide bugs), loads it with `from_hf`, and compares logits
and every layer's residual within 1e-4 of the HF tensor's max magnitude (float32).
HF's hidden_states are [block 0 out, ..., block n-1 out, ln_final(last)].
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import Tensor

from hooked.models.mamba import MambaConfig
from hooked.models.families import build
from hooked.models.language_model import LanguageModel
from loaders.load import from_hf
from loaders.mamba import key_map
from loaders.registry import find_architecture

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, state_size=16, num_hidden_layers=2, pad_token_id=0)

# name -> (HF model class, HF config class, config overrides)
CASES = {
    "dt_rank_auto": ("MambaForCausalLM", "MambaConfig", dict(time_step_rank="auto")),
    "dt_rank_explicit": ("MambaForCausalLM", "MambaConfig", dict(time_step_rank=5)),
    "conv_bias_off": ("MambaForCausalLM", "MambaConfig", dict(use_conv_bias=False)),
    "d_state_4": ("MambaForCausalLM", "MambaConfig", dict(state_size=4)),
    "proj_bias_on": ("MambaForCausalLM", "MambaConfig", dict(use_bias=True)),
    "untied": ("MambaForCausalLM", "MambaConfig", dict(tie_word_embeddings=False)),
    "expand_3_conv_2": ("MambaForCausalLM", "MambaConfig", dict(expand=3, conv_kernel=2, num_hidden_layers=3)),
    "falcon": ("FalconMambaForCausalLM", "FalconMambaConfig", dict()),
    "falcon_d_state_4_untied": ("FalconMambaForCausalLM", "FalconMambaConfig",
                                dict(state_size=4, tie_word_embeddings=False, mixer_rms_eps=1e-3)),
}


def make_hf(case: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    model_cls, config_cls, overrides = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf.to(dtype)


def run_ours(model: LanguageModel, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
    names = [f"blocks.{l}.hook_resid_post" for l in range(model.cfg.n_layers)] + ["ln_final.hook_normalized"]
    logits, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    return logits, [cache[n] for n in names]


def assert_rel_close(ours: Tensor, ref: Tensor, rel: float, what: str) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=rel * scale, msg=lambda m: f"{what}: {m}")


def check_parity(hf, model: LanguageModel, tokens: Tensor, mask: Tensor | None, rel: float) -> None:
    with torch.no_grad():
        out = hf(tokens, attention_mask=mask, output_hidden_states=True)
        logits, resids = run_ours(model, tokens, mask)
    assert len(out.hidden_states) == len(resids) == model.cfg.n_layers + 1
    assert_rel_close(logits, out.logits, rel, "logits")
    for layer, (ours, ref) in enumerate(zip(resids, out.hidden_states)):
        assert_rel_close(ours, ref, rel, f"hidden state {layer}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq_len", [1, 29])
def test_parity_cpu_float32(case: str, seq_len: int) -> None:
    hf = make_hf(case)
    model = from_hf(hf)
    tokens = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    check_parity(hf, model, tokens, None, rel=1e-4)


@pytest.mark.parametrize("case", ["dt_rank_auto", "falcon", "d_state_4"])
def test_left_padding_matches_hf_and_unpadded_rows(case: str) -> None:
    hf = make_hf(case)
    model = from_hf(hf)
    lengths = [11, 4, 1, 8]
    width = max(lengths)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = r
        mask[b, width - len(r):] = 1
    check_parity(hf, model, tokens, mask, rel=1e-4)
    with torch.no_grad():
        padded, padded_resids = run_ours(model, tokens, mask)
        for b, r in enumerate(rows):
            alone, alone_resids = run_ours(model, r[None])
            real = slice(width - len(r), width)
            assert_rel_close(padded[b, real], alone[0], 1e-5, f"row {b} logits")
            for layer, (p, a) in enumerate(zip(padded_resids, alone_resids)):
                assert_rel_close(p[b, real], a[0], 1e-5, f"row {b} hidden state {layer}")


def test_right_padding_matches_hf() -> None:
    hf = make_hf("dt_rank_auto")
    model = from_hf(hf)
    tokens = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, 6:] = 0
    check_parity(hf, model, tokens, mask, rel=1e-4)


@pytest.mark.parametrize("case, expected", [
    ("dt_rank_auto", dict(dt_rank=2, d_inner=64, d_state=16, tied=True, mixer_rms_eps=None)),
    ("dt_rank_explicit", dict(dt_rank=5, conv_bias=True, proj_bias=False)),
    ("conv_bias_off", dict(conv_bias=False)),
    ("expand_3_conv_2", dict(d_inner=96, d_conv=2, n_layers=3)),
    ("falcon", dict(mixer_rms_eps=1e-6, tied=True)),
    ("falcon_d_state_4_untied", dict(mixer_rms_eps=1e-3, d_state=4, tied=False)),
])
def test_config_mapping(case: str, expected: dict) -> None:
    hf = make_hf(case)
    cfg = find_architecture(hf.config.to_dict()).config_from_hf(hf.config.to_dict())
    assert isinstance(cfg, MambaConfig)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.n_heads == cfg.d_inner and cfg.n_groups == 1


def test_original_state_spaces_embedding_key() -> None:
    """A state dict with `backbone.embedding.weight` (state-spaces layout) resolves every parameter."""
    hf = make_hf("untied")
    state = hf.state_dict()
    state["backbone.embedding.weight"] = state.pop("backbone.embeddings.weight")
    cfg = find_architecture(hf.config.to_dict()).config_from_hf(hf.config.to_dict())
    model = build(cfg)
    params = dict(model.named_parameters())
    keys = key_map(cfg)
    assert set(keys) == set(params)
    with torch.no_grad():
        for name, key in keys.items():
            src = next(n for n in key.names if n in state)
            t = key.transform(state[src]) if key.transform else state[src]
            params[name].copy_(t)
    tokens = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), from_hf(hf)(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["dt_rank_auto", "untied", "falcon"])
def test_saved_directory_loads_like_from_hf(case: str, tmp_path) -> None:
    from loaders import from_pretrained

    hf = make_hf(case)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(tokens), from_hf(hf)(tokens))
        assert_rel_close(model(tokens), hf(tokens).logits, 1e-4, "logits")


def test_state_spaces_layout_on_disk(tmp_path) -> None:
    """A safetensors file with the original `backbone.embedding.weight` name loads."""
    import json

    from safetensors.torch import save_file

    from loaders import from_pretrained

    hf = make_hf("dt_rank_auto")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["backbone.embedding.weight"] = state.pop("backbone.embeddings.weight")
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    tokens = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path)(tokens), from_hf(hf)(tokens))


def test_key_map_covers_every_parameter_exactly_once() -> None:
    for case in ("dt_rank_auto", "proj_bias_on", "conv_bias_off", "untied"):
        hf = make_hf(case)
        cfg = find_architecture(hf.config.to_dict()).config_from_hf(hf.config.to_dict())
        model = build(cfg)
        keys = key_map(cfg)
        assert set(keys) == {n for n, _ in model.named_parameters()}
        hf_names = set(hf.state_dict())
        for key in keys.values():
            assert key.names[0] in hf_names


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", ["dt_rank_auto", "falcon"])
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_parity_gpu(case: str, dtype: torch.dtype, rel: float) -> None:
    hf = make_hf(case).to(device="cuda", dtype=dtype)
    model = from_hf(hf)
    assert next(model.parameters()).dtype == dtype
    tokens = torch.randint(0, VOCAB, (2, 37), device="cuda")
    check_parity(hf, model, tokens, None, rel)
