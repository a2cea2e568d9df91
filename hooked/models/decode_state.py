"""What incremental decoding carries between forwards: keys and values, conv windows, SSM states.

Glossary
    DecodeState   one per generation (TL's `past_kv_cache`): pass it as `model(tokens, state=state)`
                  and each forward reads only the NEW positions; the state grows by them
    entry         per module (keyed by the module object, so each Zamba2 shared-block invocation
                  keeps its own): attention (k, v) after rotary, kv heads not repeated (a `SharedKV`
                  in a selected state); a mixer's conv window (its last d_conv - 1 inputs) and
                  recurrent state h
    past_mask     [batch past] bool, the padding of the positions already read (None: none padded)
    next_position [batch] position id of the next real token of each row (left padding skipped)
    select        a state for other rows (`select(index)`: row i is row index[i]; rows repeated to read
                  several continuations of one prefix, as analysis.tasks.scoring does). Keys and
                  values are not copied: they become `SharedKV`s (shared_kv.py), the past read
                  through one row map shared by every layer, plus each row's own later positions;
                  conv windows and SSM states (one position's worth) are gathered
    entries_of    the entries of some modules only, positions rewound: a forward resumed at a later layer
                  (`start_at_layer`) reads the prefix again through the other modules
    owner         the model a state belongs to: the first model that completes a forward with it;
                  any other model, even one of the same config, refuses it (its entries are keyed by
                  the owner's modules), naming both. Copies (`select`, `entries_of`) keep the owner
    step          one forward with the state: `begin` opens it, every entry written during it is
                  pending, and `advance` (after the last block) commits the entries and the positions
                  together. A forward that raises (a hook, a refused lazy hook) commits nothing, so the
                  state stays as it was before that forward and can be used again
    stepping      the state of the forward running now (`stepping_state()`, None outside a forward with
                  a state): hooks that index positions (knockout) read the past length from it
    consistency   every module reads every position, so once `length` positions are read each module's
                  entry must hold them: a module with none (or keys of another length) is refused
                  (`StateMismatch`), as after a start_at_layer forward on a fresh state, whose lower
                  blocks never read the prefix
    cuts          what each knockout active on a module carries from step to step (cut_record.py): the
                  positions it resolved over the past and, for an SSM, the part of h that came from cut
                  sources. A module's cuts live as long as they are continued at every step: a step that
                  does not continue one (the knockout was not active) drops it

A left-padded prompt is read once with its mask; new tokens are real. An SSM's lazy hooks
(A_bar, B_bar, h, kernel) describe a whole sequence from a zero state, so they are refused while
decoding with a state (decode without it: `generate(..., use_past_kv_cache=False)`); the refusal is a
`StateRefused` (a ValueError), so a caller may fall back to whole-sequence forwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from hooked.models.shared_kv import RowMap, SharedKV


class StateRefused(ValueError):
    """A hook the state cannot serve is active (an SSM's lazy whole-sequence quantities)."""


class WrongModel(ValueError):
    """A DecodeState used with a model other than the one it belongs to."""


class StateMismatch(ValueError):
    """A module's entry does not hold the positions the state says it has read."""


class _Forward:
    """The forward running now: its DecodeState (None: a whole-sequence forward) and notes that hooks
    of that forward leave for each other (knockouts on one SSM mixer check that their edges differ)."""

    def __init__(self, state: DecodeState | None) -> None:
        self.state = state
        self.notes: dict[Any, Any] = {}


_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("hooked_forward", default=None)


def stepping_state() -> DecodeState | None:
    """The DecodeState of the forward running now, or None (a whole-sequence forward, or no forward)."""
    forward = _FORWARD.get()
    return None if forward is None else forward.state


def forward_notes() -> dict[Any, Any] | None:
    """A dict living as long as the forward running now (None outside a forward)."""
    forward = _FORWARD.get()
    return None if forward is None else forward.notes


@contextlib.contextmanager
def stepping(state: DecodeState | None) -> Iterator[None]:
    """Mark the blocks run inside as one forward, a step of `state` (None: a whole-sequence forward, also
    when a hook runs one inside a decoding step)."""
    token = _FORWARD.set(_Forward(state))
    try:
        yield
    finally:
        _FORWARD.reset(token)


def fingerprint(model: Any) -> str:
    """A short description of `model` for messages: class, sizes and identity."""
    cfg = getattr(model, "cfg", None)
    sizes = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("n_layers", "d_model", "d_vocab") if hasattr(cfg, k))
    return f"{type(model).__name__}({sizes}) at {id(model):#x}"


class DecodeState:
    def __init__(self) -> None:
        self.entries: dict[int, Any] = {}
        self._owners: dict[int, Any] = {}  # keeps the keyed modules alive while their ids are keys
        self.past_mask: Tensor | None = None
        self.next_position: Tensor | None = None
        self.length = 0
        self.batch: int | None = None  # rows of the positions held (None: none held yet)
        self._model: weakref.ref | None = None
        self._model_text = ""
        self._pending: dict[tuple[int, str], Any] | None = None
        self._stepping: Any = None  # the model of the open step

    def __repr__(self) -> str:
        owner = self._model_text or "no model yet"
        return f"DecodeState(length={self.length}, batch={self.batch}, {len(self.entries)} entries, of {owner})"

    # ---------------------------------------------------------------------------------- steps
    def begin(self, model: Any, batch: int) -> None:
        """Open a step of `model` on `batch` rows: refuse another model's state or a batch of another size,
        and discard what a failed earlier step left pending."""
        if self._model is not None and self._model() is not model:
            raise WrongModel(f"this DecodeState belongs to {self._model_text} (at position {self.length}), not to "
                             f"{fingerprint(model)}: decode each model with its own DecodeState()")
        if self.batch is not None and batch != self.batch:
            raise ValueError(f"this DecodeState holds {self.batch} rows (at position {self.length}); the input has "
                             f"{batch}: continue every row, or select() the rows first")
        self._pending = {}
        self._stepping = model

    # ----------------------------------------------------------------------------- positions
    def positions(self, mask: Tensor | None, batch: int, pos: int, device: torch.device) -> Tensor:
        """Position ids [batch pos] of the new positions, counted over real tokens."""
        start = self.next_position if self.next_position is not None else torch.zeros(batch, dtype=torch.long, device=device)
        steps = torch.arange(pos, device=device).expand(batch, pos) if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)
        return start[:, None] + steps

    def key_mask(self, mask: Tensor | None, batch: int, pos: int, device: torch.device) -> Tensor | None:
        """Padding of every key (past and new) [batch past+pos], or None when nothing is padded."""
        if self.past_mask is None and mask is None:
            return None
        past = self.past_mask if self.past_mask is not None else torch.ones(batch, self.length, dtype=torch.bool, device=device)
        new = mask if mask is not None else torch.ones(batch, pos, dtype=torch.bool, device=device)
        return torch.cat([past, new], dim=1)

    def advance(self, mask: Tensor | None, batch: int, pos: int, device: torch.device) -> None:
        """Record that the forward read `pos` more positions and commit its entries (called once, after the
        last block)."""
        cut_now = {key for key in (self._pending or {}) if key[1] == "cut"}
        for key in [k for k in self.entries if k[1] == "cut" and k not in cut_now]:
            del self.entries[key]  # a cut not continued in this step no longer describes the positions read
        if self._pending:
            self.entries.update(self._pending)
        if self._model is None and self._stepping is not None:
            self._model, self._model_text = weakref.ref(self._stepping), fingerprint(self._stepping)
        self._pending, self._stepping = None, None
        self.batch = batch
        self.past_mask = self.key_mask(mask, batch, pos, device)
        real = torch.full((batch,), pos, device=device) if mask is None else mask.long().sum(-1)
        self.next_position = (self.next_position if self.next_position is not None else 0) + real
        self.length += pos

    # ------------------------------------------------------------------------------- copies
    def select(self, index: Tensor | list[int]) -> DecodeState:
        """A new state whose row i is this state's row index[i] (rows may repeat); self is left as it is.
        index: a non-empty 1-D integer tensor (or list) of rows in [0, batch)."""
        index = self._row_index(index)
        out = self._copy_owner()
        out._owners, out.length, out.batch = dict(self._owners), self.length, len(index)
        maps: dict[Any, RowMap] = {}  # one row map per previous map (and device): every layer shares it
        out.entries = {key: _kv_rows(value, index, maps) if key[1] == "kv" else _rows(value, index)
                       for key, value in self.entries.items()}
        out.past_mask = None if self.past_mask is None else self.past_mask[index.to(self.past_mask.device)]
        out.next_position = None if self.next_position is None else self.next_position[index.to(self.next_position.device)]
        return out

    def _row_index(self, index: Any) -> Tensor:
        if self.batch is None:
            raise ValueError("select: this DecodeState has read nothing yet; run the prefix with it first")
        if isinstance(index, (list, tuple, range)):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in index):
                raise TypeError(f"select: index must hold integer rows, got {list(index)[:10]}")
            index = torch.tensor(list(index), dtype=torch.long)
        if not torch.is_tensor(index) or index.ndim != 1 or index.dtype not in (torch.int32, torch.int64):
            shown = f"a {index.dtype} tensor of shape {tuple(index.shape)}" if torch.is_tensor(index) else repr(index)
            raise TypeError(f"select: index must be a 1-D integer tensor (or list) of rows, got {shown}")
        if len(index) == 0:
            raise ValueError("select: index is empty; a state needs at least one row")
        bad = index[(index < 0) | (index >= self.batch)]
        if len(bad):
            raise ValueError(f"select: rows {bad.tolist()[:10]} are outside the state's {self.batch} rows [0, {self.batch})")
        return index.long()

    def entries_of(self, modules: Any) -> DecodeState:
        """A new state with the entries of `modules` only (an iterable of modules) and no position read:
        a forward resumed at a later layer with it reads the same positions again through the other
        modules (the kept entries must already hold them); tensors are shared, not copied."""
        keep = {id(m) for m in modules}
        out = self._copy_owner()
        out.batch = self.batch
        out.entries = {key: value for key, value in self.entries.items() if key[0] in keep}
        out._owners = {i: m for i, m in self._owners.items() if i in keep}
        return out

    def _copy_owner(self) -> DecodeState:
        out = DecodeState()
        out._model, out._model_text = self._model, self._model_text
        return out

    # ---------------------------------------------------------------------------- per module
    def _get(self, module: Any, kind: str) -> Any:
        key = (id(module), kind)
        if self._pending is not None and key in self._pending:
            return self._pending[key]
        return self.entries.get(key)

    def _put(self, module: Any, kind: str, value: Any) -> None:
        (self._pending if self._pending is not None else self.entries)[(id(module), kind)] = value
        self._owners[id(module)] = module

    def extend_kv(self, module: Any, k: Tensor, v: Tensor) -> tuple[SharedKV | None, Tensor, Tensor]:
        """(shared, k, v) with the new keys and values [batch pos n_kv_heads d_head] appended: shared None
        and (k, v) every position so far [batch past+pos n_kv_heads d_head]; or, in a selected state,
        the `SharedKV` (its shared past read through the row map) and (k, v) the rows' own positions
        after that past [batch own+pos n_kv_heads d_head]."""
        past = self._read(module, "kv")
        if past is not None:
            held = past.shared_positions + past.k1.shape[1] if isinstance(past, SharedKV) else past[0].shape[1]
            if held != self.length:
                self._mismatch(module, held)
        if isinstance(past, SharedKV):
            past = past.extend(k, v)
            self._put(module, "kv", past)
            return past, past.k1, past.v1
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        self._put(module, "kv", (k, v))
        return None, k, v

    def conv_window(self, module: Any, x: Tensor, width: int) -> Tensor:
        """The conv input with the previous `width - 1` inputs in front (zeros at the start)."""
        past = self._read(module, "conv")
        if past is None:
            past = x.new_zeros(x.shape[0], width - 1, x.shape[2])
        full = torch.cat([past, x], dim=1)
        self._put(module, "conv", full[:, full.shape[1] - (width - 1):])
        return full

    def history(self, module: Any, kind: str, x: Tensor, keep: int | None = None, fill: Any = 0) -> Tensor:
        """x [batch pos ...] with `module`'s earlier entries of `kind` in front: the last `keep` of them (`fill`
        where fewer were read), or every one (keep None: they must cover the positions read so far)."""
        past = self._get(module, kind)
        if keep is None:
            if past is None and self.length > 0 or past is not None and past.shape[1] != self.length:
                self._mismatch(module, 0 if past is None else past.shape[1])
        elif past is None:
            past = x.new_full((x.shape[0], keep, *x.shape[2:]), fill)
        full = x if past is None else torch.cat([past, x], dim=1)
        self._put(module, kind, full if keep is None else full[:, full.shape[1] - keep:])
        return full

    def conv_past(self, module: Any) -> Tensor | None:
        """The previous `width - 1` conv inputs [batch width-1 channels] before this step's (None: none yet)."""
        return self.entries.get((id(module), "conv"))

    def ssm_state(self, module: Any) -> Tensor | None:
        return self._read(module, "h")

    def _read(self, module: Any, kind: str) -> Any:
        """A module's entry, which must exist once positions have been read (every module reads each one)."""
        past = self._get(module, kind)
        if past is None and self.length > 0:
            self._mismatch(module, 0)
        return past

    def _mismatch(self, module: Any, held: int) -> None:
        where = next((m.name.rsplit(".", 1)[0] for m in module.children() if isinstance(getattr(m, "name", None), str)),
                     type(module).__name__)
        raise StateMismatch(
            f"this DecodeState has read {self.length} positions, but {where} holds {held} of them: the state was "
            "filled by forwards that skipped that module (start_at_layer with a fresh DecodeState: its lower blocks "
            "never read the prefix; resume with entries_of of a state that did), or an entries_of copy is run "
            "from a layer it does not start at")

    def set_ssm_state(self, module: Any, h: Tensor) -> None:
        self._put(module, "h", h)

    def past_cuts(self, module: Any) -> tuple[Any, ...]:
        """The cuts (cut_record.CutRecord) active on `module` in every earlier step, as committed."""
        return self.entries.get((id(module), "cut"), ())

    def step_cuts(self, module: Any) -> tuple[Any, ...]:
        """The cuts on `module` written in the step now open."""
        return (self._pending or {}).get((id(module), "cut"), ())

    def add_cut(self, module: Any, record: Any) -> None:
        """Record a cut continued (or started) on `module` in this step."""
        self._put(module, "cut", self.step_cuts(module) + (record,))

    def refuse_lazy(self, module: Any, hooks: list[Any]) -> None:
        active = [h.name for h in hooks if h.is_active]
        if active:
            raise StateRefused(f"{active} describe the whole sequence from a zero state and cannot be built while "
                             "decoding with a state; generate with use_past_kv_cache=False to hook them")


def _kv_rows(value: tuple[Tensor, Tensor] | SharedKV, index: Tensor, maps: dict[Any, RowMap]) -> SharedKV:
    """Rows `index` of a keys/values entry, sharing its past: a plain (k, v) becomes that past."""
    if isinstance(value, SharedKV):
        key = id(value.rows)
        if key not in maps:
            maps[key] = value.rows.compose(index)
        return value.select(maps[key], index)
    k, v = value
    key = ("plain", k.shape[0], k.device)
    if key not in maps:
        maps[key] = RowMap.of(index.to(k.device), k.shape[0])
    return SharedKV.of(k, v, maps[key])


def _rows(value: Any, index: Tensor) -> Any:
    """Rows `index` of an entry: a tensor [batch ...], a cut record, or a tuple of them."""
    if isinstance(value, tuple):
        return tuple(_rows(v, index) for v in value)
    if hasattr(value, "select_rows"):
        return value.select_rows(index)
    return value[index.to(value.device)]
