"""Loading follows HF's from_pretrained on tied heads, and every load error names what is wrong.

Tied heads (loaders/stored_head.py): HF 5.24 ties `lm_head` to the embedding only when the checkpoint
does not store `lm_head.weight`; a stored head is used as it is, whatever `tie_word_embeddings` says.
HF's own `from_pretrained` of the same directory is the oracle, on a table of families, with and
without a stored head; `from_hf` of that HF model (its head a tensor of its own) agrees.

Load errors: an expert's tensor missing from the file, a fused tensor that does not split as the config
asks, a multimodal config without its text_config, and a base model (no LM head) given to `from_hf`: each
error names the tensor (or the class), the shape expected and found, and the file.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from delta_oracles import tiny_delta_hf
from hybrid_checks import assert_rel_close
from tiny_families import CONFIGS

from hooked import backends
from loaders import CheckpointError, from_pretrained
from loaders.load import from_hf

TOKENS = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def eager_attention():
    with backends.use(attention="eager"):
        yield


def _tied_hf(name: str):
    if name == "qwen3_5":
        return tiny_delta_hf("qwen3_5_text", tie_word_embeddings=True)[0]
    cls, config = CONFIGS[name]()
    config.tie_word_embeddings = True
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _save(hf, d, head: torch.Tensor | None) -> None:
    """save_pretrained (which leaves a tied head out), then, given `head`, a stored lm_head.weight added."""
    hf.save_pretrained(d)
    state = safetensors.torch.load_file(d / "model.safetensors")
    assert "lm_head.weight" not in state
    if head is not None:
        state["lm_head.weight"] = head
        safetensors.torch.save_file(state, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["qwen3_5", "llama", "mamba", "gpt2", "gemma2", "zamba2"])
@pytest.mark.parametrize("stored", ["other", "same", None], ids=["head_stored", "head_equal_stored", "head_left_out"])
def test_tied_config_follows_hf_from_pretrained(name, stored, tmp_path):
    hf = _tied_hf(name)
    emb = hf.get_input_embeddings().weight.detach()
    head = {"other": torch.randn(emb.shape, generator=torch.Generator().manual_seed(5)) * emb.std(),
            "same": emb.clone(), None: None}[stored]
    _save(hf, tmp_path, head)
    stored = stored == "other"  # HF ties an equal stored head
    ref = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert ref.config.tie_word_embeddings
    hf_head = ref.get_output_embeddings().weight
    assert torch.equal(hf_head, head) if stored else hf_head is ref.get_input_embeddings().weight  # HF's rule
    ours = from_pretrained(tmp_path)
    assert ours.unembed.tied == (not stored)
    with torch.no_grad():
        assert_rel_close(ours(TOKENS), ref(TOKENS).logits, "logits")
    again = from_hf(ref)  # the same HF model in memory: its head is a tensor of its own when stored
    assert again.unembed.tied == (not stored)
    with torch.no_grad():
        assert torch.equal(again(TOKENS), ours(TOKENS))


def test_stored_head_changes_the_logits(tmp_path):
    """The case above is not vacuous: tying the stored-head checkpoint would differ from HF by far more than 1e-4."""
    hf = _tied_hf("qwen3_5")
    emb = hf.get_input_embeddings().weight
    _save(hf, tmp_path, torch.randn(emb.shape, generator=torch.Generator().manual_seed(5)) * emb.std())
    ref = type(hf).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        stored, tied = ref(TOKENS).logits, hf(TOKENS).logits
    assert (stored - tied).abs().max() / tied.abs().max() > 0.1


# ------------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(HF model, its saved state in the original layout, a directory with its config)."""
    hf, _ = tiny_delta_hf("qwen3_next")
    d = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(d)
    return hf, safetensors.torch.load_file(d / "model.safetensors")


def _write(hf, state: dict, d) -> None:
    hf.config.save_pretrained(d)
    safetensors.torch.save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def test_missing_expert_tensor_is_named(qwen3_next, tmp_path):
    hf, state = qwen3_next
    gone = "model.layers.1.mlp.experts.3.gate_proj.weight"
    _write(hf, {k: v for k, v in state.items() if k != gone}, tmp_path)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(tmp_path)
    err = info.value
    assert err.missing == [gone] and err.arch == "qwen3_next"
    shape = list(state["model.layers.1.mlp.experts.0.gate_proj.weight"].shape)
    assert f"{gone} {shape}" in str(err) and str(tmp_path / "model.safetensors") in str(err)


def test_fused_tensor_that_does_not_split_is_named(qwen3_next, tmp_path):
    hf, state = qwen3_next
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    short = dict(state)
    short[name] = state[name][:-2].clone()
    _write(hf, short, tmp_path)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(tmp_path)
    msg = str(info.value)
    found, full = list(short[name].shape), list(state[name].shape)
    assert info.value.mismatched and all(m.startswith(f"{name}: {found}") for m in info.value.mismatched)
    assert "expected [" in msg and str(tmp_path / "model.safetensors") in msg and "split" in msg
    assert found != full


def test_multimodal_config_without_text_config_says_so(tmp_path):
    hf, _ = tiny_delta_hf("qwen3_5_text")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                      "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v.contiguous()
             for k, v in hf.state_dict().items()}
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        from_pretrained(tmp_path)
    first = str(info.value).splitlines()[1]
    assert "has no text_config" in first and "num_hidden_layers=32" in first and "config.json" in first
    assert "the checkpoint holds layers 0..3 (4), the config says 32" in str(info.value)
    assert len(str(info.value)) < 6000  # long lists cut, all kept on the error
    assert len(info.value.missing) > 300


def test_base_model_without_head_asks_for_the_causal_lm(qwen3_next):
    hf, _ = qwen3_next
    with pytest.raises(ValueError, match=r"Qwen3NextModel is a base model without a language-model head.*"
                                         r"transformers\.Qwen3NextForCausalLM"):
        from_hf(hf.model)


def test_unexpected_tensor_is_named_with_its_shape_and_file(qwen3_next, tmp_path):
    hf, state = qwen3_next
    _write(hf, {**state, "model.layers.0.stray.weight": torch.zeros(2, 3)}, tmp_path)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(tmp_path)
    assert info.value.unexpected == ["model.layers.0.stray.weight"] and not info.value.missing
    assert f"model.layers.0.stray.weight [2, 3] in {tmp_path / 'model.safetensors'}" in str(info.value)
