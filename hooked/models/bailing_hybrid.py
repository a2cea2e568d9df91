"""Bailing-hybrid (inclusionAI's Ling/Ring linear models): KDA layers, MLA layers with a head gate, DeepSeek-V3 MoE.

Glossary (TransformerLens / hybrid names; HF BailingHybridConfig names in brackets)
    n_layers = len(layer_types)   d_model [hidden_size]   d_vocab [vocab_size]
    layer_types  "delta" [linear_attention] or "attention" [full_attention]; HF's default puts attention at
                 every layer_group_size-th layer
    mlp_types    "dense" or "moe" [mlp_layer_types: dense / sparse; default dense below first_k_dense_replace]
    KDA layers (delta_mixer.py): n_heads [linear_num_heads], d_k = d_v [linear_head_dim], d_conv
        [linear_conv_kernel_dim]; full-rank q/k/v/b/f/g projections; the decay per key channel, with
        f = f_proj(x) + dt_bias:  safe_gate [kda_safe_gate]: alpha = exp(lower_bound * sigmoid(exp(A_log) f))
        ([kda_lower_bound]); otherwise alpha = exp(-exp(A_log) softplus(f)) (Kimi's); output norm gated by sigmoid
    MLA layers (latent_attention.py): n_attn_heads [num_attention_heads], d_nope [qk_nope_head_dim], d_rope
        [qk_rope_head_dim], d_attn_head [v_head_dim], kv_rank [kv_lora_rank], q_rank [q_lora_rank]; rotary on the
        d_rope parts (rope_theta); each head's z times sigmoid(g_proj(x))[head] before o_proj (hook_gate
        [batch pos n_heads], before the sigmoid)
    MLP: d_mlp [intermediate_size]; MoE (kimi_linear.py's): n_experts [num_local_experts], top_k, d_expert
        [moe_intermediate_size], n_shared [n_shared_experts], n_group, topk_group, renormalise [norm_topk_prob],
        routed_scaling [routed_scaling_factor]
    eps [rms_norm_eps]: every RMSNorm and the KDA output norm

    layer l: resid = resid + (mixer or attn)(ln1(resid));  resid = resid + mlp(ln2(resid))

HF rotates the d_rope features as interleaved pairs (x0, x1), (x2, x3), ...; the loader reorders those
rows of q_proj and kv_a_proj to [even | odd], where rotate_half's pairing gives HF's result: hook_q, hook_k,
hook_k_rope hold the rope features in that order (hook_rot_q / hook_rot_k equal HF's rotated tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.config import derived
from hooked.models.delta_mixer import DeltaMixer, DeltaSpec
from hooked.models.kimi_linear import KimiLinearConfig, kda_model
from hooked.models.language_model import LanguageModel
from hooked.models.latent_attention import LatentAttention
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class BailingHybridConfig(KimiLinearConfig):
    """Kimi Linear's fields (kimi_linear.py) with Bailing's defaults, the safe gate and MLA's rotary."""

    safe_gate: bool = True
    lower_bound: float = -5.0
    rope_theta: float = 6e6
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    mlp_types: Sequence[str] = derived(lambda c: ("dense",) * 2 + ("moe",) * (len(c.layer_types) - 2))
    n_experts: int = 512
    d_expert: int = 768
    n_group: int = 8
    topk_group: int = 4
    routed_scaling: float = 2.5
    eps: float = 1e-6
    n_ctx: int = 262144


class BailingDeltaMixer(DeltaMixer):
    """KDA with full-rank projections q/k/v/b/f/g_proj and, with safe_gate, the bounded decay
    alpha = exp(lower_bound * sigmoid(exp(A_log) (f + dt_bias)))."""

    def __init__(self, spec: DeltaSpec, safe_gate: bool, lower_bound: float) -> None:
        super().__init__(spec)
        d, width = spec.d_model, spec.value_dim
        self.safe_gate, self.lower_bound = safe_gate, float(lower_bound)
        self.q_proj, self.k_proj = nn.Linear(d, spec.key_dim, bias=False), nn.Linear(d, spec.key_dim, bias=False)
        self.v_proj, self.b_proj = nn.Linear(d, width, bias=False), nn.Linear(d, spec.n_heads, bias=False)
        self.f_proj, self.g_proj = nn.Linear(d, width, bias=False), nn.Linear(d, width, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv, self.g_proj(x), self.b_proj(x), self.f_proj(x)

    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_proj, self.g_proj]

    def decay(self, a: Tensor, dtype: torch.dtype) -> Tensor:
        if not self.safe_gate:
            return super().decay(a, dtype)
        f = (a.to(dtype) + self.dt_bias.to(dtype)).unflatten(-1, (self.spec.n_heads, self.spec.d_k))
        return torch.exp(self.lower_bound * torch.sigmoid(torch.exp(self.A_log.to(dtype))[:, None] * f))

    def decay_norms(self) -> Float[Tensor, "n_heads"]:
        """The decay summed over the state's rows at f = 1 (the safe gate's; Kimi's rule otherwise)."""
        if not self.safe_gate:
            return super().decay_norms()
        return torch.exp(self.lower_bound * torch.sigmoid(torch.exp(self.A_log.double()))) * self.spec.d_k


class HeadGatedLatentAttention(LatentAttention):
    """MLA whose heads' z are multiplied by sigmoid(g_proj(x)), one scalar per head and position."""

    def __init__(self, d_model: int, n_heads: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(d_model, n_heads, *args, **kwargs)
        self.g_proj = nn.Linear(d_model, n_heads, bias=False)
        self.hook_gate = HookPoint("batch pos n_heads")  # before the sigmoid

    def gate_heads(self, z: Float[Tensor, "batch pos n_heads d_head"],
                   x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos n_heads d_head"]:
        return self.unit_inputs(z, self.hook_gate(self.g_proj(x)))

    def write_reads(self) -> tuple[HookPoint, ...]:
        return (self.hook_z, self.hook_gate)

    def unit_inputs(self, z: Float[Tensor, "*batch pos n_heads d_head"],
                    gate: Float[Tensor, "*batch pos n_heads"]) -> Float[Tensor, "*batch pos n_heads d_head"]:
        """What each head gives o_proj: z times the sigmoid of its gate (in float32 or wider, as HF)."""
        return z * torch.sigmoid(gate.to(torch.promote_types(gate.dtype, torch.float32))).to(z.dtype)[..., None]

    def input_linears(self) -> list[nn.Module]:
        return [*super().input_linears(), self.g_proj]


def build(cfg: BailingHybridConfig) -> LanguageModel:
    """Bailing-hybrid; KDA layers `blocks.{l}.mixer`, MLA layers `blocks.{l}.attn`."""
    rotary = Rotary.of(cfg.d_rope, cfg.rope_theta, cfg.rope_scaling)
    return kda_model(cfg, lambda: BailingDeltaMixer(cfg.mixer, cfg.safe_gate, cfg.lower_bound),
                     lambda: HeadGatedLatentAttention(cfg.d_model, cfg.n_attn_heads, cfg.d_nope, cfg.d_rope,
                                                      cfg.d_attn_head, cfg.kv_rank, cfg.q_rank, rotary=rotary,
                                                      bias=cfg.attention_bias))
