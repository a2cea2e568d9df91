"""Edits of a recurrent state hook (`hook_h`): a returned state is SET there, and the recurrence continues.

Glossary
    trajectory   the states h_0 .. h_{L-1} of one mixer, one per position (hook_h's activation).
    received     what a hook function gets: the clean trajectory for the first hook; for each later
                 hook (or tap: an SAE splice, a `hook_heads` view), the trajectory the earlier edits left.
    unit         the state of one head (Mamba-2, the delta rule, lightning attention) or one channel (Mamba-1:
                 its d_state entries; RG-LRU) at one position: axis 2 of the state hook [batch pos unit ...].
    set          a unit whose returned state differs from the one received in any entry. Its state there
                 IS the returned one, every entry of it (so an entry that happens to equal the received
                 value, which float32 states do by chance, is set too): the recurrence adds it to nothing.
    continued    every other unit: the recurrence run on from the states before it, the set ones
                 included. So zeroing h at positions 5 and 8 leaves h_8 = 0 (not h_8 plus the change the
                 edit at 5 carried there), and a hook that returns another run's whole trajectory runs
                 the model on exactly those states.
    declared     a hook may return `set_everywhere(t)`: every unit of t counts as set, equal or not
                 (attribution patching of an index that spans every position: the gradient of such a
                 patch is each state's own effect, since no set state is continued from another).
    fixed        the units set by any hook so far: a later hook that edits an earlier position does not
                 undo a set unit after it (as hooks run one position at a time would behave).
    carry        the mixer's own map from (difference e, fixed mask) to the change d of every state:
                 d_t = e_t where fixed, else M_t d_{t-1} + e_t (M_t the state transition, d_{-1} = 0).
                 It is linear in e; e is zero wherever nothing was set, except that a hook's output that
                 equals its input but carries its own gradient (attribution patching's
                 `act.detach().requires_grad_()`) counts as an edit with e = 0: its gradient is the
                 total derivative through every later state.

Units are independent recurrences (each head or channel has its own state and transition), so setting
one unit at a position leaves every other unit continued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from hooked.hook_points import HookPoint, _version, is_recording

Carry = Callable[[Tensor, Tensor], Tensor]  # (e, fixed) -> d, every state's change
_DECLARED = "_hooked_set_everywhere"


def set_everywhere(t: Tensor) -> Tensor:
    """`t` marked so that a state hook sets every entry of it, also those equal to what it received."""
    setattr(t, _DECLARED, True)
    return t


class StateEdit(NamedTuple):
    """What a state hook did: the trajectory to read y from, the clean one (None: nothing changed), and
    the first position whose state changed (y before it is the clean y, to the bit)."""

    h: Tensor
    clean: Tensor | None
    first: int

    def read_into(self, y: Tensor, read: Callable[[Tensor, slice], Tensor]) -> Tensor:
        """y with its positions from `first` on replaced by read(h[:, first:], that slice): what the mixer
        reads from the edited states (C . h, S^T q), the unedited y before them (to the bit)."""
        after = slice(self.first, None)
        return torch.cat([y[:, :self.first], read(self.h[:, after], after)], dim=1)


def _units_changed(out: Tensor, received: Tensor, declared: bool) -> Tensor:
    """[batch pos unit 1 ...]: True where any entry of that unit's state at that position differs (glossary: unit)."""
    shape = (*out.shape[:3], *[1] * (out.ndim - 3))
    if declared:
        return torch.ones(shape, dtype=torch.bool, device=out.device)
    return (out != received).flatten(3).any(3).view(shape)


def through_state_hook(hook: HookPoint, value: Tensor, rebuild: Callable[[], Tensor], carry: Carry) -> StateEdit:
    """Pass a state trajectory through its hook and continue the recurrence after each edit.

    Each hook and tap of `hook` runs in turn (HookPoint.steps); after each one that changed anything,
    the units it set are fixed and the rest continued by `carry`, so the next one receives the
    continued trajectory. `clean` is None when nothing changed (the model keeps its fast path).
    `rebuild()` makes the clean trajectory again when the first hook edits it in place.

    Args:
        hook: the state's HookPoint (hook_h).
        value: the clean trajectory [batch pos *state].
        rebuild: recomputes `value` (for an in-place edit by the first hook).
        carry: the mixer's (e, fixed) -> d (module glossary).
    """
    if not hook.has_hooks or is_recording():  # (a recording of the forward order runs no hook)
        return StateEdit(hook(value), None, value.shape[1])
    x, fixed, clean, edited, first = value, None, value, False, value.shape[1]
    for n, step in enumerate(hook.steps()):
        version = _version(x)
        saved = x.clone() if version is None or n > 0 else None  # a later step's input has no rebuild
        out = step(x)
        if saved is not None:
            received = saved
            if n == 0:  # (the value itself may have been edited in place)
                clean = saved
        elif _version(x) != version:  # the first hook edited the clean trajectory in place
            received = clean = rebuild()
        else:
            received = x
        declared = getattr(out, _DECLARED, False)
        if out is received and not declared:  # returned None, or itself
            continue
        carries_grad = out is not received and out.requires_grad and torch.is_grad_enabled()
        new = _units_changed(out, received, declared)
        everywhere = bool(new.all())  # (a whole trajectory patched: no position to look for)
        changed = [] if everywhere else new.flatten(2).any(2).any(0).nonzero()[:, 0].tolist()
        if not (everywhere or carries_grad or changed):
            x = received
            continue
        edited = True
        first = 0 if everywhere or carries_grad else min(first, changed[0])
        fixed = new if fixed is None else fixed | new
        if everywhere or bool(fixed.all()):
            x = out
        else:
            x = torch.where(new, out, received + carry(out - received, fixed))
    return StateEdit(x, clean if edited else None, first)
