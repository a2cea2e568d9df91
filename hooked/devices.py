"""Real weights on offloaded modules: read a parameter outside a forward on a dispatched model.

Glossary
    dispatched   a model spread over devices by loaders/dispatch.py (accelerate's `dispatch_model`);
                 each placed module carries an accelerate hook (`module._hf_hook`)
    offloaded    a module whose parameters are meta between forwards: its hook (or its block's, when
                 the block loads all its weights at once) brings them to the execution device in
                 `pre_forward` and drops them in `post_forward`
    onloaded     `with onloaded(model, module):` runs those two calls around a read, so code that reads
                 parameters directly (decay norms, kernels from A_log, weight properties) sees the real
                 weights, never meta. On a model that is not dispatched it does nothing.

This is accelerate's `align_module_device`, found through the module's ancestors too (a block's hook
holds its mixer's weights); hooked/ keeps to torch, so the hooks are called by duck typing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def _offloads(module: nn.Module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return any(getattr(h, "offload", False) for h in getattr(hook, "hooks", [hook]) if h is not None)


def offload_holders(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """The modules whose offload hooks hold `module`'s parameters: its ancestors and itself, or its descendants."""
    path = next((n for n, m in model.named_modules() if m is module), None)
    if path is None:
        raise ValueError(f"{type(module).__name__} is not a submodule of this model")
    parts = path.split(".") if path else []
    line = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    holders = [m for m in line if _offloads(m)]
    return holders[:1] if holders else [m for m in module.modules() if _offloads(m)]


@contextlib.contextmanager
def onloaded(model: nn.Module, module: nn.Module) -> Iterator[nn.Module]:
    """Inside, `module`'s parameters are real tensors on its execution device (see the glossary)."""
    entered: list[nn.Module] = []
    try:
        for m in offload_holders(model, module):
            m._hf_hook.pre_forward(m)
            entered.append(m)
        yield module
    finally:
        for m in reversed(entered):
            m._hf_hook.post_forward(m, None)
