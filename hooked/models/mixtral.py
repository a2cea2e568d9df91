"""Mixtral: Mistral's attention with a mixture of SwiGLU experts as every layer's MLP.

Glossary (TransformerLens names; HF MixtralConfig names in brackets): as llama.py and mistral.py, plus
    n_experts [num_local_experts]   E, experts per layer
    top_k [num_experts_per_tok]     k, experts each token runs
    d_mlp [intermediate_size]       one expert's hidden width
    sliding_window                  None in every released Mixtral (HF's default): full causal

    resid = resid + attn(ln1(resid))                        (rotary GQA, optional window)
    resid = resid + sum_k w_k * expert_{chosen_k}(ln2(resid))   blocks.{l}.mlp.* (moe.py)
    chosen = top-k of softmax(router(x)); w = their probabilities divided by their sum (HF's router)
           = softmax over the k chosen logits (moe.py's SoftmaxTopK(renormalise=True))

`moe_decoder` builds any pre-norm decoder whose MLP is given per layer (Mixtral, Qwen3-MoE, OLMoE,
GPT-OSS). Hooks: block.py, attention.py, moe.py (hook_router_logits, hook_chosen,
hook_routing_weights, hook_expert_out, hook_routed_out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.language_model import LanguageModel
from hooked.models.llama import attention
from hooked.models.mistral import MistralConfig
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.norms import RMSNorm


@dataclass(frozen=True)
class MixtralConfig(MistralConfig):
    sliding_window: int | None = None  # W; None: full causal attention
    n_experts: int = 8  # E
    top_k: int = 2  # k

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")


def moe_decoder(cfg: Any, mlp: Callable[[Any, int], nn.Module],
                attn: Callable[[Any, int, Any], nn.Module] = attention) -> LanguageModel:
    """Pre-RMSNorm blocks: attn(cfg, layer, rotary), then mlp(cfg, layer); a final RMSNorm."""
    rotary = cfg.rotary
    blocks = [ResidualBlock([
        Sublayer("attn", RMSNorm(cfg.d_model, cfg.eps), attn(cfg, layer, rotary)),
        Sublayer("mlp", RMSNorm(cfg.d_model, cfg.eps), mlp(cfg, layer)),
    ]) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps))


def build(cfg: MixtralConfig) -> LanguageModel:
    """Mixtral; every blocks.{l}.mlp is a MoE of n_experts SwiGLU experts."""
    return moe_decoder(cfg, lambda c, layer: MoE(c.d_model, c.d_mlp, c.n_experts, SoftmaxTopK(c.top_k, renormalise=True),
                                                 c.act_fn, narrow_router=True))
