"""Checkpoint -> hooked model. (Minimal `from_hf`; the full loader is being written.)"""

from __future__ import annotations

from typing import Any

import torch

from loaders.registry import find_architecture


def from_hf(hf_model: Any) -> Any:
    """A hooked model with the same weights, dtype and device as an in-memory HF model."""
    hf_config = hf_model.config.to_dict()
    arch = find_architecture(hf_config)
    cfg = arch.config_from_hf(hf_config)
    state = hf_model.state_dict()
    p = next(hf_model.parameters())
    model = arch.build(cfg).to(device=p.device, dtype=p.dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, key in arch.key_map(cfg).items():
            src = next(n for n in key.names if n in state)
            t = state[src]
            t = key.transform(t) if key.transform else t
            params[name].copy_(t)
    model.eval()
    return model
