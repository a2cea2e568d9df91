"""The one root model every family builds: embed -> residual blocks -> final norm -> unembed.

    resid_0 = embedding_multiplier * W_E[token] (+ W_pos[position])   hook_embed (hook_pos_embed)
    resid   = block_l(resid)                                           blocks.{l}.* (block.py)
    logits  = softcap(logit_multiplier * ln_final(resid) @ W_U^T)      ln_final.hook_normalized

Glossary
    embedding_multiplier  Gemma's sqrt(d_model), Granite's / Falcon-H1's muP scale; 1 elsewhere
    round_multiplier      multiply by the multiplier rounded to the weights' dtype, as HF's Gemma does
                          (sqrt(3072) = 55.43 becomes 55.5 in bf16)
    pos_embed             learned absolute positions (GPT-2), with their n_ctx limit
    logit_multiplier, final_softcap   on the logits (Granite / Falcon-H1; Gemma 2)
    tied                  W_U is W_E (no parameter of its own)

A block that reads the token embedding (`block.reads_embedding`, Zamba2's shared transformer) gets
it as `ctx.embedding`: the embedding as hooked (a copy), or, when a run starts at a later layer,
the embedding of `tokens=` recomputed without hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context, HookedModel
from hooked.models.decode_state import DecodeState
from hooked.models.embed import Embed, PosEmbed, Unembed


class LanguageModel(HookedModel):
    """A family's model: built by its `build(cfg)` from shared parts (block.py, attention.py, ...)."""

    def __init__(self, cfg: Any, blocks: Sequence[nn.Module], final_norm: nn.Module, *,
                 embedding_multiplier: float = 1.0, round_multiplier: bool = False, pos_embed: bool = False,
                 logit_multiplier: float = 1.0, final_softcap: float | None = None,
                 embed_init_std: float | None = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding_multiplier = float(embedding_multiplier)
        self.round_multiplier = round_multiplier
        self.embed = Embed(cfg.d_vocab, cfg.d_model)
        if embed_init_std is not None:  # None: torch's N(0, 1), as the Mamba reference initialises it
            nn.init.normal_(self.embed.weight, std=embed_init_std)
        self.hook_embed = HookPoint("batch pos d_model")  # after the embedding multiplier
        if pos_embed:
            self.pos_embed = PosEmbed(cfg.n_ctx, cfg.d_model)
            nn.init.normal_(self.pos_embed.weight, std=0.01)
            self.hook_pos_embed = HookPoint("batch pos d_model")
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = final_norm
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, tied_to=self.embed if cfg.tied else None,
                               scale=logit_multiplier, softcap=final_softcap)
        self.reads_embedding = any(getattr(b, "reads_embedding", False) for b in self.blocks)
        self.setup()

    @property
    def family(self) -> str:
        """The family's name, from its config class ("Llama" for LlamaConfig, "Mamba2", "Zamba2", ...)."""
        return type(self.__dict__["_raw_cfg"]).__name__.removesuffix("Config")

    def make_context(self, shape: tuple[int, int] | torch.Size, attention_mask: Tensor | None,
                     tokens: Tensor | None, device: torch.device, state: DecodeState | None = None) -> Context:
        """The base Context, plus the token embedding when a block reads it (and tokens are known)."""
        if tokens is not None and tuple(tokens.shape) != (int(shape[0]), int(shape[1])):
            raise ValueError(f"tokens have shape {tuple(tokens.shape)}, the residual is {tuple(shape[:2])}")
        ctx = super().make_context(shape, attention_mask, tokens, device, state)
        if self.reads_embedding and tokens is not None:
            ctx.embedding = self._scaled(self.embed(tokens.to(device)))
        return ctx

    def _scaled(self, embed: Tensor) -> Tensor:
        m = self.embedding_multiplier
        if m == 1.0:
            return embed
        if self.round_multiplier:
            return embed * torch.tensor(m).to(self.embed.weight.dtype)
        return embed * m

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        if hasattr(self, "pos_embed"):
            past = ctx.state.length if ctx.state is not None else 0
            if past + tokens.shape[1] > self.cfg.n_ctx:
                raise ValueError(f"sequence of {past + tokens.shape[1]} tokens is longer than the model's "
                                 f"n_ctx={self.cfg.n_ctx} (learned positions)")
        embed = ctx.embedding if ctx.embedding is not None else self._scaled(self.embed(tokens))
        embed = self.hook_embed(embed)
        if self.reads_embedding:
            ctx.embedding = embed.clone()  # as hooked; a copy, so in-place edits of the residual leave it alone
        if not hasattr(self, "pos_embed"):
            return embed
        pos_embed = self.hook_pos_embed(self.pos_embed(ctx.position_ids))
        return embed + pos_embed

    def extra_repr(self) -> str:
        parts = [f"family={self.family}"]
        if self.embedding_multiplier != 1.0:
            parts.append(f"embedding_multiplier={self.embedding_multiplier:g}")
        return ", ".join(parts)
