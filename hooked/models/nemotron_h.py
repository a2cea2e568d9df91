"""NemotronH (NVIDIA Nemotron-H, Nemotron 3): one mixer per layer, Mamba-2, attention, MLP or MoE, by a pattern.

Glossary (TransformerLens / SSM names; HF NemotronHConfig names in brackets)
    n_layers = len(layer_types)  d_model [hidden_size]  d_vocab [vocab_size]
    layer_types  one per layer: "mamba" [linear_attention, "M"], "attention" [full_attention, "*"],
                 "mlp" ["-"], "moe" [E]; `pattern` is the HF hybrid_override_pattern string ("M-M*-ME")
    Mamba-2 layers: n_heads [mamba_num_heads], d_head [mamba_head_dim], d_inner = n_heads * d_head,
        d_state [ssm_state_size], n_groups, d_conv [conv_kernel], chunk_size,
        dt_limit = (time_step_min, inf) (HF ignores time_step_limit), conv_bias [use_conv_bias],
        proj_bias [use_bias] (in_proj and out_proj)
    attention layers: n_attn_heads, n_attn_kv_heads, d_attn_head [head_dim]; no positional encoding,
        no biases
    mlp layers: down(act(up(x))), d_mlp [intermediate_size], act_fn [mlp_hidden_act: relu2 = ReLU^2], mlp_bias
    moe layers: moe.py's MoE with plain (non-gated) experts of width d_expert [moe_intermediate_size],
        SigmoidTopK routing (n_experts [n_routed_experts], top_k [num_experts_per_tok], n_group,
        topk_group, renormalise [norm_topk_prob], scaling [routed_scaling_factor]) and a shared plain
        MLP of width d_shared [moe_shared_expert_intermediate_size]

    layer l: resid = resid + sublayer_l(ln1(resid))     sublayer = mixer | attn | mlp (MLP or MoE)

Hooks: block.py (blocks.{l}.hook_{mixer|attn|mlp}_out), mamba2.py, attention.py, mlp.py, moe.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hooked.models.config import derived
from hooked.models.hybrid import hybrid_attention, pre_norm_block
from hooked.models.language_model import LanguageModel
from hooked.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hooked.models.mlp import MLP
from hooked.models.moe import MoE, SigmoidTopK
from hooked.models.norms import RMSNorm

PATTERN = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


@dataclass(frozen=True)
class NemotronHConfig:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]  # "mamba", "attention", "mlp", "moe" (stored as a tuple)
    n_heads: int  # H, SSM heads
    d_head: int  # P
    d_state: int = 128
    n_groups: int = 8
    d_conv: int = 4
    chunk_size: int = 128
    dt_limit: tuple[float, float] = (0.001, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    n_attn_heads: int = 32
    n_attn_kv_heads: int = derived(lambda c: c.n_attn_heads)
    d_attn_head: int = 128
    d_mlp: int = 21504
    mlp_bias: bool = False
    act_fn: str = "relu2"
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 7688
    d_shared: int = 7688
    n_group: int = 1
    topk_group: int = 1
    renormalise: bool = True
    routed_scaling: float = 1.0
    eps: float = 1e-5
    tied: bool = False
    n_ctx: int = 4096

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        put("layer_types", tuple(self.layer_types))
        put("dt_limit", (float(self.dt_limit[0]), float(self.dt_limit[1])))
        bad = sorted(set(self.layer_types) - set(PATTERN))
        if bad or not self.layer_types:
            raise ValueError(f"layer_types must be a non-empty list from {tuple(PATTERN)}; unknown: {bad}")
        if "moe" in self.layer_types and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")

    @property
    def mixer(self) -> Mamba2Spec:
        return Mamba2Spec.of(self)

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.d_head

    @property
    def pattern(self) -> str:
        """HF's hybrid_override_pattern: M (Mamba-2), * (attention), - (MLP), E (MoE)."""
        return "".join(PATTERN[k] for k in self.layer_types)

    @staticmethod
    def layer_types_of(pattern: str) -> tuple[str, ...]:
        inverse = {v: k for k, v in PATTERN.items()}
        bad = sorted(set(pattern) - set(inverse))
        if bad:
            raise ValueError(f"pattern {pattern!r} has unknown symbols {bad}; known: M * - E")
        return tuple(inverse[c] for c in pattern)


def sublayer(cfg: NemotronHConfig, kind: str) -> tuple[str, nn.Module]:
    """Layer kind -> (sublayer kind, module)."""
    if kind == "mamba":
        return "mixer", Mamba2Mixer(cfg.mixer)
    if kind == "attention":
        return "attn", hybrid_attention(cfg)
    if kind == "mlp":
        return "mlp", MLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias)
    select = SigmoidTopK(cfg.n_experts, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.renormalise, cfg.routed_scaling)
    shared = MLP(cfg.d_model, cfg.d_shared, cfg.act_fn, bias=cfg.mlp_bias)
    return "mlp", MoE(cfg.d_model, cfg.d_expert, cfg.n_experts, select, cfg.act_fn, gated=False, shared=shared)


def build(cfg: NemotronHConfig) -> LanguageModel:
    """NemotronH; layer l's one sublayer is `blocks.{l}.mixer`, `.attn` or `.mlp` (an MLP or a MoE)."""
    blocks = [pre_norm_block(cfg.d_model, cfg.eps, sublayer(cfg, kind)) for kind in cfg.layer_types]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
