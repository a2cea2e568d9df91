"""Gemma 3 (text): Gemma 2 plus per-head (1 + w) RMSNorms on q and k, a rope base per layer kind
(local layers 10k, global layers 1M, optionally scaled), and its own window pattern (five local
layers, then one global, by default). Soft-caps are off unless the config sets them.

Glossary (TransformerLens names; HF Gemma3TextConfig names in brackets): as gemma2.py, plus
    q_norm, k_norm                      UnitOffsetRMSNorm over d_head, shared by all heads [d_head]
    rope_theta, rope_scaling            rope of the "full_attention" (global) layers
                                        [rope_parameters["full_attention"]]
    rope_local_theta, rope_local_scaling  rope of the "sliding_attention" (local) layers
                                        [rope_parameters["sliding_attention"]; old configs:
                                        rope_local_base_freq]

    resid_0 = W_E[token] * sqrt(d_model)                       hook_embed
    q, k    = q_norm(q_proj(.)), k_norm(k_proj(.))             attn.q_norm.hook_normalized, k_norm.*
    q, k    = rotary_local or rotary_global (by layer kind)    attn.hook_rot_q, hook_rot_k
    the rest as Gemma 2 (post-norms, GeGLU, windows on the local layers)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hooked.models.gemma2 import Gemma2Config
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0
    rope_local_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attn_softcap: float | None = None
    final_softcap: float | None = None

    qk_norm: ClassVar[bool] = True

    def rotary_of(self, layer: int) -> Rotary:
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return Rotary.of(self.d_head, self.rope_local_theta, self.rope_local_scaling)
        return Rotary.of(self.d_head, self.rope_theta, self.rope_scaling)
