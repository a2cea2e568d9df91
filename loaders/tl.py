"""TransformerLens-style loading: `HookedTransformer.from_pretrained(name)` with TL's defaults.

    from loaders.tl import HookedTransformer
    model = HookedTransformer.from_pretrained("smollm2-135m")   # was: ...from_pretrained("gpt2-small")

TL's defaults, where hooked's own `from_pretrained` has none:
    weight processing   fold_ln, center_writing_weights, center_unembed, fold_value_biases all on
                        (RMSNorm models skip centring of writers, as TL); `from_pretrained_no_processing`
                        turns them off
    BOS                 `default_prepend_bos=True`: text gets BOS prepended (TL's cfg.default_prepend_bos)
    padding             a batch of texts given to the model is padded on the right (TL's default_padding_side)
    hook switches       `tl_gating`: a callable names filter skips hook_attn_in / hook_mlp_in / hook_result
                        until set_use_attn_in / set_use_hook_mlp_in / set_use_attn_result turn them on
The model is the same hooked model; only these switches differ. TL keywords with no meaning here
(n_devices, move_to_device, hf_model, first_n_layers, ...) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loaders.load import from_pretrained

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def tl_style(model: Any, default_prepend_bos: bool = True, default_padding_side: str = "right") -> Any:
    """Switch a hooked model to TL's defaults for text and hook filters (in place; returns it)."""
    if default_padding_side not in ("left", "right"):
        raise ValueError(f"default_padding_side must be 'left' or 'right', got {default_padding_side!r}")
    model.default_prepend_bos = bool(default_prepend_bos)
    model.default_padding_side = default_padding_side
    model.tl_gating = True
    return model


class HookedTransformer:
    """TL's entry points, returning hooked models with TL's defaults (see the module docstring)."""

    @staticmethod
    def from_pretrained(model_name: str | Path, fold_ln: bool = True, center_writing_weights: bool = True,
                        center_unembed: bool = True, fold_value_biases: bool = True,
                        refactor_factored_attn_matrices: bool = False, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, default_prepend_bos: bool | None = True,
                        default_padding_side: str = "right", **kwargs: Any) -> Any:
        if refactor_factored_attn_matrices:
            raise ValueError("refactor_factored_attn_matrices is not supported (hooked.tl_switches.process_weights_)")
        unknown = sorted(set(kwargs) - {"revision", "allow_pickle", "mmap", "device_map", "max_memory", "offload_folder",
                                        "torch_dtype"})
        if unknown:
            raise TypeError(f"HookedTransformer.from_pretrained: {unknown} have no meaning for hooked models "
                            "(TL's multi-device, checkpoint and conversion options); see loaders.from_pretrained")
        dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
        dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        model = from_pretrained(model_name, dtype=dtype, device=device or "cpu", fold_ln=fold_ln,
                                center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                                fold_value_biases=fold_value_biases, **kwargs)
        return tl_style(model, True if default_prepend_bos is None else default_prepend_bos, default_padding_side)

    @staticmethod
    def from_pretrained_no_processing(model_name: str | Path, **kwargs: Any) -> Any:
        flags = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
        return HookedTransformer.from_pretrained(model_name, **(flags | kwargs))
