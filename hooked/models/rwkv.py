"""RWKV-4 (Peng et al. 2023; HF `rwkv`): a LayerNorm on the embedding, then blocks of time mixing (the WKV
recurrence, rwkv_mix.TimeMix) and channel mixing (rwkv_mix.ChannelMix), each after a LayerNorm.

Glossary (TransformerLens names; HF RwkvConfig names in brackets)
    n_layers [num_hidden_layers]   d_model [hidden_size]   d_vocab [vocab_size]
    att_width [attention_hidden_size]   the time mixing's channels (d_model when None)
    d_mlp [intermediate_size]      the channel mixing's width (4 d_model when None)
    eps [layer_norm_epsilon]       the blocks' LayerNorms and the embedding's (HF's final ln_out keeps 1e-5)
    rescale_every [rescale_every]  HF's inference rescaling, below
    n_ctx [context_length]         informational: HF's CUDA kernel's limit; the recurrence has none

    resid_0 = ln_embed(W_E[token])              hook_embed (HF's blocks[0].pre_ln, here on the embedding)
    resid   = resid + time_mix(ln1(resid))      blocks.{l}.mixer
    resid   = resid + channel_mix(ln2(resid))   blocks.{l}.mlp
    logits  = ln_final(resid) @ W_U^T           HF's head (untied by default)

HF's rescaling: in eval mode HF divides block l's output weights by 2^(l // rescale_every) and halves the
hidden state after every rescale_every-th block (float16's range). Scaling by powers of two is exact in floating
point and a LayerNorm divides it out except for its eps, so HF's eval numbers equal a stream that is NOT halved,
read by LayerNorms whose eps is eps * 4^c, c = the halvings before them. That is what is built here: the logits are
HF's eval logits (to the bit, barring overflow), writers still sum to resid_post - resid_pre, and each
hook_resid_post is HF's eval hidden state times 2^c exactly (c = (l + 1) // rescale_every; HF's train-mode
numbers are rescale_every = None).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float, Int
from torch import Tensor

from hooked.models.base import Context
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.config import derived
from hooked.models.language_model import LanguageModel
from hooked.models.norms import LayerNorm
from hooked.models.rwkv_mix import ChannelMix, TimeMix

FINAL_EPS = 1e-5  # HF's ln_out is nn.LayerNorm(hidden_size): torch's default eps, not layer_norm_epsilon


@dataclass(frozen=True)
class RWKVConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    att_width: int = derived(lambda c: c.d_model)
    d_mlp: int = derived(lambda c: 4 * c.d_model)
    eps: float = 1e-5
    rescale_every: int | None = 6  # None: no rescaling (HF's <= 0)
    tied: bool = False
    n_ctx: int = 1024

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "d_vocab", "att_width", "d_mlp"):
            if getattr(self, name) < 1:
                raise ValueError(f"RWKV's {name} must be at least 1, got {getattr(self, name)}")

    @property
    def n_heads(self) -> int:
        """For ablation an RWKV "head" is one time-mixing channel."""
        return self.att_width

    @property
    def d_head(self) -> int:
        return 1

    def halvings(self, layer: int) -> int:
        """c: how often HF's eval mode has halved the stream before block `layer` reads it (n_layers: ln_final)."""
        return layer // self.rescale_every if self.rescale_every is not None else 0


class RWKVModel(LanguageModel):
    """LanguageModel whose embedding is normalised before it enters the stream (HF's blocks[0].pre_ln)."""

    def __init__(self, cfg: RWKVConfig, blocks: list[ResidualBlock], final_norm: LayerNorm, embed_norm: LayerNorm) -> None:
        super().__init__(cfg, blocks, final_norm)
        self.ln_embed = embed_norm
        self.setup()  # name the new norm's hooks

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_embed(self.ln_embed(self.embed(tokens)))


def build(cfg: RWKVConfig) -> RWKVModel:
    """RWKV-4 with a hook on every quantity; time mixing `blocks.{l}.mixer`, channel mixing `blocks.{l}.mlp`."""
    def norm(layer: int) -> LayerNorm:
        return LayerNorm(cfg.d_model, cfg.eps * 4.0 ** cfg.halvings(layer))

    blocks = [ResidualBlock([Sublayer("mixer", norm(l), TimeMix(cfg.d_model, cfg.att_width)),
                             Sublayer("mlp", norm(l), ChannelMix(cfg.d_model, cfg.d_mlp))])
              for l in range(cfg.n_layers)]
    final = LayerNorm(cfg.d_model, FINAL_EPS * 4.0 ** cfg.halvings(cfg.n_layers))
    return RWKVModel(cfg, blocks, final, LayerNorm(cfg.d_model, cfg.eps))
