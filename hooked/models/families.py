"""Building a family's hooked model from its frozen config: `build(cfg)`.

Each family module under hooked/models defines its frozen config and `build(cfg)`; a config that refines
another family's (MistralConfig of LlamaConfig, Gemma3Config of Gemma2Config) is built by the nearest
base's module unless its own module defines `build`. The one table of families is loaders/registry.py
(which HF classes and checkpoints become which config and build); nothing here lists them.
"""

from __future__ import annotations

import sys
from typing import Any

from hooked.models.language_model import LanguageModel


def builder_of(config_type: type) -> Any:
    """The `build` of the family module that defines `config_type`, or of its nearest base's; None if none."""
    for klass in config_type.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is not None and module.__name__.startswith("hooked.models.") and "build" in vars(module):
            return vars(module)["build"]
    return None


def build(cfg: Any) -> LanguageModel:
    """The hooked model of `cfg` (random weights: load a checkpoint with `loaders.from_pretrained`)."""
    builder = builder_of(type(cfg))
    if builder is None:
        raise TypeError(f"no family is built from a {type(cfg).__name__}: its module (and its bases') under "
                        "hooked/models defines no build(cfg)")
    return builder(cfg)
