"""from_pretrained(..., mmap=True): file-backed parameters, equal to a copying load, private to the process.

Glossary
    file-backed  a parameter whose first byte lies in a memory mapping of one of the checkpoint's
                 files, as /proc/self/maps lists it (the test's own oracle; Linux only)
    copying load `from_pretrained(d, mmap=False)`, the default: every tensor read into fresh memory
    convertible  stored in the load's dtype, with a Key that has no transform or one whose result on a
                 real tensor shares its storage and is contiguous: the parameters `mmap=True` maps

Checked: for every architecture's tiny checkpoint (single file and sharded; the hybrid families too)
the parameters equal a copying load's bit for bit, exactly the convertible ones are file-backed and the others are not, and
the logits are identical; an in-place edit changes the model but not the file; a checkpoint loaded in
another dtype, a hand-made file whose tensors are not aligned, and a GGUF file are read (nothing
mapped) and equal the copying load; a bad file is refused before anything is mapped; mmap=True with
a device_map is refused; a copying load keeps its weights when the file is rewritten in place, and a
mapped load keeps them when the file is replaced by rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from test_loaders import TOKENS, ToyHF, _tiny_configs, save_toy  # registers the toy architecture

from loaders import CheckpointFileError, from_pretrained
from loaders.registry import find_architecture

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")


def _mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapping of this process."""
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                rows.append((start, end, parts[5].strip()))
    return rows


def file_backed(model: torch.nn.Module, directory: Path) -> set[str]:
    """Names of the parameters whose data lies in a mapping of a .safetensors file under `directory`."""
    maps = [(s, e) for s, e, p in _mapped_files()
            if p.endswith(".safetensors") and Path(p).parent == directory.resolve()]
    return {n for n, p in model.named_parameters() if any(s <= p.data_ptr() < e for s, e in maps)}


def convertible(model: torch.nn.Module, directory: Path) -> set[str]:
    """The parameters mmap=True should map (the checkpoint's dtype is the load's): no transform, or one
    that returns a contiguous tensor over its input's own storage."""
    from loaders.load import read_config
    from loaders.safetensors_io import SafetensorsCheckpoint

    arch = find_architecture(json.loads((directory / "config.json").read_text()))
    key_map = arch.key_map(arch.config_from_hf(read_config(directory)))
    ckpt = SafetensorsCheckpoint.from_dir(directory)
    if getattr(arch, "adapt", None) is not None:  # renamed / stacked layouts (loaders/checkpoint_view.py)
        ckpt = arch.adapt(ckpt)
    stacked = getattr(getattr(ckpt, "tensors", None), "stacked", {})  # built from several tensors: read
    names = set(ckpt.keys())
    out = set()
    for name, _ in model.named_parameters():
        key = key_map[name]
        src = next(n for n in key.names if n in names)
        if src in stacked:
            continue
        if key.transform is None:
            out.add(name)
            continue
        x = torch.zeros(ckpt.shape(src))
        y = key.transform(x)
        if y.is_contiguous() and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            out.add(name)
    return out


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n, p in pa.items():
        assert p.dtype == pb[n].dtype and torch.equal(p, pb[n]), n


# ------------------------------------------------------------------------- every architecture
ARCHS = [("llama", "8KB"), ("llama-tied", None), ("gpt2", "8KB"), ("mamba", None), ("falcon_mamba", None),
         ("mamba2", "8KB"), ("zamba2", "16KB")]


@pytest.mark.parametrize("name, shard", ARCHS, ids=[f"{n}-{'sharded' if s else 'single'}" for n, s in ARCHS])
def test_mapped_load_equals_copying_load(tmp_path, tiny_hf, name, shard):
    hf = tiny_hf(_tiny_configs()[name], perturb=0.02)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    copied, mapped = from_pretrained(tmp_path, mmap=False), from_pretrained(tmp_path, mmap=True)
    assert_same_parameters(mapped, copied)
    expected = convertible(mapped, tmp_path)
    assert expected, "the test needs parameters that can be mapped"
    assert file_backed(mapped, tmp_path) == expected
    assert file_backed(copied, tmp_path) == set()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(mapped(tokens), copied(tokens))


@pytest.mark.parametrize("name", ["bamba", "granite", "falcon_h1", "nemotron_h", "jamba"])
def test_hybrid_family_mapped_load_equals_copying_load(tmp_path, name):
    """Exactly the convertible parameters are mapped, renamed ones included (original layouts seen
    through loaders/checkpoint_view.py); per-expert tensors stacked into one are read."""
    from test_hybrid_analysis import FAMILIES, family

    if name not in FAMILIES:
        pytest.skip(f"{name} is not among the hybrid families on this branch")
    hf, _ = family(name)
    hf.save_pretrained(tmp_path)
    copied, mapped = from_pretrained(tmp_path, mmap=False), from_pretrained(tmp_path, mmap=True)
    assert_same_parameters(mapped, copied)
    backed = file_backed(mapped, tmp_path)
    assert backed and backed == convertible(mapped, tmp_path)
    read = {n for n, _ in mapped.named_parameters()} - backed
    assert bool(read) == (name in ("granite", "nemotron_h", "jamba")), read  # the MoE families' stacked experts
    assert file_backed(copied, tmp_path) == set()
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(mapped(tokens), copied(tokens))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_toy_ties_survive_and_transposed_weights_are_read(tmp_path, tied):
    d = save_toy(tmp_path / "toy", ToyHF(tied=tied), shards=3)
    mapped, copied = from_pretrained(d, mmap=True), from_pretrained(d, mmap=False)
    assert_same_parameters(mapped, copied)
    assert (mapped.unembed.weight is mapped.embed.weight) == tied
    backed = file_backed(mapped, d)
    assert "embed.weight" in backed and "blocks.0.proj.bias" in backed
    assert not any(n.endswith("proj.weight") for n in backed)  # stored [in, out]: transposed, so read


# --------------------------------------------------------------------------------- privacy
def test_in_place_edit_stays_in_the_process(tmp_path, tiny_hf):
    tiny_hf(_tiny_configs()["llama"], perturb=0.02).save_pretrained(tmp_path)
    before = file_hashes(tmp_path)
    model = from_pretrained(tmp_path, mmap=True)
    params = dict(model.named_parameters())
    name = next(n for n in sorted(file_backed(model, tmp_path)) if params[n].dim() == 2)
    original = params[name].detach().clone()
    with torch.no_grad():
        params[name].add_(1.0)
        params["embed.weight"].mul_(2.0)
    assert torch.equal(params[name], original + 1.0)  # the model sees its edit
    assert file_hashes(tmp_path) == before  # the file does not
    reloaded = dict(from_pretrained(tmp_path, mmap=True).named_parameters())
    assert torch.equal(reloaded[name], original)


def test_copying_load_keeps_weights_when_the_file_is_rewritten_in_place(tmp_path):
    d = save_toy(tmp_path / "toy", ToyHF(seed=0))
    model = from_pretrained(d, mmap=False)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = d / "model.safetensors"
    size, inode = path.stat().st_size, path.stat().st_ino
    with open(path, "r+b") as f:  # the same file (inode) overwritten: the second half of its bytes zeroed
        f.seek(size // 2)
        f.write(bytes(size - size // 2))
    assert path.stat().st_ino == inode
    assert not torch.equal(from_pretrained(d, mmap=False).embed.weight, kept["embed.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p, kept[n]), n


def test_mapped_load_keeps_weights_when_the_file_is_replaced_by_rename(tmp_path):
    d = save_toy(tmp_path / "toy", ToyHF(seed=0))
    model = from_pretrained(d, mmap=True)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = save_toy(tmp_path / "other", ToyHF(seed=1))
    os.replace(other / "model.safetensors", d / "model.safetensors")  # the documented safe way
    assert not torch.equal(from_pretrained(d, mmap=False).embed.weight, kept["embed.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p, kept[n]), n


# ------------------------------------------------------------------------------ conversions
def test_other_dtype_is_read_not_mapped(tmp_path, tiny_hf):
    tiny_hf(_tiny_configs()["mamba2"], perturb=0.02).save_pretrained(tmp_path)  # float32 on disk
    mapped = from_pretrained(tmp_path, dtype=torch.bfloat16, mmap=True)
    copied = from_pretrained(tmp_path, dtype=torch.bfloat16, mmap=False)
    assert {p.dtype for p in mapped.parameters()} == {torch.bfloat16}
    assert_same_parameters(mapped, copied)
    assert file_backed(mapped, tmp_path) == set()


def _write_unaligned(d: Path, state: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file whose data section starts with one stray byte: every float32 tensor
    then begins at an offset that is not a multiple of 4 (the data section itself is 8-aligned)."""
    header, blobs, at = {"model.layers.0.toy_cache": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, [b"\0"], 1
    for name, t in state.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_unaligned_tensors_are_read(tmp_path):
    hf = ToyHF(tied=False)
    d = save_toy(tmp_path / "toy", hf)
    aligned = from_pretrained(d, mmap=False)
    _write_unaligned(d, hf.checkpoint())
    mapped = from_pretrained(d, mmap=True)
    assert_same_parameters(mapped, aligned)
    assert file_backed(mapped, d) == set()


def test_gguf_is_read(tmp_path, monkeypatch):
    from test_gguf import write_tiny

    import loaders.load

    monkeypatch.setattr(loaders.load, "load_gguf_tokenizer", lambda path: None)  # the tiny file has none
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    mapped, copied = from_pretrained(path, mmap=True), from_pretrained(path, mmap=False)
    assert_same_parameters(mapped, copied)
    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(mapped(tokens), copied(tokens))


# ----------------------------------------------------------------------------------- refusals
def test_bad_file_refused_before_mapping(tmp_path):
    d = save_toy(tmp_path / "toy", ToyHF(), shards=2)
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    mapped_before = {p for _, _, p in _mapped_files()}
    with pytest.raises(CheckpointFileError, match=f"{shard.name}.*truncated"):
        from_pretrained(d, mmap=True)
    assert not [p for _, _, p in _mapped_files() if p not in mapped_before and p.endswith(".safetensors")]


@pytest.mark.parametrize("kwargs, match", [
    ({"device_map": {"": "cpu"}}, "device_map"),
    ({"device": "meta"}, "device='meta'"),
])
def test_mmap_refused_off_cpu(tmp_path, kwargs, match):
    d = save_toy(tmp_path / "toy", ToyHF())
    with pytest.raises(ValueError, match=f"mmap=True .*{match}"):
        from_pretrained(d, mmap=True, **kwargs)


def test_toy_logits_unchanged(tmp_path):
    d = save_toy(tmp_path / "toy", ToyHF(tied=False), shards=2)
    with torch.no_grad():
        assert torch.equal(from_pretrained(d, mmap=True)(TOKENS), from_pretrained(d, mmap=False)(TOKENS))
