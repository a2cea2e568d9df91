"""MiniMax-01 (MiniMax-Text-01): lightning attention in most layers, softmax attention in the others, MoE MLPs.

Glossary (TransformerLens names; HF MiniMaxConfig names in brackets): mixtral.py's, plus
    layer_types [layer_types]  "lightning" [linear_attention] or "attention" [full_attention] per layer;
                               HF's default alternates, attention first
    block_size [block_size]    positions per block of the lightning recurrence's chunked form
    attn_alpha, attn_beta      [full_attn_alpha_factor, full_attn_beta_factor]: the softmax layers' step
    lightning_alpha, lightning_beta  [linear_attn_alpha_factor, linear_attn_beta_factor]: the lightning layers'
    mlp_alpha, mlp_beta        [mlp_alpha_factor, mlp_beta_factor]

    layer l:  x = ln1(resid);  resid = alpha * x + beta * (attn or mixer)(x)     (norm_residual.py)
              x = ln2(resid);  resid = mlp_alpha * x + mlp_beta * MoE(x)
    lightning layers: blocks.{l}.mixer (lightning.py; slopes from the layer's depth)
    softmax layers: blocks.{l}.attn (rotary GQA, optional window; attention.py)
    MoE: Mixtral's (softmax router, top-k renormalised; moe.py)

The residual stream runs through each step's norm (HF's `residual = input_layernorm(hidden_states)`), so
the blocks' writers do not sum to resid_post - resid_pre (norm_residual.py says what holds instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hooked.models.block import Sublayer
from hooked.models.hybrid import check_kinds
from hooked.models.language_model import LanguageModel
from hooked.models.lightning import LightningMixer, LightningSpec, minimax_slopes
from hooked.models.llama import attention
from hooked.models.mixtral import MixtralConfig
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.norm_residual import NormResidualBlock
from hooked.models.norms import RMSNorm

LAYER_TYPES = ("lightning", "attention")


@dataclass(frozen=True)
class MiniMaxConfig(MixtralConfig):
    layer_types: Sequence[str] = ()  # empty: HF's default, attention at even layers
    block_size: int = 256
    attn_alpha: float = 1.0
    attn_beta: float = 1.0
    lightning_alpha: float = 1.0
    lightning_beta: float = 1.0
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0
    rope_theta: float = 1e6

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = self.layer_types or tuple(LAYER_TYPES[i % 2] for i in range(1, self.n_layers + 1))
        object.__setattr__(self, "layer_types", check_kinds("layer_types", kinds, self.n_layers, LAYER_TYPES))
        for l in range(self.n_layers):
            self.lightning(l)  # validates the lightning fields

    def lightning(self, layer: int) -> LightningSpec:
        slopes = minimax_slopes(self.n_heads, layer, self.n_layers)
        return LightningSpec(self.d_model, self.n_heads, self.d_head, slopes, self.block_size, self.act_fn)


def build(cfg: MiniMaxConfig) -> LanguageModel:
    """MiniMax; lightning layers `blocks.{l}.mixer`, softmax layers `blocks.{l}.attn`, MoE `blocks.{l}.mlp`."""
    rotary = cfg.rotary
    blocks = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "lightning":
            first, alpha, beta = "mixer", cfg.lightning_alpha, cfg.lightning_beta
            module = LightningMixer(cfg.lightning(layer))
        else:
            first, alpha, beta = "attn", cfg.attn_alpha, cfg.attn_beta
            module = attention(cfg, layer, rotary)
        moe = MoE(cfg.d_model, cfg.d_mlp, cfg.n_experts, SoftmaxTopK(cfg.top_k, renormalise=True), cfg.act_fn,
                  narrow_router=True)
        blocks.append(NormResidualBlock([Sublayer(first, RMSNorm(cfg.d_model, cfg.eps), module, scale=beta),
                                         Sublayer("mlp", RMSNorm(cfg.d_model, cfg.eps), moe, scale=cfg.mlp_beta)],
                                        (alpha, cfg.mlp_alpha)))
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))
