"""Per-layer embeddings (Qwen4-Exp's PLE, HF Qwen4ExpTextPLELayer): hashed n-gram embeddings of the tokens, gated by
each hyper-connection stream and added to it, with a dilated short conv of their own.

Glossary
    e        [batch pos ple_dim]   the n-gram embedding: one row of each head's table (ops/ngram_hash.py), concatenated
    key_s    rmsnorm_s(key_proj(e))   one key per stream s [d_model];  value = value_proj(e) [d_model]
    query_s  rmsnorm_s(stream)        the stream itself, normalised per stream (grouped_norm.py)
    gate_s   g / sqrt(|g|) with g = key_s . query_s / sqrt(d_model)  (sign kept; |g| floored at 1e-6)
    written  sigmoid(gate_s) * value in every stream s                [batch pos d_stream]
    out      written + silu(conv(rmsnorm_s(written)))                conv: depthwise, causal, width K, dilation N

Padding positions read as eos and are zeroed before the conv (as HF's conv mask), so a left-padded row
equals its prompt alone. While decoding, the state keeps the last N - 1 tokens (the n-gram context) and
the last (K - 1) * N conv inputs.

For the analyses PLE is a writer of kind "ple" (hyper_residual.py), not a token mixer: its output is one
component of the residual decompositions and one circuit node ("ple{l}"), but knockout does not cut what it moves
between positions (the n-gram context reads token ids; the conv reads the gated values of positions t - N k, and
so, through each one's gate, the streams there).

Hooks under blocks.{l}.ple.: hook_embed [batch pos ple_dim], hook_gate [batch pos n_streams] (before the
sigmoid), hook_written [batch pos d_stream], hook_conv [batch pos d_stream] (after the SiLU); the block
adds the output as blocks.{l}.hook_ple_out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context
from hooked.models.decode_state import stepping_state
from hooked.models.grouped_norm import GroupedRMSNorm
from hooked.ops import ngram_hash


class NGramEmbedding(nn.Module):
    """Rows of the concatenated hashed tables for each position's n-grams of orders 2..N."""

    def __init__(self, d_vocab: int, dim: int, ngram_size: int, heads_per_ngram: int, base: int, divisor: int,
                 seed: int, ple_index: int, eos: int) -> None:
        super().__init__()
        n_heads = (ngram_size - 1) * heads_per_ngram
        if n_heads < 1 or dim % n_heads:
            raise ValueError(f"the PLE width ({dim}) must be a positive multiple of the n-gram heads ({n_heads})")
        self.ngram_size, self.heads_per_ngram, self.eos = ngram_size, heads_per_ngram, eos
        sizes = ngram_hash.table_sizes(base, n_heads, ple_index)
        offsets = [sum(sizes[:i]) for i in range(n_heads)]
        self.register_buffer("mults", torch.tensor(ngram_hash.multipliers(d_vocab, ngram_size, ple_index, seed)),
                             persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.weight = nn.Parameter(torch.empty(math.ceil(sum(sizes) / divisor) * divisor, dim // n_heads))
        nn.init.normal_(self.weight, std=0.02)  # (on meta: skipped; the released table has 45 billion entries)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos dim"]:
        context = self.ngram_size - 1
        state = stepping_state()
        if state is None:
            history = torch.cat([tokens.new_full((tokens.shape[0], context), self.eos), tokens], dim=1)
        else:
            history = state.history(self, "tokens", tokens, keep=context, fill=self.eos)
        ids = ngram_hash.ngram_ids(history, self.mults, self.sizes, self.offsets, self.ngram_size,
                                   self.heads_per_ngram, self.eos)[:, history.shape[1] - tokens.shape[1]:]
        return F.embedding(ids, self.weight).flatten(-2)


class PerLayerEmbedding(nn.Module):
    def __init__(self, d_model: int, n_streams: int, d_vocab: int, dim: int, ngram_size: int, heads_per_ngram: int,
                 base: int, divisor: int, seed: int, ple_index: int, eos: int, width: int, eps: float) -> None:
        super().__init__()
        d_stream = n_streams * d_model
        self.d_model, self.n_streams, self.width, self.dilation = d_model, n_streams, width, ngram_size
        self.ngram = NGramEmbedding(d_vocab, dim, ngram_size, heads_per_ngram, base, divisor, seed, ple_index, eos)
        self.key_proj = nn.Linear(dim, d_stream, bias=False)
        self.value_proj = nn.Linear(dim, d_model, bias=False)
        self.norm_key = GroupedRMSNorm(d_stream, d_model, eps)
        self.norm_query = GroupedRMSNorm(d_stream, d_model, eps)
        self.norm_conv = GroupedRMSNorm(d_stream, d_model, eps)
        self.conv_weight = nn.Parameter(torch.zeros(d_stream, width))  # HF's conv1d.weight [d_stream 1 width]
        self.dims = {"ple_dim": dim, "n_streams": n_streams}
        self.hook_embed = HookPoint("batch pos ple_dim")
        self.hook_gate = HookPoint("batch pos n_streams")
        self.hook_written = HookPoint("batch pos d_stream")
        self.hook_conv = HookPoint("batch pos d_stream")

    def forward(self, stream: Float[Tensor, "batch pos d_stream"], ctx: Context) -> Float[Tensor, "batch pos d_stream"]:
        if ctx.tokens is None:
            raise ValueError(f"{self.hook_embed.name.rsplit('.', 1)[0]} embeds the tokens' n-grams: with "
                             "start_at_layer, pass tokens=")
        mask = ctx.attention_mask
        tokens = ctx.tokens if mask is None else ctx.tokens.masked_fill(~mask.bool(), self.ngram.eos)
        e = self.ngram(tokens)
        e = self.hook_embed(e)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.n_streams, self.d_model))
        query = self.norm_query(stream).unflatten(-1, (self.n_streams, self.d_model))
        g = (key * query).sum(-1) / math.sqrt(self.d_model)
        gate = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        gate = self.hook_gate(gate)
        written = (torch.sigmoid(gate)[..., None] * self.value_proj(e)[..., None, :]).flatten(-2)
        normed = self.norm_conv(written)
        if mask is not None:
            keep = mask.to(written.dtype)[..., None]
            written, normed = written * keep, normed * keep
        written = self.hook_written(written)
        conv = F.silu(self._conv(normed))
        conv = self.hook_conv(conv)
        return written + conv

    def input_linears(self) -> list[nn.Module]:
        return [self.key_proj, self.value_proj]

    def output_bias(self) -> Tensor | None:
        return None

    def _conv(self, x: Float[Tensor, "batch pos d_stream"]) -> Float[Tensor, "batch pos d_stream"]:
        """The dilated causal depthwise conv: out[t] = sum_k w[k] x[t - (K - 1 - k) N] (zeros before the start)."""
        reach = (self.width - 1) * self.dilation
        state = stepping_state()
        if state is None:
            full = F.pad(x, (0, 0, reach, 0))
        else:
            full = state.history(self, "conv", x, keep=reach, fill=0)
        return F.conv1d(full.transpose(1, 2), self.conv_weight[:, None, :], groups=x.shape[-1],
                        dilation=self.dilation).transpose(1, 2)
