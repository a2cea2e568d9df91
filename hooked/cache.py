"""ActivationCache: the activations of one forward, keyed by hook name.

Keys are full hook names ("blocks.3.attn.hook_pattern"). Shorthand, as in TransformerLens:
    cache["pattern", 3]          -> "blocks.3.<the unique module>.hook_pattern"
    cache["h", 3, "mixer"]       -> "blocks.3.mixer.hook_h"
    cache["resid_post", -1]      -> "blocks.{n_layers-1}.hook_resid_post"
    cache["embed"]               -> "hook_embed"
    cache["scale", 3, "ln1"]     -> "blocks.3.ln1.hook_scale"
    cache["attn", 3]             -> TL's aliases: "attn" is hook_pattern, "attn_logits" hook_attn_scores,
                                    "key"/"query"/"value" hook_k/q/v, "mlp_post" mlp.hook_post, ...

Residual-stream methods (accumulated_resid, decompose_resid, stack_head_results, apply_ln_to_stack,
logit_attrs, get_full_resid_decomposition, ...) live in cache_resid.py, with TransformerLens's
signatures. remove_batch_dim() keeps every method working on [pos, ...] activations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from hooked.cache_resid import ResidualStreamMethods
from hooked.validate import Device, check


# TransformerLens's aliases (utils.get_act_name): cache["attn", l] is the pattern, as in TL
_TL_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_TL_MODULES = {"a": "attn", "m": "mlp", "attention": "attn", "block": None, "b": None}


class ActivationCache(ResidualStreamMethods):
    """A forward's activations; residual-stream methods (TransformerLens's) in cache_resid.py."""

    def __init__(self, cache_dict: dict[str, Tensor], model: Any = None, has_batch_dim: bool = True) -> None:
        self.cache_dict = cache_dict
        self.model = model
        self.has_batch_dim = has_batch_dim

    # ----------------------------------------------------------------------------- dict-like
    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return self.cache_dict.values()

    def items(self):
        return self.cache_dict.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __contains__(self, key: Any) -> bool:
        try:
            return self._key(key) in self.cache_dict
        except KeyError:
            return False

    def __getitem__(self, key: Any) -> Tensor:
        return self.cache_dict[self._key(key)]

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {', '.join(list(self.cache_dict)[:4])}, ...)"

    @property
    def n_layers(self) -> int:
        if self.model is not None:
            return self.model.cfg.n_layers
        layers = [int(k.split(".")[1]) for k in self.cache_dict if k.startswith("blocks.")]
        return max(layers) + 1 if layers else 0

    def _key(self, key: Any) -> str:
        if isinstance(key, str):
            if key in self.cache_dict:
                return key
            if "hook_" + key in self.cache_dict:
                return "hook_" + key
            raise KeyError(f"{key!r} is not in the cache")
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise KeyError(f"cache keys are names or (name, layer[, module]) tuples, got {key!r}")
        name, layer, module = key[0], (key[1] if len(key) > 1 else None), (key[2] if len(key) > 2 else None)
        name = _TL_ALIASES.get(name, name)  # TL's short names: "attn" is the pattern, "attn_logits" the scores, ...
        module = _TL_MODULES.get(module, module)
        hook = name if name.startswith("hook_") else "hook_" + name
        if layer is None:
            return self._key(hook)
        if layer < 0:
            layer += self.n_layers
        prefix = f"blocks.{layer}."
        if module is not None:
            full = f"{prefix}{module}.{hook}"
            if full not in self.cache_dict:
                raise KeyError(f"{full!r} is not in the cache")
            return full
        candidates = [k for k in self.cache_dict if k.startswith(prefix) and k.endswith("." + hook)]
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            raise KeyError(f"no cached hook named {hook!r} in layer {layer}")
        short = [k for k in candidates if k == prefix + hook]
        if len(short) == 1:
            return short[0]
        raise KeyError(f"{key!r} is ambiguous: {candidates}; add the module, e.g. ({name!r}, {layer}, 'attn')")

    # ------------------------------------------------------------------------------- moving
    def to(self, device: str | torch.device) -> "ActivationCache":
        device = check(device, "ActivationCache.to: device", Device())
        return ActivationCache({k: v.to(device) for k, v in self.items()}, self.model, self.has_batch_dim)

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> "ActivationCache":
        """The cache of some rows of the batch (TL's Slice input: an int drops the batch axis)."""
        from hooked.cache_resid import slice_pos

        if not self.has_batch_dim:
            raise ValueError("this cache has no batch axis (remove_batch_dim was applied)")
        sliced = {k: slice_pos(v, batch_slice, dim=0) for k, v in self.items()}
        return ActivationCache(sliced, self.model, has_batch_dim=not isinstance(batch_slice, int))

    def remove_batch_dim(self) -> "ActivationCache":
        for k, v in self.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has shape {tuple(v.shape)}")
        return ActivationCache({k: v[0] for k, v in self.items()}, self.model, has_batch_dim=False)
