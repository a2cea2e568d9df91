"""Multi-head latent attention (MLA, DeepSeek-V2/V3; Kimi Linear's attention layers): keys and values
expanded from one compressed latent per position, plus a key part shared by every head.

Glossary (shape word in annotations; HF DeepseekV3 / KimiLinear config names in brackets)
    n_heads            query heads; every head has its own key and value (no grouping)
    d_nope [qk_nope_head_dim]  per-head query/key features read from the latent
    d_rope [qk_rope_head_dim]  query features matched against the shared key part k_rope
    d_qk = d_nope + d_rope     a query's and a key's width; the scale is d_qk^-1/2
    d_head [v_head_dim]        a value's width (what hook_z and o_proj see per head)
    kv_rank [kv_lora_rank]     the latent c_kv's width; q_rank [q_lora_rank]: a low-rank query (or None)
    rotary             rotary on the d_rope parts (query and shared key), or None: Kimi Linear has no
                       positional encoding at all (its "rope" part is only a shared key part)

    q            = q_proj(x)  or  q_b_proj(q_a_norm(q_a_proj(x)))     [.. n_heads d_qk]
    c_kv, k_rope = split(kv_a_proj(x));  c_kv = kv_a_norm(c_kv)       [.. kv_rank], [.. d_rope]
    k_nope, v    = split(kv_b_proj(c_kv)) per head                     [.. n_heads d_nope], [.. n_heads d_head]
    k            = [k_nope_h | k_rope] for every head h
    then attention as attention.py: scores, causal/padding mask, softmax (float32), z, o_proj

Hooks, under `blocks.{l}.attn.`:
    hook_q [batch pos n_heads d_qk], hook_latent [batch pos kv_rank] (c_kv after its norm),
    hook_k_rope [batch pos d_rope], hook_k [batch pos n_heads d_qk], hook_v [batch pos n_heads d_head],
    hook_rot_q, hook_rot_k (with a rotary), hook_attn_scores, hook_pattern [batch n_heads q_pos k_pos],
    hook_z [batch pos n_heads d_head], hook_result [batch pos n_heads d_model] (lazy), and the norms'
    kv_a_norm.* (q_a_norm.*). Edits propagate: an edited latent is what kv_b_proj expands.
While decoding, the state keeps the expanded keys and values (attention.py's entries), not the latent.
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange, repeat
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention
from hooked.models.base import Context
from hooked.models.head_writes import head_columns, written_by_heads
from hooked.models.norms import RMSNorm
from hooked.models.protocol import AttentionCut, Heads, TokenMixer
from hooked.ops.rotary import Rotary, apply_rotary

LATENT_NORM_EPS = 1e-6  # HF's kv_a_layernorm / q_a_layernorm keep the RMSNorm default


class LatentAttention(AttentionCut, TokenMixer, nn.Module):
    """MLA (module docstring); `q_rank` None: a full-rank q_proj. Mixer protocol (protocol.py): the query
    heads, cut at hook_z; knockout edits hook_attn_scores / hook_pattern as for every attention."""

    def __init__(self, d_model: int, n_heads: int, d_nope: int, d_rope: int, d_head: int, kv_rank: int,
                 q_rank: int | None = None, *, rotary: Rotary | None = None, bias: bool = False) -> None:
        super().__init__()
        self.n_heads, self.d_nope, self.d_rope, self.d_head = n_heads, d_nope, d_rope, d_head
        self.d_qk, self.kv_rank = d_nope + d_rope, kv_rank
        self.scale, self.rotary = (d_nope + d_rope) ** -0.5, rotary
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, n_heads * self.d_qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_rank, bias=bias)
            self.q_a_norm = RMSNorm(q_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_rank, n_heads * self.d_qk, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_rank + d_rope, bias=bias)
        self.kv_a_norm = RMSNorm(kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_rank, n_heads * (d_nope + d_head), bias=False)
        self.o_proj = nn.Linear(n_heads * d_head, d_model, bias=bias)
        self.dims = {"n_heads": n_heads, "d_qk": self.d_qk, "d_rope": d_rope, "d_head": d_head, "kv_rank": kv_rank,
                     "d_out": d_model}
        self.hook_q = HookPoint("batch pos n_heads d_qk")
        self.hook_latent = HookPoint("batch pos kv_rank")
        self.hook_k_rope = HookPoint("batch pos d_rope")
        self.hook_k = HookPoint("batch pos n_heads d_qk")
        self.hook_v = HookPoint("batch pos n_heads d_head")
        if rotary is not None:
            self.hook_rot_q = HookPoint("batch pos n_heads d_qk")
            self.hook_rot_k = HookPoint("batch pos n_heads d_qk")
        self.hook_attn_scores = HookPoint("batch n_heads q_pos k_pos")
        self.hook_pattern = HookPoint("batch n_heads q_pos k_pos")
        self.hook_z = HookPoint("batch pos n_heads d_head")
        self.hook_result = HookPoint("batch pos n_heads d_out", lazy=True)

    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj if hasattr(self, "q_proj") else self.q_a_proj, self.kv_a_proj]

    def output_bias(self) -> Tensor | None:
        return self.o_proj.bias

    def heads(self) -> Heads:
        """Query heads (d_head value channels each), cut at hook_z (before o_proj)."""
        return Heads(self.n_heads, self.d_head, self.hook_z, "attn", self.hook_result)

    def project(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        """Hooked (q, k, v) of the new positions: [.. n_heads d_qk], [.. n_heads d_qk], [.. n_heads d_head]."""
        q_flat = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = self.hook_q(rearrange(q_flat, "b l (h d) -> b l h d", d=self.d_qk))
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.d_rope], dim=-1)
        latent = self.hook_latent(self.kv_a_norm(latent))
        k_rope = self.hook_k_rope(k_rope)
        k_nope, v = rearrange(self.kv_b_proj(latent), "b l (h d) -> b l h d", h=self.n_heads).split(
            [self.d_nope, self.d_head], dim=-1)
        k = self.hook_k(torch.cat([k_nope, repeat(k_rope, "b l r -> b l h r", h=self.n_heads)], dim=-1))
        v = self.hook_v(v)
        if self.rotary is not None:  # rotary on the last d_rope features of q and k (the shared part)
            past = ctx.state.length if ctx.state is not None else 0  # the largest position, known without a host read
            cos, sin = self.rotary(ctx.position_ids, q.dtype, max_position=past + q.shape[1] - 1)
            rope = lambda t: torch.cat([t[..., :self.d_nope], apply_rotary(t[..., self.d_nope:], cos, sin)], -1)  # noqa: E731
            q, k = self.hook_rot_q(rope(q)), self.hook_rot_k(rope(k))
        return q, k, v

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        q, k, v = self.project(x, ctx)
        shared = None  # a selected state's shared past (shared_kv.py), read in place
        if ctx.state is not None:
            shared, k, v = ctx.state.extend_kv(self, k, v)
        scores = einsum(q, k, "b q h d, b k h d -> b h q k")
        if shared is not None:
            scores = torch.cat([shared.scores(q), scores], dim=-1)
        scores = scores * self.scale
        visible = Attention.visible(ctx, scores.shape[-1], scores.device, q_len=scores.shape[-2])
        attn_scores = self.hook_attn_scores(scores.masked_fill(~visible, torch.finfo(scores.dtype).min))
        pattern = attn_scores.softmax(dim=-1, dtype=torch.promote_types(attn_scores.dtype, torch.float32)).to(q.dtype)
        pattern = self.hook_pattern(pattern)
        if shared is None:
            z = einsum(pattern, v, "b h q k, b k h d -> b q h d")
        else:
            p0 = shared.shared_positions
            z = shared.mix(pattern[..., :p0]) + einsum(pattern[..., p0:], v, "b h q k, b k h d -> b q h d")
        z = self.hook_z(z)
        z = self.gate_heads(z, x)
        return written_by_heads(self.o_proj, z, self.hook_result, self.head_results)  # as attention.py

    def gate_heads(self, z: Float[Tensor, "batch pos n_heads d_head"],
                   x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos n_heads d_head"]:
        """What each head gives o_proj: z itself (Bailing-hybrid's MLA multiplies it by an output gate)."""
        return z

    def head_results(self, z: Float[Tensor, "*batch pos n_heads d_head"]) -> Float[Tensor, "*batch pos n_heads d_out"]:
        """Each head's write, o_proj without its bias."""
        return head_columns(self.o_proj, z)

    head_writes = head_results

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, d_nope={self.d_nope}, d_rope={self.d_rope}, d_head={self.d_head}, "
                f"kv_rank={self.kv_rank}, rotary={self.rotary}")
