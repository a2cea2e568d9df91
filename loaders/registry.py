"""Which hooked model a checkpoint becomes: one `Architecture` per supported HF model class.

Each architecture module (loaders/gpt2.py, loaders/llama.py, ...) calls `register(Architecture(...))`
with three pure functions:
    config_from_hf(hf_config: dict) -> the model's frozen config
    build(cfg) -> the hooked model (random or empty weights)
    key_map(cfg) -> {our parameter name: Key(checkpoint names, transform)}
A parameter shared with another (tied embeddings) is left out of the key map. An optional
`adapt(source) -> source` presents a checkpoint's original layout under the key map's names
(loaders/checkpoint_view.py: per-expert MoE tensors stacked, old prefixes renamed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class Key:
    """Where a parameter lives in a checkpoint: candidate names (first present wins) and a transform."""

    names: tuple[str, ...]
    transform: Callable[[Tensor], Tensor] | None = None

    @staticmethod
    def of(*names: str, transform: Callable[[Tensor], Tensor] | None = None) -> "Key":
        return Key(tuple(names), transform)


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_classes: tuple[str, ...]
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], Any]
    key_map: Callable[[Any], dict[str, Key]]
    ignore: tuple[str, ...] = ()  # regexes of checkpoint names HF itself does not load (not "unexpected")
    adapt: Callable[[Any], Any] | None = None  # source -> source: an original layout seen as the key map's


REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    REGISTRY[arch.name] = arch
    return arch


def find_architecture(hf_config: dict[str, Any]) -> Architecture:
    """The architecture for an HF config dict (by `architectures`, then `model_type`)."""
    _import_all()
    classes = hf_config.get("architectures") or []
    for arch in REGISTRY.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    model_type = hf_config.get("model_type")
    for arch in REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    known = sorted(c for a in REGISTRY.values() for c in a.hf_classes)
    raise ValueError(f"unknown architecture {classes or model_type!r}; supported: {', '.join(known)}")


def _import_all() -> None:
    """Import every architecture module so that it registers itself."""
    import importlib

    for mod in ("gpt2", "llama", "mamba", "mamba2", "zamba2", "bamba", "granitemoehybrid", "falcon_h1",
                "nemotron_h", "jamba", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"):
        try:
            importlib.import_module(f"loaders.{mod}")
        except ModuleNotFoundError as e:  # an architecture not written yet
            if e.name != f"loaders.{mod}":
                raise
