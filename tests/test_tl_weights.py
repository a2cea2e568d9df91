"""Weights under TL's names, FactoredMatrix and weight processing, against TL 3.9 on the same weights."""

from __future__ import annotations

import pytest
import torch

from hooked.factored_matrix import FactoredMatrix
from hooked.models.mamba import MambaConfig
from hooked.models.mamba2 import Mamba2Config
from hooked.models.zamba2 import Zamba2Config
from hooked.processing import process_weights
from hooked.models.families import build
from loaders.load import from_hf
from tests.tl_oracle import pair, tl_model

ARCHS = ["gpt2", "llama_gqa"]
NAMES = ["W_E", "W_U", "b_U", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out", "b_in", "b_out"]
EXTRA = {"gpt2": ["W_pos", "W_E_pos"], "llama_gqa": ["W_gate"]}
PROCESSING = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    ours, theirs, tok, hf = pair(request.param)
    return request.param, ours, theirs, tok, hf


def test_unprocessed_weights_equal_tls_and_are_views(models) -> None:
    arch, ours, theirs, _, _ = models
    for name in NAMES + EXTRA[arch]:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape and torch.equal(a, b), name
    if arch == "llama_gqa":  # GQA as TL does it: kv heads under _W_K / _W_V
        for name in ("_W_K", "_W_V", "_b_K", "_b_V"):
            for l, block in enumerate(theirs.blocks):
                assert torch.equal(getattr(ours.blocks[l].attn, name), getattr(block.attn, name)), name
    attn, mlp = ours.blocks[1].attn, ours.blocks[1].mlp
    for view, param in [(attn.W_Q, attn.q_proj.weight), (attn.W_O, attn.o_proj.weight), (mlp.W_out, mlp.down_proj.weight),
                        (ours.W_U, ours.unembed.weight), (attn._W_K, attn.k_proj.weight)]:
        assert view.data_ptr() == param.data_ptr()  # shares memory with the parameter


def test_factored_matrix_matches_tls(models) -> None:
    _, ours, theirs, _, _ = models
    for which in ("OV", "QK"):
        a, b = getattr(ours, which), getattr(theirs, which)
        assert isinstance(a, FactoredMatrix) and a.shape == b.shape
        assert rel_err(a.AB, b.AB) < 1e-6 and rel_err(a.BA, b.BA) < 1e-6
        assert rel_err(a.S, b.S) < 1e-5 and rel_err(a.norm(), b.norm()) < 1e-5
        U, S, V = a.svd()
        assert rel_err(U @ torch.diag_embed(S) @ V.transpose(-2, -1), a.AB) < 1e-5
        assert rel_err(a.eigenvalues.abs(), b.eigenvalues.abs()) < 1e-4
        for index in [(1,), (1, 2), (1, 2, slice(0, 5)), (0, -1, slice(None), 3)]:
            assert rel_err(a[index].AB, b[index].AB) < 1e-6, index
        vec = torch.randn(a.shape[-1])
        assert rel_err(a @ vec, a.AB @ vec) < 1e-5 and rel_err((vec @ a.T), a.AB @ vec) < 1e-5


def test_processed_weights_and_logits_equal_tls_from_pretrained_defaults(models) -> None:
    arch, ours, _, tok, hf = models
    processed = from_hf(hf, **PROCESSING)
    theirs = tl_model(arch, hf, tok, **PROCESSING)
    for name in NAMES + EXTRA[arch]:
        assert rel_err(getattr(processed, name), getattr(theirs, name)) < 1e-5, name
    tokens = torch.randint(4, 48, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, plain = processed(tokens), theirs(tokens), ours(tokens)
    assert rel_err(a, b) < 1e-5
    assert rel_err(a.log_softmax(-1), plain.log_softmax(-1)) < 1e-5  # centering shifts logits only
    with torch.no_grad():
        assert rel_err(processed(tokens, return_type="loss"), theirs(tokens, return_type="loss")) < 1e-5
        per_token = ours(tokens, return_type="loss", loss_per_token=True)
        assert rel_err(per_token, theirs(tokens, return_type="loss", loss_per_token=True)) < 1e-5


SSMS = {
    "mamba": lambda: build(MambaConfig(n_layers=2, d_model=16, d_vocab=50)),
    "mamba2": lambda: build(Mamba2Config(n_layers=2, d_model=16, n_heads=4, d_head=8, d_state=8,
                                                n_groups=2, chunk_size=8, d_vocab=50)),
    "zamba2": lambda: build(Zamba2Config(n_layers=3, layer_types=("mamba", "hybrid", "mamba"), d_model=16,
                                                d_vocab=50, n_heads=4, d_state=8, n_groups=2, chunk_size=8,
                                                n_attn_heads=4, d_mlp=24)),
}


@pytest.mark.parametrize("arch", list(SSMS))
def test_ssm_processing_keeps_log_probs_and_head_slices_reproduce_head_out(arch) -> None:
    torch.manual_seed(0)
    model = SSMS[arch]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim == 1:  # norm weights away from 1
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_gated", "hook_head_out")))
        before = model(tokens).log_softmax(-1)
    mixers = [b.mixer for b in model.blocks]
    for l, mixer in enumerate(mixers):
        d_head = mixer.W_out_heads.shape[1]
        gated = cache[f"blocks.{l}.mixer.hook_gated"].unflatten(-1, (-1, d_head))
        per_head = torch.einsum("blhp,hpm->blhm", gated, mixer.W_out_heads)
        torch.testing.assert_close(per_head, cache[f"blocks.{l}.mixer.hook_head_out"], rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="center_writing_weights skipped"):
        process_weights(model)
    with torch.no_grad():
        after = model(tokens).log_softmax(-1)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=2e-5)
    assert all(torch.equal(b.ln1.weight, torch.ones_like(b.ln1.weight)) for b in model.blocks)


def test_processing_is_opt_in_and_names_unknown_keywords(models) -> None:
    _, ours, _, _, hf = models
    plain = from_hf(hf)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ours.state_dict().values()))
    with pytest.raises(TypeError, match="fold_lnn"):
        from_hf(hf, fold_lnn=True)


def test_unknown_processing_keyword_refused_before_anything_is_read(tmp_path):
    import pytest

    from loaders import from_pretrained

    with pytest.raises(TypeError, match="unknown keyword.*fold_layernorm"):
        from_pretrained(tmp_path / "nothing-here", fold_layernorm=True)  # the path is never looked at
