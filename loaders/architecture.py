"""What a family loader provides: one `Architecture` per supported HF model class.

Each family module (loaders/gpt2.py, loaders/llama.py, ...) defines an `Architecture` with three
pure functions:
    config_from_hf(hf_config: dict) -> the model's frozen config
    build(cfg) -> the hooked model (random or empty weights)
    key_map(cfg) -> {our parameter name: Key(checkpoint names, transform)}
A parameter shared with another (tied embeddings) is left out of the key map. An optional
`adapt(source) -> source` presents a checkpoint's original layout under the key map's names
(loaders/checkpoint_view.py: per-expert MoE tensors stacked, old prefixes renamed).
Family modules build their key maps from loaders/keymaps.py and never import each other;
loaders/registry.py lists them.
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
    recognise: Callable[[dict[str, Any]], bool] | None = None  # a config with neither class nor model_type
