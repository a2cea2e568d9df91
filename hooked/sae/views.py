"""`{hook}.hook_heads`: a hook with several axes per head seen with one axis per head.

Mamba-2's state hook_h is [batch pos n_heads d_head d_state]. Tools that take [batch pos d] or
[batch pos n_heads d] activations (SAELens's ActivationsStore, whose `hook_head_index` picks one
head) read `blocks.{l}.mixer.hook_h.hook_heads` instead: [batch pos n_heads d_head*d_state], the same
numbers. It is a tap of hook_h (hook_points.py): it fires after hook_h's hooks, and what a hook
returns there is reshaped back and is what the model continues from (an edited state continues the
recurrence). It costs nothing until hooked; it is made the first time the name is asked for.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from hooked.hook_points import HookPoint

SUFFIX = "hook_heads"


class HeadsView(HookPoint):
    """The parent's activation [batch pos heads *per_head] as [batch pos heads prod(per_head)]."""

    def __init__(self, parent: HookPoint) -> None:
        if len(parent.axes) < 5 or parent.axes[1] != "pos":
            raise ValueError(f"{parent.name!r} [{' '.join(parent.axes)}] has one axis per head already; "
                             f"{SUFFIX} is for hooks with several (batch pos heads a b ...)")
        super().__init__(" ".join(parent.axes[:3]) + " " + "*".join(parent.axes[3:]), lazy=parent.lazy,
                         element=parent.element)

    def __call__(self, x: Tensor) -> Tensor:  # as a tap of its parent: reshape, run the hooks, reshape back
        return super().__call__(x.flatten(3)).reshape(x.shape)

    def tap_steps(self) -> list[Callable[[Tensor], Tensor]]:
        return [lambda x, step=step: step(x.flatten(3)).reshape(x.shape) for step in self.steps()]


def heads_view(root, name: str) -> HookPoint | None:
    """The view named `name` ("{hook}.hook_heads"), made on first use; None when `name` is not one."""
    parent_name, _, last = name.rpartition(".")
    if last != SUFFIX:
        return None
    parent = root._module_hooks().get(parent_name)
    if parent is None or len(parent.axes) < 5:
        return None
    if SUFFIX not in parent._modules:
        parent.add_tap(SUFFIX, HeadsView(parent))
        root.setup()
    return parent._modules[SUFFIX]
