"""A mixer's output written unit by unit, when something listens to hook_head_out.

out_proj(gated) is the sum of each unit's write (its columns of out_proj times its part of gated)
plus out_proj's bias. The mixers that expose those writes (hook_head_out: Mamba-1 channels, Mamba-2
and delta-rule heads, short-conv channels) build them only when the hook is active, and keep
out_proj(gated) unless a hook edited them (bit-identical otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from hooked.hook_points import HookPoint, through_hook


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
