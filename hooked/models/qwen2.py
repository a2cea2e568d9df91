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

from torch import nn

from hooked.models.attention import Attention, TransformerBlock
from hooked.models.llama import Llama, LlamaConfig
from hooked.models.mlp import GatedMLP
from hooked.models.norms import RMSNorm
from hooked.models.windows import check_layer_types, layer_window
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True
    sliding_window: int | None = None  # W, used by the "sliding_attention" layers
    layer_types: tuple[str, ...] | None = None  # None: every layer "full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self.layer_types, self.n_layers, self.sliding_window)

    def window(self, layer: int) -> int | None:
        return layer_window(self.layer_types, self.sliding_window, layer)


class Qwen2(Llama):
    """Qwen2 with a hook on every quantity. Build with `Qwen2(cfg)`, load with `loaders.from_hf`."""

    def _block(self, cfg: Qwen2Config, rotary: Rotary, layer: int) -> TransformerBlock:
        mlp = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)
        return TransformerBlock(RMSNorm(cfg.d_model, cfg.eps), self._attention(cfg, rotary, layer),
                                RMSNorm(cfg.d_model, cfg.eps), mlp)

    def _attention(self, cfg: Qwen2Config, rotary: Rotary, layer: int, **parts: nn.Module) -> Attention:
        return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head,
                         qkv_bias=cfg.qkv_bias or cfg.attention_bias, o_bias=cfg.attention_bias, rotary=rotary,
                         window=cfg.window(layer), **parts)
