"""xLSTM (Beck et al. 2024; NX-AI's xLSTM-7B): pre-norm residual blocks of an mLSTM layer and a SwiGLU
feed-forward, soft-capped logits.

Glossary (TransformerLens names; HF xLSTMConfig names in brackets)
    n_layers [num_hidden_layers = num_blocks]   d_model [hidden_size = embedding_dim]   d_vocab [vocab_size]
    n_heads [num_heads]            the mLSTM heads
    d_qk, d_v                      a head's query/key and value widths: int(hidden_size * qk_dim_factor) and
                                   int(hidden_size * v_dim_factor) [qk_dim_factor, v_dim_factor] over n_heads
    d_mlp                          round_up(hidden_size * ffn_proj_factor, ffn_round_up_to_multiple_of)
    gate_soft_cap [gate_soft_cap]  on the input and forget gates' preactivations
    final_softcap [output_logit_soft_cap]   logits = cap * tanh(logits / cap)
    eps [norm_eps]                 every norm's (the blocks' RMSNorms, the head norm, the final norm)
    cell_eps [eps]                 the mLSTM's, in its denominator N_t (mlstm.py)
    chunk_size [chunk_size]        positions per chunk of the chunkwise recurrence

    resid = W_E[token]                                  hook_embed
    resid = resid + mLSTM(ln1(resid))                   blocks.{l}.mixer (mlstm.py; HF norm_mlstm, mlstm_layer)
    resid = resid + ffn(ln2(resid))                     blocks.{l}.mlp: down(SiLU(gate(x)) * up(x)) (HF norm_ffn,
                                                        ffn.proj_up_gate, proj_up, proj_down)
    logits = softcap(ln_final(resid) @ W_U^T)           HF out_norm, lm_head
"""

from __future__ import annotations

from dataclasses import dataclass

from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.language_model import LanguageModel
from hooked.models.mlp import GatedMLP
from hooked.models.mlstm import MLSTMMixer, MLSTMSpec
from hooked.models.norms import RMSNorm


@dataclass(frozen=True)
class XLSTMConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    n_heads: int
    d_qk: int  # per head
    d_v: int  # per head
    d_mlp: int
    gate_soft_cap: float | None = 15.0
    final_softcap: float | None = 30.0
    eps: float = 1e-6
    cell_eps: float = 1e-6
    chunk_size: int = 64
    tied: bool = False
    n_ctx: int = 2048  # informational: the recurrence has no position limit

    def __post_init__(self) -> None:
        self.mlstm()  # validates the mixer's fields

    @property
    def d_head(self) -> int:
        return self.d_v

    def mlstm(self) -> MLSTMSpec:
        return MLSTMSpec(self.d_model, self.n_heads, self.d_qk, self.d_v, self.gate_soft_cap, self.cell_eps,
                         self.eps, self.chunk_size)


def build(cfg: XLSTMConfig) -> LanguageModel:
    """xLSTM with a hook on every quantity; the mLSTM layers `blocks.{l}.mixer`, the feed-forwards `blocks.{l}.mlp`."""
    blocks = [ResidualBlock([Sublayer("mixer", RMSNorm(cfg.d_model, cfg.eps), MLSTMMixer(cfg.mlstm())),
                             Sublayer("mlp", RMSNorm(cfg.d_model, cfg.eps), GatedMLP(cfg.d_model, cfg.d_mlp, "silu"))])
              for _ in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, RMSNorm(cfg.d_model, cfg.eps), final_softcap=cfg.final_softcap)
