"""Checks a checkpoint passes before anything is built: config values, JSON files, shard paths, dtypes.

Glossary
    origin        what the message names: the file (config.json, an index) or the checkpoint
    HF field      a key of an HF config dict (`vocab_size`); SIZE_FIELDS must be positive integers,
                  EPS_FIELDS positive finite numbers, and `dtype` / `torch_dtype` a floating dtype
    our field     a field of a model's frozen config (`d_vocab`); every integer one is a size or a
                  count and must be >= 1, every `eps` > 0: checked generically, no per-model code
    shard path    a file named by an index's `weight_map`: relative, without `..`, so it resolves
                  inside the checkpoint directory (symlinks inside it are allowed: the hub cache
                  links each file to its blob)

Every failure is a ValueError (ConfigError, or the safetensors CheckpointFileError) naming the file
or field and the value found; nothing is half built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

SIZE_FIELDS = (  # HF config fields that are sizes or counts (>= 1) wherever they appear
    "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "intermediate_size", "n_inner", "n_positions", "max_position_embeddings",
    "head_dim", "state_size", "num_heads", "conv_kernel", "chunk_size", "n_groups", "time_step_rank",
    "n_mamba_heads", "mamba_d_state", "mamba_d_conv", "mamba_headdim", "mamba_ngroups", "attention_head_dim",
    "num_mem_blocks", "adapter_rank", "attn_layer_period", "expert_layer_period", "num_experts_per_tok",
    "sliding_window_pattern",
)
POSITIVE_NUMBER_FIELDS = ("expand", "mamba_expand", "rope_theta", "query_pre_attn_scalar")
EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")
DTYPE_FIELDS = ("dtype", "torch_dtype")
PATTERN_SYMBOLS = "M*-E"  # NemotronH's hybrid_override_pattern


class ConfigError(ValueError):
    """A config value the model cannot be built from; the message names the field and the file."""


def read_json(path: Path, what: str = "JSON file") -> Any:
    """json.loads of a file, with the file's name in the error."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def check_hf_config(raw: Any, origin: str) -> dict[str, Any]:
    """`raw` if it is a JSON object whose known HF fields are in range; else ConfigError naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: a config must be a JSON object, got a {type(raw).__name__}")
    for name in SIZE_FIELDS:
        value = raw.get(name)
        if value is not None and not (name == "time_step_rank" and value == "auto"):
            _positive_int(value, f"{origin}: config field {name}")
    for name in POSITIVE_NUMBER_FIELDS:
        if raw.get(name) is not None:
            _positive_number(raw[name], f"{origin}: config field {name}")
    for name in EPS_FIELDS:
        if raw.get(name) is not None:
            _positive_number(raw[name], f"{origin}: config field {name}")
    pattern = raw.get("hybrid_override_pattern")
    if pattern is not None:
        bad = sorted(set(pattern) - set(PATTERN_SYMBOLS)) if isinstance(pattern, str) else None
        if bad is None or bad or not pattern:
            raise ConfigError(f"{origin}: config field hybrid_override_pattern={pattern!r} must be a non-empty string "
                              f"of {PATTERN_SYMBOLS!r} (Mamba-2, attention, MLP, MoE)"
                              + (f"; unknown: {bad}" if bad else ""))
    for name in DTYPE_FIELDS:
        value = raw.get(name)
        if value is not None and not (isinstance(value, str) and value.removeprefix("torch.") == "auto"):
            config_dtype(value, f"{origin}: config field {name}")
    return raw


def config_dtype(value: Any, what: str) -> torch.dtype:
    """The floating torch dtype a config's "dtype" names ("bfloat16", "torch.float16", a torch.dtype)."""
    dtype = value if isinstance(value, torch.dtype) else (
        getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{what}={value!r} is not a torch dtype")
    return check_float_dtype(dtype, what)


def check_float_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    """`dtype` if it is a floating torch.dtype (parameters must be), else ConfigError."""
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{what} must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if not dtype.is_floating_point:
        raise ConfigError(f"{what}={dtype}: parameters must be floating point (float32, bfloat16, float16, ...)")
    return dtype


def check_model_config(cfg: Any, origin: str, arch: str) -> Any:
    """`cfg` if every integer field of the frozen config is >= 1 and every eps > 0 (names our field)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            _positive_int(value, f"{origin}: {arch} config {f.name}")
        elif isinstance(value, float) and "eps" in f.name:
            _positive_number(value, f"{origin}: {arch} config {f.name}")
    return cfg


def shard_path(directory: Path, name: Any, index: Path) -> Path:
    """`directory / name` for a shard an index names, refused unless it stays inside `directory`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{index}: a shard file name must be a non-empty string, got {name!r}")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive \
            or ".." in parts or "\x00" in name:
        raise ConfigError(f"{index}: shard {name!r} leaves the checkpoint directory {directory}; "
                          f"shards must be files inside it")
    return directory / os.path.join(*parts)


def weight_map(raw: Any, index: Path) -> dict[str, str]:
    """An index file's `weight_map` ({tensor name: shard file}), checked for shape and types."""
    if not isinstance(raw, dict) or "weight_map" not in raw:
        raise ConfigError(f"{index}: not an index: expected a JSON object with a 'weight_map'")
    wm = raw["weight_map"]
    if not isinstance(wm, dict):
        raise ConfigError(f"{index}: 'weight_map' must map tensor names to shard files, got a {type(wm).__name__}")
    bad = [f"{k!r}: {v!r}" for k, v in wm.items() if not isinstance(v, str)]
    if bad:
        raise ConfigError(f"{index}: 'weight_map' values must be shard file names: {', '.join(bad[:5])}")
    return wm


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what}={value!r} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ConfigError(f"{what}={value} must be >= 1")
    return value


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what}={value!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}={value} must be a finite number > 0")
    return float(value)
