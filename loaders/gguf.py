"""GGUF checkpoints (llama.cpp's format) as Hugging Face-named float tensors and an HF config dict.

This reader is independent of transformers' own GGUF loading: it parses the file with
`gguf.GGUFReader`, dequantizes each tensor with `gguf.quants.dequantize`, renames it with one
explicit key map and undoes llama.cpp's rotary row permutation. The result plugs into the same key
map as a safetensors checkpoint (`model.layers.{l}.self_attn.q_proj.weight`, ...).

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config                   # {"model_type": "llama", "hidden_size": 576, ...}, LlamaConfig names
    ckpt.tensors.shapes           # {hf_name: torch.Size}, without dequantizing anything
    w = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]   # dequantized now, float32
    for name, w in ckpt.tensors.items(): ...                      # one tensor alive at a time
    tokenizer = ckpt.tokenizer()  # a transformers tokenizer built from the file's vocabulary

Glossary:
    ggml shape      GGUF lists a tensor's dims fastest-varying first: the reverse of torch's order.
                    `token_embd.weight` is ggml [d_model, d_vocab], torch [d_vocab, d_model].
    block type      Q4_1, Q8_0, ...: rows stored as blocks of `block_size` values plus scales;
                    `gguf.quants.dequantize` turns `[rows, bytes_per_row]` into `[rows, cols]`.
    rotary permute  llama.cpp's converter reorders the rows of q_proj and k_proj (weights and
                    biases) within each head, from HF's half-split rotary layout to its interleaved
                    one: `w.reshape(n_heads, 2, d_head // 2, ...).swapaxes(1, 2)`. `unpermute_rotary`
                    is its exact inverse, with n_heads for q and n_kv_heads for k.

Only `general.architecture == "llama"` is read (SmolLM2, Llama 1/2, Mistral). Float metadata is
stored as float32; it is returned as the shortest decimal that round-trips through float32, so the
file's 9.999999747e-06 comes back as the 1e-05 of the original `config.json`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

__all__ = [
    "GGUFError",
    "GGUFCheckpoint",
    "GGUFTensors",
    "read_gguf",
    "load_gguf_tokenizer",
    "permute_rotary",
    "unpermute_rotary",
]

ARCHITECTURES = ("llama",)


class GGUFError(ValueError):
    """A GGUF file this reader cannot turn into a checkpoint: truncated, corrupt or unsupported."""


# ----------------------------------------------------------------------------- key map

# GGUF name -> HF name; `{l}` is the layer index. Only the suffix `.weight` or `.bias` is appended.
_GLOBAL_KEYS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_KEYS = {
    "attn_norm": "model.layers.{l}.input_layernorm",
    "attn_q": "model.layers.{l}.self_attn.q_proj",
    "attn_k": "model.layers.{l}.self_attn.k_proj",
    "attn_v": "model.layers.{l}.self_attn.v_proj",
    "attn_output": "model.layers.{l}.self_attn.o_proj",
    "ffn_norm": "model.layers.{l}.post_attention_layernorm",
    "ffn_gate": "model.layers.{l}.mlp.gate_proj",
    "ffn_up": "model.layers.{l}.mlp.up_proj",
    "ffn_down": "model.layers.{l}.mlp.down_proj",
}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<module>\w+)\.(?P<param>weight|bias)")


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not in the map."""
    match = _NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, module, param = match["layer"], match["module"], match["param"]
    template = _GLOBAL_KEYS.get(module) if layer is None else _LAYER_KEYS.get(module)
    return None if template is None else f"{template.format(l=layer)}.{param}"


# ----------------------------------------------------------------------------- rotary permutation


def permute_rotary(w, n_heads: int):
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): HF rows -> GGUF rows.

    Within each head, row `half * d_head/2 + i` moves to row `2 * i + half`. Works on numpy arrays
    and torch tensors, weights `[n_heads * d_head, d_model]` and biases `[n_heads * d_head]`.
    """
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w, n_heads: int):
    """Inverse of `permute_rotary`: GGUF rows -> HF rows."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- file parsing


class _CheckedReader(GGUFReader):
    """`GGUFReader` that refuses to read past the end of the file.

    The stock reader slices its memmap without a bound, so a truncated file fails later with a
    reshape error. Slicing a plain ndarray view instead of the memmap also halves the parse time
    (numpy's `memmap.__getitem__` is slow and the vocabulary is ~10^5 strings).
    """

    _flat: np.ndarray | None = None

    def __init__(self, path: os.PathLike | str, mode: str = "r") -> None:
        self.path = Path(path)  # named by every GGUFError; the stock reader keeps no path
        super().__init__(path, mode)

    def _get(self, offset, dtype, count=1, override_order=None):
        if self._flat is None:
            self._flat = self.data.view(np.ndarray)
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if end > self._flat.size:
            raise _PastEnd(int(offset), end, self._flat.size)
        arr = self._flat[offset:end].view(dtype)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


class _PastEnd(Exception):
    def __init__(self, offset: int, end: int, size: int):
        super().__init__(offset, end, size)
        self.offset, self.end, self.size = offset, end, size


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _CheckedReader(path, "r")
    except _PastEnd as e:
        raise GGUFError(
            f"GGUF file {path} is truncated or corrupt: it has {e.size} bytes, but its header and tensor "
            f"table say it needs at least {e.end} (a read at offset {e.offset}). Download it again."
        ) from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt header: {e})") from e


def _value(reader: GGUFReader, key: str, default=None):
    """A scalar or string metadata value as a Python object; `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise GGUFError(f"{reader.path}: metadata {key} is an array, expected a scalar")
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    item = part[0].item()
    if field.types[0] == GGUFValueType.FLOAT32:
        return float(str(np.float32(item)))  # shortest decimal: 1e-05, not 9.999999747378752e-06
    return item


def _array_len(reader: GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def _llama_config(reader: GGUFReader, tensor_names: set[str]) -> dict:
    """The file's `llama.*` and `tokenizer.ggml.*` metadata under HF LlamaConfig names."""
    a = "llama"

    def need(key: str):
        value = _value(reader, f"{a}.{key}")
        if value is None:
            raise GGUFError(f"{reader.path}: metadata {a}.{key} is missing")
        return value

    d_model, n_heads = need("embedding_length"), need("attention.head_count")
    for key, value in (("embedding_length", d_model), ("attention.head_count", n_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GGUFError(f"{reader.path}: metadata {a}.{key}={value!r} must be an integer >= 1")
    d_head = _value(reader, f"{a}.attention.key_length", d_model // n_heads)
    rotary_dim = _value(reader, f"{a}.rope.dimension_count", d_head)
    if rotary_dim != d_head:
        raise GGUFError(f"{reader.path}: rope.dimension_count={rotary_dim} != d_head={d_head} (partial rotary)")
    vocab = _value(reader, f"{a}.vocab_size") or _array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:  # old files: only the embedding knows
        vocab = int(reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")].shape[-1])
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": d_model,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _value(reader, f"{a}.attention.head_count_kv", n_heads),
        "head_dim": d_head,
        "hidden_act": "silu",
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": _value(reader, f"{a}.rope.freq_base", 10000.0),  # llama.cpp's default
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
    }
    rope_scaling = _rope_scaling(reader)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for hf_key, gguf_key in [("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")]:
        token_id = _value(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[hf_key] = token_id
    return config


def _rope_scaling(reader: GGUFReader) -> dict | None:
    kind = _value(reader, "llama.rope.scaling.type")
    factor = _value(reader, "llama.rope.scaling.factor")
    if kind is None and _value(reader, "llama.rope.scale_linear") is not None:  # pre-2024 files
        kind, factor = "linear", _value(reader, "llama.rope.scale_linear")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _value(reader, "llama.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise GGUFError(f"{reader.path}: rope scaling type {kind!r} is not supported (linear, yarn)")


@functools.cache
def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether `gguf.quants.dequantize` handles this type (probed on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# ----------------------------------------------------------------------------- tensors

_CHUNK_VALUES = 1 << 22  # dequantize 4M values (16 MiB of float32) at a time


def _dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Dequantize into one float32 array of torch `shape`, a slab of rows at a time.

    `gguf.quants.dequantize` builds float32 temporaries as large as its output; slabs keep the
    peak near the size of the output instead of twice it.
    """
    out = np.empty(shape, dtype=np.float32)
    if out.ndim == 0 or out.size == 0:
        return out
    row_values = out[0].size if out.ndim > 1 else out.size
    step = max(1, _CHUNK_VALUES // row_values) if out.ndim > 1 else out.shape[0]
    for start in range(0, shape[0], step):
        values = dequantize(data[start : start + step], qtype)
        if values.shape != out[start : start + step].shape:
            raise GGUFError(f"{name}: {qtype.name} data dequantized to {values.shape}, expected rows of {shape}")
        out[start : start + step] = values
    return out



class GGUFTensors(Mapping):
    """HF name -> float tensor, dequantized on each access (nothing is cached).

    Iterating `items()` keeps one dequantized tensor alive at a time; the file itself is memory
    mapped, so the resident cost is the pages read plus the tensor being converted.
    """

    def __init__(self, reader: GGUFReader, config: dict, dtype: torch.dtype):
        self._reader, self.dtype = reader, dtype
        self._n_heads = config["num_attention_heads"]
        self._n_kv_heads = config["num_key_value_heads"]
        self._d_head = config["head_dim"]
        self._by_name = {}
        for tensor in reader.tensors:
            self._by_name[_hf_name(tensor.name)] = tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._by_name[name]
        if not _can_dequantize(tensor.tensor_type):
            raise GGUFError(f"{tensor.name} ({name}) is {tensor.tensor_type.name}, which gguf cannot dequantize")
        shape = tuple(reversed(tensor.shape.tolist()))  # ggml order -> torch order
        w = torch.from_numpy(_dequantize_rows(tensor.data, tensor.tensor_type, shape, tensor.name))
        heads = {"q_proj": self._n_heads, "k_proj": self._n_kv_heads}.get(name.split(".")[-2])
        if heads is not None:
            if w.shape[0] != heads * self._d_head:
                raise GGUFError(f"{tensor.name}: {w.shape[0]} rows, expected {heads} heads x d_head {self._d_head}")
            w = unpermute_rotary(w, heads)
        return w.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """HF name -> torch shape, from the tensor table alone."""
        return {name: torch.Size(reversed(t.shape.tolist())) for name, t in self._by_name.items()}

    @property
    def gguf_types(self) -> dict[str, str]:
        """HF name -> storage type as GGUF names it (`Q4_1`, `F32`, ...)."""
        return {name: t.tensor_type.name for name, t in self._by_name.items()}


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    config: dict  # HF LlamaConfig field names; LlamaConfig(**config) builds the HF config
    tensors: GGUFTensors  # HF names, dequantized lazily
    reader: GGUFReader  # the parsed file, for metadata this class does not map

    def tokenizer(self):
        return load_gguf_tokenizer(self.path)


def read_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Parse a GGUF file's metadata and tensor table; tensors are dequantized when accessed.

    Args:
        path: a `.gguf` file whose `general.architecture` is `llama`.
        dtype: the float dtype tensors are returned in (dequantization itself is float32).
    Returns:
        GGUFCheckpoint with `config` (HF LlamaConfig names) and `tensors` (HF names).
    Raises:
        FileNotFoundError: no such file.
        GGUFError: truncated or corrupt file, another architecture, tensors outside the llama key
            map, or tensor types `gguf.quants` cannot dequantize (all of them listed).
    """
    path = Path(path)
    reader = _open(path)
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; read_gguf reads {list(ARCHITECTURES)}")
    names = [t.name for t in reader.tensors]
    unknown = [n for n in names if _hf_name(n) is None]
    if unknown:
        hint = " (llama3 rope_freqs scaling is not supported)" if "rope_freqs.weight" in unknown else ""
        raise GGUFError(f"{path}: tensors outside the llama key map{hint}: {unknown}")
    unsupported = [f"{t.name} ({t.tensor_type.name})" for t in reader.tensors if not _can_dequantize(t.tensor_type)]
    if unsupported:
        raise GGUFError(f"{path}: gguf.quants cannot dequantize these tensors' types: {unsupported}")
    config = _llama_config(reader, set(names))
    return GGUFCheckpoint(path, config, GGUFTensors(reader, config, dtype), reader)


def load_gguf_tokenizer(path: str | os.PathLike, cache: bool = True):
    """The transformers tokenizer for a GGUF file's vocabulary (transformers' own GGUF converter).

    Converting a GGUF vocabulary takes tens of seconds, so the converted tokenizer is saved once under
    `$HOOKED_CACHE` (default ~/.cache/hooked) keyed by the file's name, size and mtime and the
    transformers version that converted it (another version may convert, and read a saved tokenizer,
    differently), and read from there afterwards (a fraction of a second). `cache=False` always converts.
    """
    import transformers
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not cache:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    stat = path.stat()
    root = Path(os.environ.get("HOOKED_CACHE", Path.home() / ".cache" / "hooked"))
    saved = root / "gguf-tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-tf{transformers.__version__}"
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # a damaged cache entry: convert again below
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, saved) if not saved.exists() else None
    except OSError:  # a read-only home: no cache, same tokenizer
        pass
    return tok
