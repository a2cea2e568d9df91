"""Careless or hostile checkpoints: refused up front with the file and field named.

Each case starts from one tiny saved Llama (or GPT-2 / Mamba / Mamba-2), breaks one thing, and
expects a ValueError whose message names what is wrong; nothing is half loaded.
"""

from __future__ import annotations

import builtins
import json
import shutil
import struct

import pytest
import torch

from loaders import from_pretrained
from loaders.checks import ConfigError
from loaders.safetensors_io import CheckpointFileError, SafetensorsFile

CONFIGS = {
    "llama": lambda t: t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2),
    "gpt2": lambda t: t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "mamba": lambda t: t.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2),
    "mamba2": lambda t: t.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, num_heads=4,
                                       head_dim=16, n_groups=1, chunk_size=4, expand=2),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import transformers

    out = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(make(transformers))
        out[name] = tmp_path_factory.mktemp(name)
        hf.save_pretrained(out[name])
    return out


def copy_of(saved, arch, tmp_path):
    d = tmp_path / arch
    shutil.copytree(saved[arch], d)
    return d


def edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------------ config values
CONFIG_CASES = [  # (arch, fields, message pattern)
    ("llama", {"vocab_size": -5}, r"config field vocab_size=-5 must be >= 1"),
    ("gpt2", {"n_positions": -1}, r"config field n_positions=-1 must be >= 1"),
    ("mamba", {"state_size": -3}, r"config field state_size=-3 must be >= 1"),
    ("llama", {"num_attention_heads": 0}, r"config field num_attention_heads=0 must be >= 1"),
    ("llama", {"dtype": "int8"}, r"config field dtype=torch.int8: parameters must be floating point"),
    ("llama", {"dtype": "float99"}, r"config field dtype='float99' is not a torch dtype"),
    ("mamba2", {"chunk_size": 0}, r"config field chunk_size=0 must be >= 1"),
    ("llama", {"num_hidden_layers": 2.5}, r"num_hidden_layers=2.5 must be an integer"),
    ("llama", {"hidden_size": "32"}, r"hidden_size='32' must be an integer"),
    ("llama", {"num_hidden_layers": True}, r"num_hidden_layers=True must be an integer"),
    ("llama", {"rms_norm_eps": -1.0}, r"rms_norm_eps=-1.0 must be a finite number > 0"),
    ("llama", {"num_key_value_heads": 3}, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
    ("gpt2", {"n_head": 5}, r"d_model \(32\) must be a multiple of n_heads \(5\)"),
    ("mamba2", {"num_heads": 3}, r"num_heads \* head_dim"),
]


@pytest.mark.parametrize("arch, fields, message", CONFIG_CASES, ids=[f"{a}-{next(iter(f))}={next(iter(f.values()))}"
                                                                     for a, f, _ in CONFIG_CASES])
def test_bad_config_value_named(saved, tmp_path, arch, fields, message):
    d = copy_of(saved, arch, tmp_path)
    edit_config(d, **fields)
    with pytest.raises(ConfigError, match=message) as info:
        from_pretrained(d)
    assert str(d) in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", r"config.json: a config must be a JSON object, got a list"),
    ("{bad", r"config.json: config is not valid JSON"),
    ("\udcff".encode("utf-8", "surrogatepass").decode("latin-1"), r"config.json: config is not"),
])
def test_config_file_not_an_object_named(saved, tmp_path, text, message):
    d = copy_of(saved, "llama", tmp_path)
    (d / "config.json").write_text(text, encoding="latin-1")
    with pytest.raises(ConfigError, match=message):
        from_pretrained(d)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_non_float_dtype_argument_refused(saved, dtype):
    with pytest.raises(ConfigError, match="dtype"):
        from_pretrained(saved["llama"], dtype=dtype)


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_empty_or_none_model_name(name):
    with pytest.raises(ValueError, match="a model name must be a non-empty path"):
        from_pretrained(name)


# ------------------------------------------------------------------------------ shards
def _shard(d, target, saved):
    """An index whose weight_map sends every tensor to `target` (the single file was moved there)."""
    names = list(SafetensorsFile(saved["llama"] / "model.safetensors").tensors)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: target for n in names}}))


@pytest.mark.parametrize("target", ["../elsewhere/model.safetensors", "sub/../../elsewhere/model.safetensors",
                                    "ABSOLUTE", "..\\elsewhere\\model.safetensors"])
def test_shard_outside_checkpoint_refused(saved, tmp_path, target):
    d = copy_of(saved, "llama", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(d / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
    target = str(tmp_path / "elsewhere" / "model.safetensors") if target == "ABSOLUTE" else target
    _shard(d, target, saved)
    with pytest.raises(ConfigError, match="leaves the checkpoint directory"):
        from_pretrained(d)


def test_pickle_shard_outside_checkpoint_refused(saved, tmp_path):
    d = copy_of(saved, "llama", tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "../x.bin"}}))
    with pytest.raises(ConfigError, match="leaves the checkpoint directory"):
        from_pretrained(d, allow_pickle=True)


@pytest.mark.parametrize("index, message", [
    ({"weight_map": ["model.safetensors"]}, "'weight_map' must map tensor names to shard files, got a list"),
    ({"weight_map": {"a": 3}}, "'weight_map' values must be shard file names"),
    ([1], "expected a JSON object with a 'weight_map'"),
    ("{oops", "safetensors index is not valid JSON"),
])
def test_bad_index_named(saved, tmp_path, index, message):
    d = copy_of(saved, "llama", tmp_path)
    text = index if isinstance(index, str) else json.dumps(index)
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        from_pretrained(d)
    assert "model.safetensors.index.json" in str(info.value)


def test_shard_in_a_subdirectory_loads(saved, tmp_path):
    d = copy_of(saved, "llama", tmp_path)
    (d / "shards").mkdir()
    shutil.move(d / "model.safetensors", d / "shards" / "model.safetensors")
    _shard(d, "shards/model.safetensors", saved)
    reference = from_pretrained(saved["llama"])
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(from_pretrained(d)(tokens), reference(tokens))


# --------------------------------------------------------------- safetensors headers
def write_safetensors(path, header, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def F32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


HEADER_CASES = {  # name -> (header, data length, message)
    "overlap": ({"a": F32([2], 0, 8), "b": F32([2], 0, 8)}, 8, r"tensors 'a' and 'b' overlap"),
    "partial overlap": ({"a": F32([2], 0, 8), "b": F32([2], 4, 12)}, 12, r"tensors 'a' and 'b' overlap"),
    "gap": ({"a": F32([1], 0, 4), "b": F32([1], 8, 12)}, 12, r"a gap of 4 bytes before tensor 'b'"),
    "not at 0": ({"a": F32([1], 4, 8)}, 8, r"a gap of 4 bytes before tensor 'a'"),
    "trailing bytes": ({"a": F32([1], 0, 4)}, 8, r"4 bytes after the last tensor"),
    "truncated": ({"a": F32([4], 0, 16)}, 8, r"truncated safetensors file"),
    "size mismatch": ({"a": F32([3], 0, 8)}, 8, r"needs 12 bytes"),
    "negative shape": ({"a": F32([-2], 0, 8)}, 8, r"shape \[-2\] is not a list of non-negative integers"),
    "float shape": ({"a": F32([2.0], 0, 8)}, 8, r"shape \[2.0\] is not a list"),
    "reversed offsets": ({"a": F32([2], 8, 0)}, 8, r"offsets \[8, 0\)"),
    "three offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, 8, r"is not \[begin, end\]"),
    "unknown dtype": ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, 8, r"dtype 'Q4'"),
    "entry not an object": ({"a": [1, 2]}, 0, r"corrupt header entry for 'a'"),
    "metadata not strings": ({"__metadata__": {"x": 1}, "a": F32([1], 0, 4)}, 4, r"__metadata__ must map strings"),
    "header a list": ([1, 2], 0, r"expected a JSON object"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_safetensors_header_checked_like_the_library(tmp_path, case):
    header, n, message = HEADER_CASES[case]
    path = tmp_path / "x.safetensors"
    write_safetensors(path, header, bytes(n))
    with pytest.raises(CheckpointFileError, match=message) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)
    safetensors = pytest.importorskip("safetensors")
    if case not in ("metadata not strings",):  # the library agrees that the file is bad
        with pytest.raises(Exception):
            with safetensors.safe_open(str(path), "pt") as f:
                [f.get_tensor(k) for k in f.keys()]


def test_duplicate_tensor_name_refused(tmp_path):
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
          b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(CheckpointFileError, match=r"name 'a' appears twice"):
        SafetensorsFile(path)


def test_valid_file_with_empty_tensor_reads(tmp_path):
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, {"e": F32([0, 3], 0, 0), "a": F32([2], 0, 8)}, struct.pack("<2f", 1.5, -2.0))
    f = SafetensorsFile(path)
    assert f.read("a").tolist() == [1.5, -2.0] and f.read("e").shape == (0, 3)


# ---------------------------------------------------------------------------- GGUF
def test_gguf_missing_block_count_names_the_key(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf import write_tiny

    from loaders.gguf import GGUFError

    path = tmp_path / "no_blocks.gguf"

    def drop_block_count(writer):
        writer.add_block_count = lambda n: None

    write_tiny(path, metadata=drop_block_count)
    with pytest.raises(GGUFError, match=r"no_blocks\.gguf: metadata llama\.block_count is missing"):
        from_pretrained(path)


# --------------------------------------------------------------------- tokenizer remote code
def test_tokenizer_auto_map_neither_asks_nor_runs(saved, tmp_path, monkeypatch):
    d = copy_of(saved, "llama", tmp_path)
    marker = tmp_path / "RAN"
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import PreTrainedTokenizer\n"
                               "class EvilTokenizer(PreTrainedTokenizer):\n    pass\n")
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "y")
    with pytest.raises(ValueError, match="trust_remote_code"):
        from_pretrained(d)
    assert not asked, "transformers asked on stdin"
    assert not marker.exists(), "the checkpoint's code ran"
