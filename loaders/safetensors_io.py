"""Streaming reads of safetensors checkpoints: one tensor at a time, straight into its destination.

Glossary
    header        the file's first 8 bytes (little-endian u64 n) then n bytes of JSON:
                  {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}
    data section  the bytes after the header; `data_offsets` are relative to its start
    shard         one file of a sharded checkpoint; `model.safetensors.index.json` maps each tensor
                  name to its shard (`{"weight_map": {name: file}}`)
    TensorSource  what the loader reads from: `keys()`, `shape(name)`, `dtype(name)`, `read(name)`,
                  `read_into(name, out)`, optionally `map(name, dtype)`. `SafetensorsCheckpoint` is
                  one; `MappingSource` wraps a state dict or any lazy name -> tensor mapping (GGUF)
    mapped        a tensor over a private (copy-on-write, `mmap.ACCESS_COPY`) memory map of its file:
                  nothing is read until a page is touched, and a page written to (a weight edit) is
                  copied into the process first, so edits never reach the file. The file itself must
                  not be rewritten in place or truncated while such a tensor lives: a page not yet
                  touched then shows the new bytes, and a page past the new end of the file kills the
                  process (SIGBUS). Replacing the file is safe: a new file renamed over it, or
                  safetensors' `save_file` (and so `save_pretrained`), which makes a new file

Why not `safe_open(...).get_tensor`: it memory-maps the file, and every page it copies from stays
resident in the process for as long as the file is open, so loading costs the model plus the file
(about 2x). Here each tensor is read with plain `readinto` into the parameter's own storage when the
dtype and layout already match (about 1x), or into one temporary tensor when it must be converted.
The header is validated before anything is read, as the safetensors library does: a JSON object
without duplicate names, each entry's dtype known, shape non-negative integers, offsets a pair
[begin, end] whose length is the shape's size in bytes, and the tensors' byte ranges tiling the data
section exactly (sorted by begin: the first at 0, each where the previous ended, the last at the
end of the file): no overlap, no gap, no truncation. Each failure names the file and the tensor.
Shard files named by an index must lie inside the checkpoint directory (loaders/checks.py).

`from_pretrained(..., mmap=True)` maps instead of reading (`SafetensorsFile.mapped`): the header is
validated exactly as above first, and a tensor is mapped only where it needs no conversion and its
offset in the file is a multiple of its element size (torch kernels assume aligned elements;
safetensors writers align every tensor, a hand-made file may not); the others are read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100_000_000  # the format's own limit


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read: truncated, corrupt header, missing shard."""


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Duplicate(f"name {dup!r} appears twice")
    return out


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size; data read on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.size = size = self.path.stat().st_size
        self._map: mmap.mmap | None = None  # opened by the first `mapped` call
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointFileError(
                    f"{self.path}: truncated or corrupt safetensors file: header of {n} bytes, file of {size} bytes")
            try:
                header = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
            except (UnicodeDecodeError, json.JSONDecodeError, _Duplicate) as e:
                raise CheckpointFileError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointFileError(f"{self.path}: corrupt safetensors header (a {type(header).__name__}, "
                                      f"expected a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointFileError(f"{self.path}: __metadata__ must map strings to strings, got {metadata!r}")
        self.metadata: dict[str, str] = metadata
        self.tensors: dict[str, TensorInfo] = {}
        start = 8 + n
        for name, entry in header.items():
            self.tensors[name] = self._info(name, entry, start)
        self._check_layout(start, size)

    def _check_layout(self, start: int, size: int) -> None:
        """The byte ranges, sorted by begin, tile [start, size) exactly (the safetensors library's rule)."""
        at, previous = start, None
        for name, info in sorted(self.tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
            if info.begin < at:
                raise CheckpointFileError(
                    f"{self.path}: tensors {previous!r} and {name!r} overlap (bytes [{info.begin - start}, "
                    f"{min(at, info.end) - start}) of the data section)")
            if info.begin > at:
                raise CheckpointFileError(f"{self.path}: {at - start}..{info.begin - start}: a gap of "
                                          f"{info.begin - at} bytes before tensor {name!r} (corrupt offsets)")
            at, previous = info.end, name
        if at > size:
            raise CheckpointFileError(
                f"{self.path}: truncated safetensors file: tensors need {at} bytes, the file has {size} "
                f"({at - size} missing)")
        if at < size:
            raise CheckpointFileError(f"{self.path}: {size - at} bytes after the last tensor that no tensor "
                                      f"owns (corrupt offsets or a damaged file)")

    def _info(self, name: str, entry: Any, start: int) -> TensorInfo:
        if isinstance(entry, dict) and entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointFileError(f"{self.path}: {name!r} has dtype {entry.get('dtype')!r}, which the loader "
                                      f"does not read (it reads {', '.join(SAFETENSORS_DTYPES)})")
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
                raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
                raise ValueError(f"data_offsets {offsets!r} is not [begin, end] of non-negative integers")
            shape, (begin, end) = tuple(shape), offsets
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFileError(f"{self.path}: corrupt header entry for {name!r}: {entry!r} ({e})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointFileError(
                f"{self.path}: {name!r} has offsets [{begin}, {end}) but {entry['dtype']}{list(shape)} needs {nbytes} bytes")
        return TensorInfo(dtype, shape, start + begin, start + end)

    def read_into(self, name: str, out: Tensor) -> None:
        """Read tensor `name` into `out` (same dtype, contiguous CPU, same number of elements)."""
        info = self.tensors[name]
        buf = out.reshape(-1).view(torch.uint8)
        if buf.data_ptr() != out.data_ptr() or buf.numel() != info.end - info.begin:
            raise ValueError(f"{name}: destination is not a contiguous buffer of {info.end - info.begin} bytes")
        if buf.numel() == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != buf.numel():
            raise CheckpointFileError(f"{self.path}: truncated while reading {name!r} ({got} of {buf.numel()} bytes)")

    def read(self, name: str) -> Tensor:
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, out)
        return out

    def mapped(self, name: str) -> Tensor | None:
        """Tensor `name` over a private memory map of the file (nothing read yet; writes stay in this
        process), or None when it cannot be mapped: empty, or not aligned to its element size."""
        info = self.tensors[name]
        count = math.prod(info.shape)
        if count == 0 or info.begin % info.dtype.itemsize:
            return None
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if len(self._map) != self.size:  # changed between the header check and now
                raise CheckpointFileError(f"{self.path}: the file changed while loading ({self.size} bytes "
                                          f"checked, {len(self._map)} mapped)")
        return torch.frombuffer(self._map, dtype=info.dtype, count=count, offset=info.begin).view(info.shape)


class SafetensorsCheckpoint:
    """A single `model.safetensors` or a sharded checkpoint behind `model.safetensors.index.json`."""

    streams = True  # read_into works for any contiguous CPU buffer of the stored dtype

    def __init__(self, files: Iterable[str | os.PathLike]) -> None:
        self.files = [SafetensorsFile(p) for p in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointFileError(f"tensor {name!r} is in both {self._where[name].path} and {f.path}")
                self._where[name] = f

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "SafetensorsCheckpoint":
        d = Path(directory)
        if (d / INDEX_FILE).is_file():
            return cls.from_index(d / INDEX_FILE)
        if (d / SINGLE_FILE).is_file():
            return cls([d / SINGLE_FILE])
        raise FileNotFoundError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}")

    @classmethod
    def from_index(cls, index_path: str | os.PathLike) -> "SafetensorsCheckpoint":
        from loaders.checks import read_json, shard_path, weight_map as read_weight_map

        index_path = Path(index_path)
        weight_map = read_weight_map(read_json(index_path, "safetensors index"), index_path)
        shards = sorted(set(weight_map.values()))
        paths = [shard_path(index_path.parent, s, index_path) for s in shards]
        missing = [s for s, p in zip(shards, paths) if not p.is_file()]
        if missing:
            raise CheckpointFileError(f"{index_path}: shard files missing: {missing}")
        ckpt = cls(paths)
        absent = sorted(n for n, s in weight_map.items() if n not in ckpt._where)
        if absent:
            raise CheckpointFileError(f"{index_path}: tensors listed in the index but in no shard: {absent}")
        return ckpt

    @property
    def origin(self) -> str:
        return str(self.files[0].path.parent)

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name].tensors[name].dtype

    def read(self, name: str) -> Tensor:
        return self._where[name].read(name)

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name` (disk offload reads it from there: loaders/dispatch.py)."""
        return self._where[name].path

    def read_into(self, name: str, out: Tensor) -> bool:
        """Read straight into `out` when no conversion is needed; False if the caller must copy."""
        f = self._where[name]
        info = f.tensors[name]
        if out.device.type != "cpu" or out.dtype != info.dtype or not out.is_contiguous() \
                or out.numel() != math.prod(info.shape):
            return False
        f.read_into(name, out)
        return True

    def map(self, name: str, dtype: torch.dtype) -> Tensor | None:
        """Tensor `name` file-backed (`SafetensorsFile.mapped`) when stored in `dtype`; None: read it instead."""
        f = self._where[name]
        return f.mapped(name) if f.tensors[name].dtype == dtype else None


class MappingSource:
    """A TensorSource over a name -> tensor mapping (a state dict, or GGUF's lazy tensors)."""

    streams = False  # tensors are already in memory (or made by the mapping): read() hands them over

    def __init__(self, tensors: Mapping[str, Tensor], origin: str, shapes: Mapping[str, Any] | None = None) -> None:
        self.tensors, self.origin = tensors, origin
        self._shapes = shapes

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name]) if self._shapes is not None else tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype | None:
        if self._shapes is not None:
            return getattr(self.tensors, "dtype", None)
        return self.tensors[name].dtype

    def read(self, name: str) -> Tensor:
        return self.tensors[name]

    def read_into(self, name: str, out: Tensor) -> bool:
        return False

    def map(self, name: str, dtype: torch.dtype) -> Tensor | None:
        """File-backed tensor `name` when the mapping offers one (a renaming view over a checkpoint), else None."""
        return self.tensors.map(name, dtype) if hasattr(self.tensors, "map") else None

    def identity(self, name: str) -> tuple | None:
        """Equal for two names holding the very same tensor (HF's tied weights); None for lazy tensors."""
        if self._shapes is not None:
            return None
        t = self.tensors[name]
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
