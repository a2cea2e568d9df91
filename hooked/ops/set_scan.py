"""The change of every state after some states were SET (hooked/state_edit.py), for elementwise decays.

Glossary (axis 1 = pos; `*state` = the state's own axes: Mamba-1 [d_inner d_state], Mamba-2
[n_heads d_head d_state])
    decay    A_bar_t, broadcast against the state (Mamba-2: [batch pos n_heads 1 1])
    e        the returned state minus the one received, zero outside the set entries
    fixed    bool, the set entries (broadcast against the state: hooked/state_edit.py sets whole units)
    d        d_t = e_t where fixed_t, else decay_t * d_{t-1} + e_t   (d_{-1} = 0)

The positions with a set entry split the sequence into segments. Inside a segment nothing is set and
the recurrence has no input, so d_t = (prod_{r=s+1..t} decay_r) d_s: one cumulative product per
segment, no step per position. Only the positions with a set entry are visited one at a time.
"""

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from hooked.ops.ssd import _linear_recurrence

MANY = 32  # more positions with a set entry than this: the plain scan (one fused step per position) is cheaper


def set_scan(
    decay: Float[Tensor, "batch pos *decay"],
    e: Float[Tensor, "batch pos *state"],
    fixed: Bool[Tensor, "batch pos *fixed"],
) -> Float[Tensor, "batch pos *state"]:
    """d for every position (module glossary): how setting the `fixed` entries changes every state.

    An `e` that requires grad (a hook's gradient-carrying copy, attribution patching) is scanned at
    every position, so that its gradient is the total derivative through the continued states; so is
    an edit that sets entries at more than MANY positions (the scan with the decay 0 where set).
    """
    visited = fixed.flatten(2).any(2).any(0).nonzero()[:, 0].tolist()
    if len(visited) > MANY or (e.requires_grad and torch.is_grad_enabled()):  # one step per position
        return _linear_recurrence(decay.expand_as(e).masked_fill(fixed, 0.0), e, None)
    seq_len = e.shape[1]
    if not visited:
        return torch.zeros_like(e)
    parts = [e.new_zeros(e.shape[0], visited[0], *e.shape[2:])]
    d = None
    for n, t in enumerate(visited):
        d = e[:, t] if d is None else torch.where(fixed[:, t], e[:, t], decay[:, t] * d + e[:, t])
        parts.append(d[:, None])
        stop = visited[n + 1] if n + 1 < len(visited) else seq_len
        if stop > t + 1:  # a segment with nothing set: the decays' running product times d_t
            run = torch.cumprod(decay[:, t + 1:stop], dim=1) * d[:, None]
            parts.append(run)
            d = run[:, -1]
    return torch.cat(parts, dim=1)
