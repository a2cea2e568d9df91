"""Which hooked model a checkpoint becomes: the table of every family loader's `Architecture`, the one list
of the families (hooked.models.families.build finds a config's builder without a table of its own).

`ARCHITECTURES` lists them explicitly (loaders/architecture.py says what one holds);
`find_architecture` picks one by the HF config's `architectures`, then its `model_type`, then its
`recognise` (a layout known by its fields), first match in table order. `register` adds another
(a test's toy model, a family outside this package).
"""

from __future__ import annotations

from typing import Any

from loaders import (bamba, falcon_h1, gemma2, gemma3, gpt2, granitemoehybrid, jamba, kimi_linear, lfm2, llama, mamba,
                     llamba, mamba2, mistral, nemotron_h, olmo_hybrid, qwen2, qwen3, qwen3_next, zamba2)
from loaders import gemma, gpt_neox, olmo2, olmo3, phi3
from loaders import bailing_hybrid, lfm2_moe  # issue 41's families on mixers we have
from loaders import recurrent_gemma  # issue 41's new mixer kinds
from loaders import minimax  # issue 41's new mixer kinds
from loaders import rwkv  # issue 41's new mixer kinds
from loaders import zamba  # issue 41's families on mixers we have
from loaders import xlstm  # issue 41's new mixer kinds
from loaders import qwen4_exp  # issue 41's families on mixers we have
from loaders import gpt_oss, mixtral, olmoe, qwen3_moe  # issue 42's mixtures of experts
from loaders.architecture import Architecture, Key

__all__ = ["ARCHITECTURES", "REGISTRY", "Architecture", "Key", "find_architecture", "register"]

ARCHITECTURES: tuple[Architecture, ...] = (
    gpt2.ARCHITECTURE,
    llama.ARCHITECTURE,
    mamba.ARCHITECTURE,
    mamba.FALCON_MAMBA,
    mamba2.ARCHITECTURE,
    zamba2.ARCHITECTURE,
    bamba.ARCHITECTURE,
    granitemoehybrid.ARCHITECTURE,
    falcon_h1.ARCHITECTURE,
    nemotron_h.ARCHITECTURE,
    jamba.ARCHITECTURE,
    mistral.ARCHITECTURE,
    qwen2.ARCHITECTURE,
    qwen3.ARCHITECTURE,
    gemma2.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    gemma3.MULTIMODAL,
    gpt_neox.ARCHITECTURE,
    gemma.ARCHITECTURE,
    phi3.ARCHITECTURE,
    olmo2.ARCHITECTURE,
    olmo3.ARCHITECTURE,
    qwen3_next.ARCHITECTURE,
    qwen3_next.QWEN3_5,
    qwen3_next.QWEN3_5_MOE,
    olmo_hybrid.ARCHITECTURE,
    kimi_linear.ARCHITECTURE,
    lfm2.ARCHITECTURE,
    mixtral.ARCHITECTURE,
    olmoe.ARCHITECTURE,
    qwen3_moe.ARCHITECTURE,
    gpt_oss.ARCHITECTURE,
    llamba.ARCHITECTURE,
    lfm2_moe.ARCHITECTURE,
    bailing_hybrid.ARCHITECTURE,
    recurrent_gemma.ARCHITECTURE,
    minimax.ARCHITECTURE,
    rwkv.ARCHITECTURE,
    zamba.ARCHITECTURE,
    xlstm.ARCHITECTURE,
    qwen4_exp.ARCHITECTURE,
)

REGISTRY: dict[str, Architecture] = {arch.name: arch for arch in ARCHITECTURES}


def register(arch: Architecture) -> Architecture:
    """Add `arch` to the table (after the built-in ones; a name already there is replaced)."""
    REGISTRY[arch.name] = arch
    return arch


def find_architecture(hf_config: dict[str, Any]) -> Architecture:
    """The architecture for an HF config dict (by `architectures`, then `model_type`)."""
    classes = hf_config.get("architectures") or []
    for arch in REGISTRY.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    model_type = hf_config.get("model_type")
    for arch in REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    for arch in REGISTRY.values():  # a layout known by its fields (Cartesia's Llamba config.json)
        if arch.recognise is not None and arch.recognise(hf_config):
            return arch
    known = sorted(c for a in REGISTRY.values() for c in a.hf_classes)
    raise ValueError(f"unknown architecture {classes or model_type!r}; supported: {', '.join(known)}")
