"""Qwen3-Next (and Qwen3.5's text model): Gated DeltaNet layers and gated attention layers, dense or MoE MLPs.

Glossary (TransformerLens / hybrid names; HF Qwen3NextConfig names in brackets)
    n_layers = len(layer_types)   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types  "delta" [linear_attention] or "attention" [full_attention], one per layer
    mlp_types    "dense" or "moe" per layer [from mlp_only_layers, decoder_sparse_step, num_experts]
    delta layers: n_heads [linear_num_value_heads], n_k_heads [linear_num_key_heads], d_k
        [linear_key_head_dim], d_v [linear_value_head_dim], d_conv [linear_conv_kernel_dim]
    attention layers: n_attn_heads [num_attention_heads], n_attn_kv_heads [num_key_value_heads],
        d_attn_head [head_dim], partial_rotary [partial_rotary_factor] (rotary on the first
        int(d_attn_head * partial_rotary) features of each head), q/k norms per head, sigmoid output gate
    MLP: d_mlp [intermediate_size]; MoE: n_experts [num_experts], top_k [num_experts_per_tok],
        d_expert [moe_intermediate_size], d_shared [shared_expert_intermediate_size] (a sigmoid-gated
        shared expert), renormalise [norm_topk_prob]
    Every RMSNorm but the delta mixer's gated one is unit-offset: (1 + w) * x / rms(x).

    layer l: resid = resid + (mixer or attn)(ln1(resid));  resid = resid + mlp(ln2(resid))

Hooks: delta_mixer.py (blocks.{l}.mixer), attention.py and gated_attention.py (blocks.{l}.attn),
mlp.py, moe.py and shared_expert.py (blocks.{l}.mlp), block.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.delta_mixer import DeltaMixer, DeltaSpec
from hooked.models.gated_attention import GatedAttention
from hooked.models.hybrid import check_kinds
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.norms import UnitOffsetRMSNorm
from hooked.models.shared_expert import SigmoidGatedMLP
from hooked.ops.rotary import Rotary

LAYER_TYPES = ("delta", "attention")
MLP_TYPES = ("dense", "moe")


@dataclass(frozen=True)
class Qwen3NextConfig:
    d_model: int
    d_vocab: int
    layer_types: Sequence[str]
    n_heads: int  # value heads of the delta layers
    n_k_heads: int
    d_k: int
    d_v: int
    d_conv: int = 4
    n_attn_heads: int = 16
    n_attn_kv_heads: int = 2
    d_attn_head: int = 256
    partial_rotary: float = 0.25
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    d_mlp: int = 5632
    mlp_types: Sequence[str] = derived(lambda c: ("moe" if c.n_experts else "dense",) * len(c.layer_types))
    n_experts: int | None = None  # None: no MoE layers
    top_k: int = 10
    d_expert: int = 512
    d_shared: int = 512
    renormalise: bool = True
    act_fn: str = "silu"
    eps: float = 1e-6
    tied: bool = False
    n_ctx: int = 32768
    chunk_size: int = 64

    def __post_init__(self) -> None:
        n = len(self.layer_types)
        object.__setattr__(self, "layer_types", check_kinds("layer_types", self.layer_types, n, LAYER_TYPES))
        object.__setattr__(self, "mlp_types", check_kinds("mlp_types", self.mlp_types, n, MLP_TYPES))
        if "moe" in self.mlp_types and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"MoE layers need 0 < top_k ({self.top_k}) <= n_experts ({self.n_experts})")
        self.mixer  # validates the delta layers' sizes

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mixer(self) -> DeltaSpec:
        return DeltaSpec(self.d_model, self.n_heads, self.n_k_heads, self.d_k, self.d_v, self.d_conv, eps=self.eps,
                         chunk_size=self.chunk_size, conv_act=self.act_fn)

    @property
    def rotary(self) -> Rotary:
        return Rotary.of(int(self.d_attn_head * self.partial_rotary), self.rope_theta, self.rope_scaling)


class QwenDeltaMixer(DeltaMixer):
    """Qwen's projections: in_proj_qkv ([q | k | v], head-major), in_proj_z (the gate), in_proj_b, in_proj_a.
    (Qwen3-Next checkpoints interleave these per key head; its loader de-interleaves them.)"""

    def __init__(self, spec: DeltaSpec) -> None:
        super().__init__(spec)
        self.in_proj_qkv = nn.Linear(spec.d_model, spec.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(spec.d_model, spec.value_dim, bias=False)
        self.in_proj_b = nn.Linear(spec.d_model, spec.n_heads, bias=False)
        self.in_proj_a = nn.Linear(spec.d_model, spec.n_heads, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def input_linears(self) -> list[nn.Module]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]


def mlp(cfg: Qwen3NextConfig, kind: str) -> nn.Module:
    if kind == "dense":
        return GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
    return MoE(cfg.d_model, cfg.d_expert, cfg.n_experts, SoftmaxTopK(cfg.top_k, renormalise=cfg.renormalise),
               cfg.act_fn, shared=SigmoidGatedMLP(cfg.d_model, cfg.d_shared, cfg.act_fn))


def build(cfg: Qwen3NextConfig) -> LanguageModel:
    """Qwen3-Next / Qwen3.5 text; delta layers `blocks.{l}.mixer`, attention layers `blocks.{l}.attn`."""
    rotary, spec, d = cfg.rotary, cfg.mixer, cfg.d_model
    blocks = []
    for kind, mlp_kind in zip(cfg.layer_types, cfg.mlp_types):
        if kind == "attention":
            first = Sublayer("attn", UnitOffsetRMSNorm(d, cfg.eps), GatedAttention(
                d, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head, qkv_bias=cfg.attention_bias,
                o_bias=cfg.attention_bias, rotary=rotary, q_norm=UnitOffsetRMSNorm(cfg.d_attn_head, cfg.eps),
                k_norm=UnitOffsetRMSNorm(cfg.d_attn_head, cfg.eps)))
        else:
            first = Sublayer("mixer", UnitOffsetRMSNorm(d, cfg.eps), QwenDeltaMixer(spec))
        blocks.append(ResidualBlock([first, Sublayer("mlp", UnitOffsetRMSNorm(d, cfg.eps), mlp(cfg, mlp_kind))]))
    return LanguageModel(cfg, blocks, UnitOffsetRMSNorm(d, cfg.eps))
