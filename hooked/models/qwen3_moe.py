"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorms) with a mixture of SwiGLU experts as the MLP.

Glossary (TransformerLens names; HF Qwen3MoeConfig names in brackets): as qwen3.py, plus
    n_experts [num_experts]   E          top_k [num_experts_per_tok]   k
    d_expert [moe_intermediate_size]     one expert's hidden width
    d_mlp [intermediate_size]            the dense MLP's width, on the layers that have one
    renormalise [norm_topk_prob]         divide the k chosen probabilities by their sum (True in
                                         Qwen3-30B-A3B); False: keep softmax-over-all-E weights
    mlp_types                            "moe" or "dense" per layer [moe iff l not in mlp_only_layers
                                         and (l + 1) % decoder_sparse_step == 0]; None: every layer MoE
    sliding_window                       with use_sliding_window, every layer's window (HF reads one
                                         value for all layers): layer_types all "sliding_attention"

    resid = resid + attn(ln1(resid))      q, k = q_norm(q), k_norm(k) per head, then rotary
    resid = resid + mlp(ln2(resid))       MoE: top-k of softmax(router(x)) (moe.py), or a dense SwiGLU

Hooks: block.py, attention.py, mlp.py (dense layers), moe.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hooked.models.language_model import LanguageModel
from hooked.models.mixtral import moe_decoder
from hooked.models.mlp import GatedMLP
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.models.qwen3 import Qwen3Config


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    n_experts: int = 128  # E
    top_k: int = 8  # k
    d_expert: int = 768
    renormalise: bool = False  # norm_topk_prob
    mlp_types: Sequence[str] | None = None  # "moe" / "dense" per layer; None: all "moe"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_types is not None:
            object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
            if len(self.mlp_types) != self.n_layers or set(self.mlp_types) - {"moe", "dense"}:
                raise ValueError(f"mlp_types must give 'moe' or 'dense' for each of {self.n_layers} layers, "
                                 f"got {self.mlp_types}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")

    def mlp_type(self, layer: int) -> str:
        return "moe" if self.mlp_types is None else self.mlp_types[layer]


def mlp(cfg: Qwen3MoeConfig, layer: int) -> nn.Module:
    if cfg.mlp_type(layer) == "dense":
        return GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
    return MoE(cfg.d_model, cfg.d_expert, cfg.n_experts, SoftmaxTopK(cfg.top_k, cfg.renormalise), cfg.act_fn,
               narrow_router=True)


def build(cfg: Qwen3MoeConfig) -> LanguageModel:
    """Qwen3-MoE; blocks.{l}.mlp is a MoE (or, on mlp_types' "dense" layers, a SwiGLU MLP)."""
    return moe_decoder(cfg, mlp)
