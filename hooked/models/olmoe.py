"""OLMoE: Llama's layout with q/k RMSNorms over all heads together and a mixture of SwiGLU experts.

Glossary (TransformerLens names; HF OlmoeConfig names in brackets): as llama.py, plus
    n_experts [num_experts]   E (64 in OLMoE-1B-7B)      top_k [num_experts_per_tok]   k (8)
    d_mlp [intermediate_size]  one expert's hidden width
    renormalise [norm_topk_prob]  divide the k chosen probabilities by their sum (False in OLMoE-1B-7B)
    q_norm, k_norm            RMSNorms over the whole projection (n_heads * d_head, n_kv_heads * d_head:
                              heads_norm.py), before rotary; not per head as Qwen3's
    clip_qkv                  HF's optional clamp of q, k, v: None in the released checkpoints; a
                              config with a value is refused by the loader

    q, k  = q_norm(q_proj(x)), k_norm(k_proj(x))    blocks.{l}.attn.q_norm.hook_normalized, k_norm.*
    resid = resid + attn(ln1(resid));  resid = resid + moe(ln2(resid))   (moe.py: top-k of softmax)

Hooks: block.py, attention.py, heads_norm.py, moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.attention import Attention
from hooked.models.heads_norm import HeadsRMSNorm
from hooked.models.language_model import LanguageModel
from hooked.models.llama import LlamaConfig
from hooked.models.mixtral import moe_decoder
from hooked.models.moe import MoE, SoftmaxTopK
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class OlmoeConfig(LlamaConfig):
    eps: float = 1e-5
    n_experts: int = 64  # E
    top_k: int = 8  # k
    renormalise: bool = False  # norm_topk_prob

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")


def attention(cfg: OlmoeConfig, layer: int, rotary: Rotary) -> Attention:
    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                     o_bias=cfg.attention_bias, rotary=rotary, q_norm=HeadsRMSNorm(cfg.n_heads, cfg.d_head, cfg.eps),
                     k_norm=HeadsRMSNorm(cfg.n_kv_heads, cfg.d_head, cfg.eps))


def build(cfg: OlmoeConfig) -> LanguageModel:
    """OLMoE; every blocks.{l}.mlp is a MoE of n_experts SwiGLU experts."""
    return moe_decoder(cfg, lambda c, layer: MoE(c.d_model, c.d_mlp, c.n_experts, SoftmaxTopK(c.top_k, c.renormalise),
                                                 c.act_fn, narrow_router=True), attention)
