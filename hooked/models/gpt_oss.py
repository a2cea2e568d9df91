"""GPT-OSS: attention with learned sinks on alternating sliding / full layers, and clamped-SwiGLU experts.

Glossary (TransformerLens names; HF GptOssConfig names in brackets): as llama.py and qwen2.py, plus
    n_experts [num_local_experts]   E (32 in gpt-oss-20b)      top_k [num_experts_per_tok]   k (4)
    d_mlp [intermediate_size]       one expert's hidden width
    sinks                           one learned softmax logit per query head (sink_attention.py)
    layer_types, sliding_window     HF's default alternates: even layers slide (W = 128), odd layers full
    attention_bias                  biases on q, k, v and o (True in every release)
    alpha, limit [swiglu_alpha, swiglu_limit]   the experts' clamped SwiGLU (clamped_moe.py)
    rope                            YaRN (factor 32 over 4096 positions; ops/rotary.py), in HF's halves
                                    pairing like Llama's

    resid = resid + attn(ln1(resid))    pattern = exp(scores) / (sum exp(scores) + exp(sink)), windowed
                                        on sliding layers: blocks.{l}.attn.hook_sink, hook_pattern
    resid = resid + moe(ln2(resid))     top-k router logits (router with a bias), softmax over the k;
                                        experts: clamped SwiGLU with biases

Hooks: block.py, attention.py + sink_attention.py, moe.py. The sink writes nothing to the residual:
its effect is inside each head's result (sink_attention.py), so the residual decomposition is Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.clamped_moe import ClampedSwiGLUMoE
from hooked.models.language_model import LanguageModel
from hooked.models.mixtral import moe_decoder
from hooked.models.moe import SoftmaxTopK
from hooked.models.qwen2 import Qwen2Config
from hooked.models.sink_attention import SinkAttention
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class GptOssConfig(Qwen2Config):
    qkv_bias: bool = False  # the biases are attention_bias's, on all four projections
    attention_bias: bool = True
    eps: float = 1e-5
    n_experts: int = 32  # E
    top_k: int = 4  # k
    alpha: float = 1.702  # swiglu_alpha
    limit: float = 7.0  # swiglu_limit

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")


def attention(cfg: GptOssConfig, layer: int, rotary: Rotary) -> SinkAttention:
    return SinkAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias, rotary=rotary, window=cfg.window(layer))


def build(cfg: GptOssConfig) -> LanguageModel:
    """GPT-OSS; blocks.{l}.attn has sinks, every blocks.{l}.mlp is a clamped-SwiGLU MoE."""
    return moe_decoder(cfg, lambda c, layer: ClampedSwiGLUMoE(c.d_model, c.d_mlp, c.n_experts,
                                                              SoftmaxTopK(c.top_k, renormalise=True), c.alpha, c.limit),
                       attention)
