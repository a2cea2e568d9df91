"""OLMo 3: OLMo 2 (olmo2.py) with sliding-window attention on three layers of every four and a rope per
layer kind.

Glossary (TransformerLens names; HF Olmo3Config names in brackets): as olmo2.py, plus
    sliding_window [sliding_window]   W on the "sliding_attention" layers (4096 in OLMo 3 7B / 32B)
    layer_types [layer_types]         HF's default: layer l is full when l + 1 is a multiple of 4
    rope_theta, rope_scaling          the full-attention layers' rope [rope_parameters.full_attention]
                                      (YaRN in the released long-context checkpoints; ops/rotary.py)
    rope_local_theta, rope_local_scaling   the sliding layers' [rope_parameters.sliding_attention]

    resid = resid + ln1_post(attn_W(resid)),  W = sliding_window on sliding layers, none on full ones

Hooks are OLMo 2's; on a sliding layer hook_pattern is zero outside the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hooked.models.olmo2 import Olmo2Config
from hooked.models.windows import check_layer_types, layer_window
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Olmo3Config(Olmo2Config):
    rope_theta: float = 500_000.0
    sliding_window: int | None = 4096  # W, used by the "sliding_attention" layers
    layer_types: tuple[str, ...] | None = None  # None: every layer "full_attention"
    rope_local_theta: float = 500_000.0
    rope_local_scaling: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self.layer_types, self.n_layers, self.sliding_window)

    def window(self, layer: int) -> int | None:
        return layer_window(self.layer_types, self.sliding_window, layer)

    def rotary_of(self, layer: int) -> Rotary:
        if self.window(layer) is not None:
            return Rotary.of(self.d_head, self.rope_local_theta, self.rope_local_scaling)
        return self.rotary
