"""A mixer's output written unit by unit, when something listens to its per-unit write hook.

out_proj(gated) is the sum of each unit's write (its columns of out_proj times its part of gated)
plus out_proj's bias. The mixers that expose those writes (hook_head_out: Mamba-1 channels, Mamba-2
and delta-rule heads, short-conv channels; hook_result: attention heads, latent attention's too)
build them only when the hook is active, and keep out_proj(gated) unless a hook edited them
(bit-identical otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook


def head_columns(o_proj: nn.Linear, z: Float[Tensor, "*batch pos n_heads d_head"]
                 ) -> Float[Tensor, "*batch pos n_heads d_out"]:
    """Each attention head's write z_h @ W_O[:, h]^T, o_proj's bias left out (it belongs to no head)."""
    w_o = rearrange(o_proj.weight, "d_out (n_heads d_head) -> n_heads d_head d_out", d_head=z.shape[-1])
    return einsum(z, w_o, "... pos n_heads d_head, n_heads d_head d_out -> ... pos n_heads d_out")


def written_by_heads(o_proj: nn.Linear, z: Float[Tensor, "batch pos n_heads d_head"], hook: HookPoint,
                     head_writes: Callable[[Tensor], Tensor]) -> Float[Tensor, "batch pos d_out"]:
    """Attention's o_proj(z); with `hook` (hook_result) active, head_writes(z) through it: the value of
    o_proj(z) (bit-identical when nothing is edited) plus sum_h (result'_h - result_h), so zeroing a head's
    result zeroes its columns of o_proj, and gradients reach z and W_O through the results only."""
    flat_z = rearrange(z, "batch pos n_heads d_head -> batch pos (n_heads d_head)")
    if not hook.is_active:
        return o_proj(flat_z)
    result = head_writes(z)  # lazy: [batch pos n_heads d_out] only when someone asks
    written = result.detach().sum(dim=2)  # before the hooks, which may edit `result` in place
    result = hook(result)
    unedited = F.linear(flat_z.detach(), o_proj.weight.detach(), o_proj.bias)
    return unedited + (result.sum(dim=2) - written)


def written_by_units(out_proj: nn.Linear, gated: Tensor, hook: HookPoint,
                     head_writes: Callable[[Tensor], Tensor]) -> Tensor:
    """out_proj(gated); with `hook` active, head_writes(gated) [... pos units d_model] through it, and
    when a hook edited them, their sum plus out_proj's bias."""
    if not hook.is_active:
        return out_proj(gated)
    build = lambda: head_writes(gated)  # noqa: E731  (also rebuilds the original after an in-place edit)
    head_out, head_out_was = through_hook(hook, build(), build)
    if head_out_was is None:
        return out_proj(gated)
    out = head_out.sum(dim=-2)
    return out if out_proj.bias is None else out + out_proj.bias
