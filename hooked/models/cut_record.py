"""A knockout's memory across decoding steps: cut exactly what the whole-sequence forward would cut.

Glossary
    offset      positions already read (`DecodeState.length`); a step reads positions [offset, N)
    target, source  bool [batch N]: the knockout's positions resolved over the whole sequence so far
                (past and new); in a whole-sequence forward of N positions the cut edges are
                (j <- i) with target[j], source[i], i <= j
    spec        what a cut does besides its positions: ("attn", mode) or ("ssm", channels, cut_conv)
    CutRecord   one knockout on one module after a step: its spec, the target and source masks it
                resolved over every position read, and (SSM) h_cut, the part of the state h that came
                from cut sources: h_cut_t = A_bar_t h_cut_{t-1} + [source t] B_bar_t u_t, so that
                C_j . h_cut_j = sum_{i cut, i <= j} K[j, i] u_i is what y_j loses at a target j, past
                sources included (the state itself holds only their sum with the kept ones)

Why a step is exact. The past positions were computed by earlier steps; they equal the whole-sequence
forward's only if those steps cut the same edges into them. A step continues a record whose spec is its
own and whose masks equal its masks restricted to the past: by induction every past target lost exactly
the edges it loses in the whole-sequence forward, and h_cut holds every past source. With no such
record (the knockout was not active when the past was read) the step is exact only if no cut edge ends
in the past (and, for an SSM, no past position is a source: h_cut would be unknown); otherwise it is
refused (`PastCutMismatch`), never answered differently from the whole-sequence forward. Negative
positions count from the end of the sequence read so far, so they move with each step: a knockout
with targets=[-1] is exact in the prefill and refused at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from hooked.models.decode_state import DecodeState, StateRefused

REMEDY = ("give positions that do not move (non-negative ones, or bool masks over the whole sequence: columns "
          "past the positions read so far are positions not read yet), enter the knockout before the first "
          "forward with this state, or decode without a state (generate(..., use_past_kv_cache=False))")


class PastCutMismatch(StateRefused):
    """A knockout while decoding that would cut, in the positions already read, other edges than were cut
    when they were read: the whole-sequence forward would differ there."""


@dataclass(frozen=True, eq=False)
class CutRecord:
    spec: tuple
    target: Tensor  # [batch N] bool
    source: Tensor  # [batch N] bool
    h_cut: Tensor | None = None  # SSM: [batch ...h] the state's part from cut sources (None: zero)
    parent: CutRecord | None = None  # the record this step continued

    def select_rows(self, index: Tensor) -> CutRecord:
        idx = index.to(self.target.device)
        h_cut = None if self.h_cut is None else self.h_cut[index.to(self.h_cut.device)]
        return CutRecord(self.spec, self.target[idx], self.source[idx], h_cut)


def _shown(mask: Tensor) -> str:
    """The positions of a mask's rows, short: "[2, 3]" (one row, or rows alike) or per row."""
    rows = [r.nonzero().flatten().tolist() for r in mask]
    if all(r == rows[0] for r in rows):
        return str(rows[0][:12])
    return "; ".join(f"row {b}: {r[:12]}" for b, r in enumerate(rows[:4]))


def resume_cut(state: DecodeState, module: Any, where: str, spec: tuple, target: Tensor, source: Tensor,
               needs_h: bool) -> CutRecord | None:
    """The record this step continues (None: the cut starts now), or PastCutMismatch when the step cannot
    cut what the whole-sequence forward cuts (module docstring). target, source: [batch N], N > offset."""
    offset = state.length
    past_t, past_s = target[:, :offset], source[:, :offset]
    continued = {id(r.parent) for r in state.step_cuts(module)}  # two knockouts on one module: one record each
    same_spec = [r for r in state.past_cuts(module) if r.spec == spec and id(r) not in continued]
    for record in same_spec:
        if record.target.shape == past_t.shape and bool((record.target == past_t).all()) \
                and bool((record.source == past_s).all()):
            return record
    if offset == 0:
        return None
    if same_spec:
        then = same_spec[0]
        raise PastCutMismatch(
            f"knockout at {where} while decoding: over the {offset} positions already read, its targets are "
            f"{_shown(past_t)} and sources {_shown(past_s)} now, but were {_shown(then.target)} and "
            f"{_shown(then.source)} when those positions were read, so a whole-sequence forward would cut other "
            f"edges there (negative positions count from the end, which moves with every step). {REMEDY}")
    reached = past_s.long().cumsum(-1) > 0  # a source at or before each past position
    if bool((past_t & reached).any()) or (needs_h and bool(past_s.any())):
        what = "sources" if needs_h and bool(past_s.any()) else "edges into"
        raise PastCutMismatch(
            f"knockout at {where} starts while decoding, at position {offset}, but the positions before were read "
            f"without it and it has {what} them (targets {_shown(past_t)}, sources {_shown(past_s)} among the "
            f"first {offset}): what it would cut there is not in the state. {REMEDY}")
    return None
