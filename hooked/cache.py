"""ActivationCache: the activations of one forward, keyed by hook name.

Keys are full hook names ("blocks.3.attn.hook_pattern"). Shorthand, as in TransformerLens:
    cache["pattern", 3]          -> "blocks.3.<the unique module>.hook_pattern"
    cache["h", 3, "mixer"]       -> "blocks.3.mixer.hook_h"
    cache["resid_post", -1]      -> "blocks.{n_layers-1}.hook_resid_post"
    cache["embed"]               -> "hook_embed"
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor


class ActivationCache:
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
        return ActivationCache({k: v.to(device) for k, v in self.items()}, self.model, self.has_batch_dim)

    def remove_batch_dim(self) -> "ActivationCache":
        for k, v in self.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has shape {tuple(v.shape)}")
        return ActivationCache({k: v[0] for k, v in self.items()}, self.model, has_batch_dim=False)

    # ------------------------------------------------------------------------ residual stream
    def _apply_ln(self, stack: Tensor) -> Tensor:
        """Final norm with the normalisation factor of the final residual (keeps the map linear).

        On a dispatched model the norm's weight is made real (hooked.devices.onloaded) and the
        stack moved to it."""
        from hooked.devices import onloaded

        final = self[("resid_post", self.n_layers - 1)]
        ln = self.model.ln_final
        with onloaded(self.model, ln):
            device = ln.weight.device
            return ln.apply_frozen(stack.to(device), final.to(device))

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          return_labels: bool = False):
        """The residual stream before each layer `< layer` (and the final one when layer is None).

        Returns a tensor [component, batch, pos, d_model] (and labels "0_pre", "0_mid", ..., "final_post").
        """
        n = self.n_layers if layer is None else (layer + self.n_layers if layer < 0 else layer)
        parts, labels = [], []
        for l in range(n):
            parts.append(self[("resid_pre", l)])
            labels.append(f"{l}_pre")
            if incl_mid and f"blocks.{l}.hook_resid_mid" in self.cache_dict:
                parts.append(self[("resid_mid", l)])
                labels.append(f"{l}_mid")
        if layer is None or n == self.n_layers:
            parts.append(self[("resid_post", self.n_layers - 1)])
            labels.append("final_post")
        stack = _stack(parts)
        if apply_ln:
            stack = self._apply_ln(stack)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, incl_embeds: bool = True, apply_ln: bool = False,
                        return_labels: bool = False):
        """Split the residual stream before `layer` (default: the final one) into what wrote it.

        Components: the embeddings, then per layer every output the block adds to the residual
        (attn_out and mlp_out for transformers, mixer_out for SSMs). They sum to the residual.
        """
        n = self.n_layers if layer is None else (layer + self.n_layers if layer < 0 else layer)
        parts, labels = [], []
        if incl_embeds:
            for key in ("hook_embed", "hook_pos_embed"):
                if key in self.cache_dict:
                    parts.append(self.cache_dict[key])
                    labels.append(key[len("hook_"):])
        writers = getattr(self.model, "resid_writers", lambda l: [])
        for l in range(n):
            for name in writers(l):
                parts.append(self.cache_dict[name])
                labels.append(f"{l}_{name.split('hook_')[-1]}")
        stack = _stack(parts)
        if apply_ln:
            stack = self._apply_ln(stack)
        return (stack, labels) if return_labels else stack

    def stack_head_results(self, layer: int = -1, apply_ln: bool = False, return_labels: bool = False,
                           incl_shared: bool = False):
        """Each head's write for layers `< layer` (-1: all): [head, batch, pos, d_model].

        Attention heads come from `attn.hook_result`, SSM heads (Mamba-2 heads, Mamba-1 channels) from
        `mixer.hook_head_out`; run the cache with those hooks (names_filter=None includes them).
        Labels are "L{layer}H{head}". Zamba2's shared-attention heads ("L{layer}SH{head}") write into
        the shared block's MLP and then the Mamba layer's input, not into the residual stream, so
        they are left out unless `incl_shared=True`.
        """
        n = self.n_layers if layer == -1 else layer
        parts, labels = [], []
        for l in range(n):
            sites = [(f"blocks.{l}.attn.hook_result", "H"), (f"blocks.{l}.mixer.hook_head_out", "H")]
            if incl_shared:
                sites.insert(1, (f"blocks.{l}.shared.attn.hook_result", "SH"))
            for key, tag in sites:
                if key in self.cache_dict:
                    res: Float[Tensor, "batch pos heads d_model"] = self.cache_dict[key]
                    parts.append(res.movedim(2, 0))
                    labels += [f"L{l}{tag}{h}" for h in range(res.shape[2])]
        if not parts:
            raise KeyError("no per-head results in the cache: include hook_result / hook_head_out in names_filter")
        stack = _stack(parts, cat=True)
        if apply_ln:
            stack = self._apply_ln(stack)
        return (stack, labels) if return_labels else stack


def _stack(parts: list[Tensor], cat: bool = False) -> Tensor:
    """torch.stack (or cat) of tensors that may sit on several devices (a dispatched model's layers):
    all moved to the last one's device."""
    device = parts[-1].device
    parts = [p.to(device) for p in parts]
    return torch.cat(parts) if cat else torch.stack(parts)
