"""Zamba2's shared transformer block, one module per invocation: weights shared, hooks not.

Glossary
    invocation   one use of a shared block, at one hybrid layer `l` (module `blocks.{l}.shared`).
                 Invocation i (the i-th hybrid layer, counted from 0) uses shared block
                 i % num_mem_blocks and its own adapters.
    shared       q/k/v/o_proj, gate_up_proj, down_proj and both norm weights: the SAME nn.Linear
                 modules / Parameters in every invocation of one block (`named_parameters()` lists
                 each once, under the block's first invocation)
    adapter      per invocation, a low-rank map added to a shared projection (LoRA-shaped, but part
                 of the base model): AdaptedLinear(x) = base(x) + up(down(x)), rank `adapter_rank`;
                 on q, k, v (HF use_shared_attention_adapter) and always on gate_up_proj
    hidden       the residual stream entering the hybrid layer [batch pos d_model]
    embedding    the original token embedding [batch pos d_model] (Context.embedding)
    d_mlp        hidden width of the MLP (HF intermediate_size); gate_up_proj is d_model -> 2 d_mlp,
                 split into [gate, up] halves

    x        = [hidden, embedding]                   hook_in        [batch pos 2 d_model]
    attn_out = attn(ln1(x))     (o_proj: 2 d_model -> d_model)      hook_attn_out
    mlp_out  = mlp(ln2(attn_out))                    hook_mlp_out
    out      = mlp_out          (no residual inside the block)      hook_out

Hooks under blocks.{l}.shared.: hook_in, ln1.hook_normalized, attn.* (attention.py: hook_q, hook_k,
hook_v, hook_rot_q / hook_rot_k with use_mem_rope, hook_attn_scores, hook_pattern, hook_z,
hook_result), hook_attn_out, ln2.hook_normalized, mlp.hook_pre (gate), mlp.hook_pre_linear (up),
mlp.hook_post, hook_mlp_out, hook_out. Attention scores are scaled by (d_head / 2)^-1/2, as in
HF's Zamba2Attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.attention import Attention
from hooked.models.base import Context
from hooked.models.mlp import activation
from hooked.models.norms import RMSNorm
from hooked.ops.rotary import Rotary


class AdaptedLinear(nn.Module):
    """base(x) + up(down(x)): a (shared) linear map plus this invocation's low-rank adapter.

    Args:
        base: the shared projection (an nn.Linear that other invocations hold too).
        rank: adapter rank r; down is in_features -> r, up is r -> out_features, no biases.
    """

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: Float[Tensor, "batch pos d_in"]) -> Float[Tensor, "batch pos d_out"]:
        return self.base(x) + self.up(self.down(x))


class FusedGatedMLP(nn.Module):
    """down_proj(act(gate) * up) with [gate, up] = gate_up_proj(x) split in halves (HF Zamba2MLP).

    Hooks: hook_pre [batch pos d_mlp] the gate half before the activation, hook_pre_linear
    [batch pos d_mlp] the up half, hook_post [batch pos d_mlp] act(pre) * pre_linear (mlp.py's names).
    """

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Linear, act_fn: str) -> None:
        super().__init__()
        self.act_fn = act_fn
        self.act = activation(act_fn)
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.dims = {"d_mlp": down_proj.in_features}
        self.hook_pre = HookPoint("batch pos d_mlp")
        self.hook_pre_linear = HookPoint("batch pos d_mlp")
        self.hook_post = HookPoint("batch pos d_mlp")

    def input_linears(self) -> list[nn.Module]:
        return [self.gate_up_proj]

    def output_bias(self) -> Tensor | None:
        return self.down_proj.bias

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views; contiguous, the layout a hook's clone has
        pre = self.hook_pre(gate.contiguous())
        pre_linear = self.hook_pre_linear(up.contiguous())
        post = self.act(pre) * pre_linear
        post = self.hook_post(post)
        return self.down_proj(post)

    def extra_repr(self) -> str:
        return f"act_fn={self.act_fn}"


class SharedTransformer(nn.Module):
    """One invocation of a shared block: mlp(ln2(attn(ln1([hidden, embedding])))), no residual."""

    def __init__(self, ln1: RMSNorm, attn: Attention, ln2: RMSNorm, mlp: nn.Module) -> None:
        """mlp: a gated MLP with mlp.py's hooks (Zamba2's FusedGatedMLP; Zamba's mlp.py GatedMLP)."""
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.dims = {"d_in": ln1.weight.shape[0]}
        self.hook_in = HookPoint("batch pos d_in")
        self.hook_attn_out = HookPoint("batch pos d_model")
        self.hook_mlp_out = HookPoint("batch pos d_model")
        self.hook_out = HookPoint("batch pos d_model")

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """(norm, the linear maps reading its output) inside this invocation (weight processing)."""
        return [(self.ln1, self.attn.input_linears()), (self.ln2, self.mlp.input_linears())]

    def forward(self, hidden: Float[Tensor, "batch pos d_model"], embedding: Float[Tensor, "batch pos d_model"],
                ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        x = torch.cat([hidden, embedding], dim=-1)  # [batch pos 2*d_model]
        x = self.hook_in(x)
        attn_out = self.attn(self.ln1(x), ctx)
        attn_out = self.hook_attn_out(attn_out)
        mlp_out = self.mlp(self.ln2(attn_out))
        mlp_out = self.hook_mlp_out(mlp_out)
        out = self.hook_out(mlp_out)
        return out


@dataclass(frozen=True)
class SharedSizes:
    """What one invocation is built from (plain sizes; zamba2.build fills it from its config)."""

    d_model: int
    n_heads: int  # attention query heads
    n_kv_heads: int
    d_head: int  # attention head width (HF attention_head_dim = 2 d_model / n_heads)
    d_mlp: int
    act_fn: str
    eps: float
    adapter_rank: int
    qkv_adapters: bool  # HF use_shared_attention_adapter; the MLP always has its adapter
    bias: bool  # HF add_bias_linear: biases of gate_up_proj and down_proj (attention has none)
    rotary: Rotary | None  # HF use_mem_rope


def shared_invocation(sizes: SharedSizes, first: SharedTransformer | None) -> SharedTransformer:
    """A new invocation: fresh hooks and adapters; the shared weights of `first` (None: new weights).

    The shared nn.Linear modules are assigned to this invocation's Attention / MLP (the same module
    objects); norms get new RMSNorm modules (each has its own hook) holding the same Parameter.
    """
    d_in = 2 * sizes.d_model
    attn = Attention(d_in, sizes.n_heads, sizes.n_kv_heads, sizes.d_head, d_out=sizes.d_model,
                     rotary=sizes.rotary, scale=(sizes.d_head / 2) ** -0.5)
    ln1, ln2 = RMSNorm(d_in, sizes.eps), RMSNorm(sizes.d_model, sizes.eps)
    if first is None:
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        gate_up = nn.Linear(sizes.d_model, 2 * sizes.d_mlp, bias=sizes.bias)
        down = nn.Linear(sizes.d_mlp, sizes.d_model, bias=sizes.bias)
    else:  # share weights, not hooks
        q, k, v = (_base(p) for p in (first.attn.q_proj, first.attn.k_proj, first.attn.v_proj))
        attn.o_proj = first.attn.o_proj
        ln1.weight, ln2.weight = first.ln1.weight, first.ln2.weight
        gate_up, down = _base(first.mlp.gate_up_proj), first.mlp.down_proj
    if sizes.qkv_adapters:
        q, k, v = (AdaptedLinear(p, sizes.adapter_rank) for p in (q, k, v))
    attn.q_proj, attn.k_proj, attn.v_proj = q, k, v
    mlp = FusedGatedMLP(AdaptedLinear(gate_up, sizes.adapter_rank), down, sizes.act_fn)
    return SharedTransformer(ln1, attn, ln2, mlp)


def _base(proj: nn.Module) -> nn.Linear:
    """The shared nn.Linear inside a projection (itself, or an AdaptedLinear's base)."""
    return proj.base if isinstance(proj, AdaptedLinear) else proj
