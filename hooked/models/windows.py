"""Per-layer sliding windows as HF configures them (Qwen2/3, Gemma 2/3): `layer_types` + `sliding_window`.

Glossary
    layer_types     one entry per layer: "full_attention" (causal) or "sliding_attention" (causal and
                    within the window); None: every layer full
    sliding_window  W: on a sliding layer a query reads itself and the W - 1 tokens before it
    window(l)       W on a sliding layer, None on a full one: what `Attention(window=...)` takes
"""

from __future__ import annotations

LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(layer_types: tuple[str, ...] | None, n_layers: int, sliding_window: int | None) -> None:
    """Raise naming the problem when `layer_types` does not fit the model."""
    if layer_types is None:
        return
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unknown layer types {unknown}; supported: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError("layer_types has sliding layers but sliding_window is None")


def layer_window(layer_types: tuple[str, ...] | None, sliding_window: int | None, layer: int) -> int | None:
    """The window of `layer`: sliding_window on a "sliding_attention" layer, else None (full)."""
    sliding = layer_types is not None and layer_types[layer] == "sliding_attention"
    return sliding_window if sliding else None
