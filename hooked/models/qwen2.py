"""Qwen2 (and Qwen2.5): Llama with biases on q, k and v (not o), and optional sliding-window layers.

Glossary (TransformerLens names; HF Qwen2Config names in brackets): as llama.py, plus
    qkv_bias                            q_proj, k_proj, v_proj have biases, o_proj has none (Qwen2's
                                        fixed layout; `attention_bias` would put one on o_proj too)
    sliding_window [sliding_window]     W: a query on a sliding layer reads itself and the W - 1
                                        tokens before it
    layer_types [layer_types]           per layer "full_attention" or "sliding_attention"; HF derives
                                        it from use_sliding_window and max_window_layers (layers
                                        l >= max_window_layers slide); None: every layer full

    resid_0 = W_E[token]                                       hook_embed
    resid   = resid + attn(ln1(resid))   (q, k, v biased; windowed on sliding layers)
    resid   = resid + mlp(ln2(resid))    (SwiGLU)
    logits  = ln_final(resid) @ W_U^T

Hooks are Llama's (attention.py, mlp.py). On a sliding layer hook_pattern is zero outside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.llama import LlamaConfig
from hooked.models.windows import check_layer_types, layer_window


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True  # type: ignore[assignment]  (a field here, a property of LlamaConfig)
    sliding_window: int | None = None  # W, used by the "sliding_attention" layers
    layer_types: tuple[str, ...] | None = None  # None: every layer "full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self.layer_types, self.n_layers, self.sliding_window)

    def window(self, layer: int) -> int | None:
        return layer_window(self.layer_types, self.sliding_window, layer)
