"""Qwen4-Exp (text): Qwen3.5-MoE's delta and gated attention layers on hyper-connected streams, with per-layer
n-gram embeddings and QSA (top-k block) attention.

Glossary (ours; HF Qwen4ExpTextConfig names in brackets). Qwen3.5's fields as in qwen3_next.py; every MLP is
MoE with a sigmoid-gated shared expert; and
    n_streams [hc_count]   hc_rank [hc_lowrank]                      hyper_residual.py
    ple_layers [ple_layer_ids, one-indexed there, zero-indexed here]  ple_dim [ple_embed_dim]
    ple_width [ple_conv_kernel_size]  ngram_size, heads_per_ngram, ngram_base [ngram_vocab_size_base],
    ngram_divisor [make_ngram_vocab_size_divisible_by], seed, eos [eos_token_id (its first)]   ple.py
    n_idx_heads [indexer_n_heads]  d_idx [indexer_head_dim]  idx_budget [indexer_budget]
    idx_ratio [indexer_compress_ratio]                                qsa_attention.py
    gate_fn [output_gate_type, else hidden_act]  the delta mixer's output gate ("silu" or "sigmoid")

    stream_0 = [embed, .., embed]                                      (n_streams copies)
    layer l:  stream += ple(stream)              (PLE layers only)
              stream += inject_1 x (mixer or QSA attn)(read_1(stream))
              stream += inject_2 x moe(read_2(stream))
    logits   = W_U read_final(stream)                                  (no other final norm)

Hooks: hyper_residual.py (blocks, streams, ln1/ln2/ln_final reads), ple.py (blocks.{l}.ple), delta_mixer.py
(blocks.{l}.mixer), attention.py, gated_attention.py and qsa_attention.py (blocks.{l}.attn), moe.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hooked.models.block import Sublayer
from hooked.models.delta_mixer import DeltaSpec
from hooked.models.hyper_residual import HyperBlock, HyperConnection, StreamsLanguageModel
from hooked.models.language_model import LanguageModel
from hooked.models.norms import UnitOffsetRMSNorm
from hooked.models.ple import PerLayerEmbedding
from hooked.models.qsa_attention import IndexedAttention, QSAIndexer
from hooked.models.qwen3_5 import Qwen3_5Config
from hooked.models.qwen3_next import QwenDeltaMixer, mlp


@dataclass(frozen=True)
class Qwen4ExpConfig(Qwen3_5Config):
    n_streams: int = 4
    hc_rank: int = 320
    ple_layers: Sequence[int] = ()
    ple_dim: int | None = None  # None: d_model
    ple_width: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_base: int = 20_000_000
    ngram_divisor: int = 128
    seed: int = 1234
    eos: int | None = None
    n_idx_heads: int = 4
    d_idx: int = 128
    idx_budget: int = 2048
    idx_ratio: int = 64
    gate_fn: str = "silu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ple_layers", tuple(sorted(set(self.ple_layers))))
        super().__post_init__()
        if self.n_streams < 2:
            raise ValueError(f"Qwen4-Exp needs n_streams (hc_count) > 1, got {self.n_streams}")
        if set(self.mlp_types) != {"moe"}:
            raise ValueError("every Qwen4-Exp MLP is a mixture of experts (n_experts must be set)")
        bad = [l for l in self.ple_layers if not 0 <= l < self.n_layers or self.layer_types[l] != "delta"]
        if bad:
            raise ValueError(f"PLE layers [ple_layer_ids] must be delta layers in [0, {self.n_layers}), got {bad}")
        if self.ple_layers and self.eos is None:
            raise ValueError("PLE layers need eos (eos_token_id): it marks the n-grams' document boundaries")
        if self.idx_budget % self.idx_ratio:
            raise ValueError(f"QSA: idx_budget [indexer_budget] ({self.idx_budget}) must be a multiple of idx_ratio "
                             f"[indexer_compress_ratio] ({self.idx_ratio})")
        if self.rotary.d_rot > self.d_idx:
            raise ValueError(f"QSA: the attention's rotary width ({self.rotary.d_rot}) must fit an index head, d_idx "
                             f"[indexer_head_dim] ({self.d_idx})")

    @property
    def mixer(self) -> DeltaSpec:
        return replace(super().mixer, gate_fn=self.gate_fn)


def ple(cfg: Qwen4ExpConfig, layer: int) -> PerLayerEmbedding | None:
    if layer not in cfg.ple_layers:
        return None
    return PerLayerEmbedding(cfg.d_model, cfg.n_streams, cfg.d_vocab, cfg.ple_dim or cfg.d_model, cfg.ngram_size,
                             cfg.heads_per_ngram, cfg.ngram_base, cfg.ngram_divisor, cfg.seed,
                             cfg.ple_layers.index(layer), cfg.eos, cfg.ple_width, cfg.eps)


def build(cfg: Qwen4ExpConfig) -> LanguageModel:
    """Qwen4-Exp text; delta layers `blocks.{l}.mixer`, QSA attention layers `blocks.{l}.attn`."""
    rotary, d, dh = cfg.rotary, cfg.d_model, cfg.d_attn_head

    def read(combine: bool = True) -> HyperConnection:
        return HyperConnection(d, cfg.n_streams, cfg.hc_rank, cfg.eps, combine)

    blocks = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "attention":
            indexer = QSAIndexer(d, cfg.n_idx_heads, cfg.d_idx, cfg.idx_budget, cfg.idx_ratio, rotary, cfg.eps)
            first = Sublayer("attn", read(), IndexedAttention(
                d, cfg.n_attn_heads, cfg.n_attn_kv_heads, dh, indexer, qkv_bias=cfg.attention_bias,
                o_bias=cfg.attention_bias, rotary=rotary, q_norm=UnitOffsetRMSNorm(dh, cfg.eps),
                k_norm=UnitOffsetRMSNorm(dh, cfg.eps)))
        else:
            first = Sublayer("mixer", read(), QwenDeltaMixer(cfg.mixer))
        blocks.append(HyperBlock([first, Sublayer("mlp", read(), mlp(cfg, "moe"))], cfg.n_streams, d, ple(cfg, layer)))
    return StreamsLanguageModel(cfg, blocks, read(combine=False))
