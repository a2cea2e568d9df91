"""Causal self-attention with grouped-query heads, every quantity hooked, and the pre-norm block.

Glossary
    d_in, d_out   input and output widths (d_model in GPT-2 and Llama; Zamba2's shared block reads
                  [hidden, embedding], d_in = 2 * d_model)
    n_heads       query heads; n_kv_heads key/value heads (GQA: n_heads = group * n_kv_heads,
                  query head h reads kv head h // group, as HF's `repeat_kv`)
    d_head        width of one head
    q_pos, k_pos  query (target, row) and key (source, column) positions of the pattern
    scale         multiplier of q.k (d_head^-1/2 unless the architecture says otherwise)
    rotary        an `ops.rotary.Rotary` (Llama) or None (GPT-2: positions enter as embeddings)
    window        sliding window W (Mistral, Qwen2/3, Gemma 2/3 local layers): a query sees itself
                  and the W - 1 keys before it (key k visible from query q iff q - W < k <= q, HF's
                  `sliding_window_overlay`); the window is part of the mask, so hook_pattern shows it.
                  None: full causal attention
    q_norm, k_norm  optional per-head norms of q and k over d_head, applied before rotary (Qwen3,
                  Gemma 3); their outputs are hooked as `q_norm.hook_normalized`, `k_norm.hook_normalized`
    softcap       optional `SoftCap` of the scaled scores before the mask (Gemma 2): hooks
                  `softcap.hook_in` (before the cap) and `softcap.hook_out` (after it)

Hooks, under `blocks.{l}.attn.`:
    hook_q         [batch pos n_heads d_head]       queries (before rotary)
    hook_k, hook_v [batch pos n_kv_heads d_head]    keys, values (kv heads are not repeated)
    hook_rot_q     [batch pos n_heads d_head]       queries after rotary (rotary models only)
    hook_rot_k     [batch pos n_kv_heads d_head]    keys after rotary (rotary models only)
    q_norm.hook_normalized [batch pos n_heads d_head]  normalised queries (q/k-norm models only)
    k_norm.hook_normalized [batch pos n_kv_heads d_head]  normalised keys (q/k-norm models only)
    hook_attn_scores [batch n_heads q_pos k_pos]    scale * q.k (soft-capped where capped), masked,
                                                    before softmax
    hook_pattern   [batch n_heads q_pos k_pos]      softmax of the scores over k_pos
    hook_z         [batch pos n_heads d_head]       pattern-weighted values
    hook_result    [batch pos n_heads d_out]        each head's write, z_h @ W_O[:, h]^T; built only
                                                    when hooked or cached

Masking. A masked score (a future key, or a padding key) is set to `finfo(dtype).min`, the value
HF's eager path ends up with (it adds finfo.min). Unlike -inf, this keeps a query row with no
visible key (a left-padding query) finite: its pattern is uniform, never NaN. Padding queries are
meaningless; compare real positions only.

Numerics follow HF eager: scores and the pattern-weighted sum in the activations' dtype, the
softmax in float32 (float64 for float64 models).

Backends (hooked/backends.py). With no hook on the scores, the pattern or the soft-cap active (nor a
hook marked exact), z comes from torch's scaled_dot_product_attention (ops/sdpa.py: same mask, same
finfo.min for masked keys, no [batch n_heads q_pos k_pos] tensor) and hook_attn_scores / hook_pattern
do not fire; otherwise, for a soft-capped layer and for a selected state's shared past, z comes
through the hooked scores and pattern ("eager"). `backends.use(attention="eager")` forces the latter.

Selected states. In a state expanded by `DecodeState.select` (many rows continuing one prefix), the
past keys and values are a `SharedKV` (shared_kv.py): the scores against them and their part of z
are computed in place through the row map, never copied per row; the hooks keep their shapes (k_pos
counts the shared keys first, then the row's own), and the scale, soft-cap, mask and softmax act on
the whole score row as always.

hook_result. attn_out is o_proj(z) plus the sum over heads of whatever the hooks changed in the
results: attn_out = o_proj(z) + sum_h (result'_h - result_h). With nothing edited this is exactly
o_proj(z) (bit-identical to the unhooked forward); with edits it equals sum_h result'_h + b_O, so
zeroing a head's result is zeroing that head's columns of o_proj. Gradients reach z and W_O through
the results only (the o_proj(z) term carries the value, detached but for the bias), so a backward
hook on hook_result sees d loss / d result.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked import backends
from hooked.hook_points import HookPoint
from hooked.models.base import Context
from hooked.models.head_writes import head_columns, written_by_heads
from hooked.models.protocol import AttentionCut, Heads, TokenMixer
from hooked.models.softcap import SoftCap
from hooked.ops.rotary import Rotary, apply_rotary
from hooked.ops.sdpa import sdpa_attention
from hooked.weights import AttentionWeights


class Attention(AttentionCut, TokenMixer, AttentionWeights, nn.Module):
    """Causal multi-head attention with GQA; q/k/v/o projections are plain attributes a caller may wrap.

    q_proj, k_proj, v_proj may be replaced by any module mapping [.. d_in] to the same width (Zamba2
    adds a per-invocation LoRA); o_proj must keep `weight` and `bias` (hook_result reads them).
    """

    def __init__(self, d_in: int, n_heads: int, n_kv_heads: int, d_head: int, d_out: int | None = None, *,
                 qkv_bias: bool = False, o_bias: bool = False, rotary: Rotary | None = None,
                 scale: float | None = None, window: int | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None, softcap: float | None = None) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("give both q_norm and k_norm, or neither")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must hold at least one key, got {window}")
        d_out = d_in if d_out is None else d_out
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head
        self.scale = d_head**-0.5 if scale is None else scale
        self.rotary = rotary
        self.window = window
        self.q_proj = nn.Linear(d_in, n_heads * d_head, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, n_kv_heads * d_head, bias=qkv_bias)
        self.v_proj = nn.Linear(d_in, n_kv_heads * d_head, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * d_head, d_out, bias=o_bias)
        self.q_norm, self.k_norm = q_norm, k_norm  # [.. d_head] -> [.. d_head], or None
        self.softcap = SoftCap(softcap, "batch n_heads q_pos k_pos") if softcap is not None else None
        for norm, heads in ((q_norm, "n_heads"), (k_norm, "n_kv_heads")):  # per-head norms over d_head
            if norm is not None:
                norm.hook_scale.axes = ("batch", "pos", heads, "1")
                norm.hook_normalized.axes = ("batch", "pos", heads, "d_head")
        self.dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "d_head": d_head, "d_out": d_out}
        self.hook_q = HookPoint("batch pos n_heads d_head")
        self.hook_k = HookPoint("batch pos n_kv_heads d_head")
        self.hook_v = HookPoint("batch pos n_kv_heads d_head")
        if rotary is not None:
            self.hook_rot_q = HookPoint("batch pos n_heads d_head")
            self.hook_rot_k = HookPoint("batch pos n_kv_heads d_head")
        self.hook_attn_scores = HookPoint("batch n_heads q_pos k_pos")
        self.hook_pattern = HookPoint("batch n_heads q_pos k_pos")
        self.hook_z = HookPoint("batch pos n_heads d_head")
        self.hook_result = HookPoint("batch pos n_heads d_out", lazy=True)

    def forward(self, x: Float[Tensor, "batch pos d_in"], ctx: Context) -> Float[Tensor, "batch pos d_out"]:
        q = rearrange(self.q_proj(x), "batch pos (n_heads d_head) -> batch pos n_heads d_head", d_head=self.d_head)
        q = self.hook_q(q)
        k = rearrange(self.k_proj(x), "batch pos (n_kv_heads d_head) -> batch pos n_kv_heads d_head", d_head=self.d_head)
        k = self.hook_k(k)
        v = rearrange(self.v_proj(x), "batch pos (n_kv_heads d_head) -> batch pos n_kv_heads d_head", d_head=self.d_head)
        v = self.hook_v(v)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # hooked as q_norm.hook_normalized, k_norm.hook_normalized
        if self.rotary is not None:
            # a bound on the position ids known on the host: the table is sized without reading the device
            past = ctx.state.length if ctx.state is not None else 0
            cos, sin = self.rotary(ctx.position_ids, q.dtype, max_position=past + q.shape[1] - 1)
            rot_q = apply_rotary(q, cos, sin)
            rot_q = self.hook_rot_q(rot_q)
            rot_k = apply_rotary(k, cos, sin)
            rot_k = self.hook_rot_k(rot_k)
            q, k = rot_q, rot_k
        shared = None  # a selected state's shared past (shared_kv.py): its keys come first, read in place
        if ctx.state is not None:  # incremental decoding: the past keys and values come from the state
            shared, k, v = ctx.state.extend_kv(self, k, v)
        eager = self.softcap is not None or self.eager_only  # SDPA cannot cap scores nor add a sink
        if backends.attention_backend(self, softcap=eager, shared_past=shared is not None,
                                      on_cuda=q.is_cuda, windowed=self.window is not None) == "sdpa":
            z = sdpa_attention(q, k, v, self.scale, window=self.window, key_mask=ctx.keys_mask())
        else:
            z = self._eager_z(q, k, v, shared, ctx)
        z = self.hook_z(z)
        z = self.gate_heads(z, x)
        return written_by_heads(self.o_proj, z, self.hook_result, self.head_results)  # hook_result: head_writes.py

    def _eager_z(self, q: Float[Tensor, "batch q_pos n_heads d_head"], k: Float[Tensor, "batch k_pos n_kv_heads d_head"],
                 v: Float[Tensor, "batch k_pos n_kv_heads d_head"], shared: Any, ctx: Context
                 ) -> Float[Tensor, "batch q_pos n_heads d_head"]:
        """z through the scores and the pattern, each hooked (the exact path)."""
        k, v = self.repeat_kv(k), self.repeat_kv(v)  # [batch k_pos n_heads d_head]
        scores = einsum(q, k, "batch q_pos n_heads d_head, batch k_pos n_heads d_head -> batch n_heads q_pos k_pos")
        if shared is not None:
            scores = torch.cat([shared.scores(q), scores], dim=-1)
        scores = scores * self.scale
        if self.softcap is not None:
            scores = self.softcap(scores)
        visible = self.visible(ctx, scores.shape[-1], scores.device, q_len=scores.shape[-2], window=self.window)
        attn_scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        attn_scores = self.hook_attn_scores(attn_scores)
        pattern = self.normalise(attn_scores).to(q.dtype)
        pattern = self.hook_pattern(pattern)
        if shared is None:
            return einsum(pattern, v, "batch n_heads q_pos k_pos, batch k_pos n_heads d_head -> batch q_pos n_heads d_head")
        p0 = shared.shared_positions
        return shared.mix(pattern[..., :p0]) + einsum(
            pattern[..., p0:], v, "batch n_heads q_pos k_pos, batch k_pos n_heads d_head -> batch q_pos n_heads d_head")

    def normalise(self, attn_scores: Float[Tensor, "batch n_heads q_pos k_pos"]) -> Float[Tensor, "batch n_heads q_pos k_pos"]:
        """The pattern from the masked scores: softmax over k_pos in float32 or wider (sink_attention.py
        adds a per-head sink term to the denominator)."""
        return attn_scores.softmax(dim=-1, dtype=torch.promote_types(attn_scores.dtype, torch.float32))

    eager_only = False  # True: never SDPA (a layer whose softmax SDPA cannot compute, sink_attention.py)

    def gate_heads(self, z: Float[Tensor, "batch pos n_heads d_head"],
                   x: Float[Tensor, "batch pos d_in"]) -> Float[Tensor, "batch pos n_heads d_head"]:
        """What each head writes through o_proj: z itself (gated_attention.py multiplies it by an output gate)."""
        return z

    def input_linears(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def output_bias(self) -> Tensor | None:
        return self.o_proj.bias

    def heads(self) -> Heads:
        """Query heads, cut at hook_z (before o_proj)."""
        return Heads(self.n_heads, self.d_head, self.hook_z, "attn", self.hook_result)

    def repeat_kv(self, t: Float[Tensor, "batch pos n_kv_heads d_head"]) -> Float[Tensor, "batch pos n_heads d_head"]:
        """Each kv head serves `group` consecutive query heads."""
        return t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=2)

    @staticmethod
    def visible(ctx: Context, pos: int, device: torch.device, q_len: int | None = None,
                window: int | None = None) -> Tensor:
        """Bool [q_pos k_pos] (no padding) or [batch 1 q_pos k_pos]: key at or before the query (and
        within `window` of it), not padding. The window counts sequence indices, which is the distance
        in real tokens too: padding sits on one side.

        While decoding, the q_len queries are the last q_len of the pos keys."""
        q_len = pos if q_len is None else q_len
        causal = torch.ones(q_len, pos, dtype=torch.bool, device=device).tril(pos - q_len)
        if window is not None:  # drop k <= q - W, q counted over all pos keys
            causal = causal & ~torch.ones(q_len, pos, dtype=torch.bool, device=device).tril(pos - q_len - window)
        mask = ctx.keys_mask()
        if mask is None:
            return causal
        return causal & mask[:, None, None, :]

    def head_results(self, z: Float[Tensor, "*batch pos n_heads d_head"]) -> Float[Tensor, "*batch pos n_heads d_out"]:
        """Each head's write to the output, without o_proj's bias (which belongs to no head)."""
        return head_columns(self.o_proj, z)

    head_writes = head_results  # the name every mixer shares (protocol.TokenMixer.unit_writes)

    def extra_repr(self) -> str:
        rope = f", rotary={self.rotary}" if self.rotary is not None else ""
        window = f", window={self.window}" if self.window is not None else ""
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, "
                f"scale={self.scale:.4g}{window}{rope}")
