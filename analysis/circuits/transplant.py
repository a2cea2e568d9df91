"""State transplants and state patchscopes, through the decoding state (hooked/models/decode_state.py).

Glossary
    state       a DecodeState after reading some positions: every SSM mixer's recurrent state h and conv
                window, every attention layer's keys and values
    site        an SSM mixer ("blocks.{l}.mixer", from the mixer protocol: every TokenMixer whose units are
                "ssm"); `units` restricts a transplant to some of its units (Mamba-2 heads, Mamba-1 channels)
    transplant  prompt B read up to and including position `at`, then every chosen site's h replaced by
                prompt A's h after A's last token (A and B may differ in length), then B continued from
                there. Equal to reading B whole with hook_h[:, at] set to A's state by hand (the recurrence
                continues from an edited state: DESIGN section 4) and hook_y[:, at] kept: the output at
                `at` itself was computed before the transplant (`hand_edit_hooks`)
    whole state sites="all": B's remaining tokens continue from A's entire decoding state (attention keys and
                values included): the same as reading A followed by those tokens
    patchscope  decoding from a transplanted state (Ghandeharioun et al. 2024's patchscopes, with the state
                as the patched representation): what does the target prompt say, given A's state?
Exact on every SSM family: the decoding path and the whole-sequence path compute the same recurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hooked.models.decode_state import DecodeState
from hooked.validate import as_index
from hooked.models.model_map import model_map


def ssm_sites(model: Any) -> dict[str, Any]:
    """{"blocks.{l}.{name}": mixer} of every recurrent mixer (the model map's), in forward order."""
    return {s.path: s.module for s in model_map(model).mixers() if s.recurrent}


def _sites(model: Any, sites: Any) -> dict[str, Any]:
    every = ssm_sites(model)
    if not every:
        raise ValueError("this model has no SSM mixer: nothing holds a recurrent state to transplant")
    if sites is None:
        return every
    names = [sites] if isinstance(sites, str) else list(sites)
    by_layer = {s.layer: s.path for s in model_map(model).mixers() if s.recurrent}  # a layer: its recurrent mixer
    names = [by_layer.get(n, f"layer {n}") if isinstance(n, int) else n for n in names]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise KeyError(f"{unknown} are not SSM mixers of this model; they are {list(every)}")
    return {n: every[n] for n in names}


def copy_state(state: DecodeState) -> DecodeState:
    """An independent copy (rows gathered, keys and values shared read-only)."""
    return state.select(torch.arange(state.batch, device=state.next_position.device))


@torch.no_grad()
def read(model: Any, tokens: Tensor, state: DecodeState | None = None) -> tuple[Tensor, DecodeState]:
    """(logits, state) after reading `tokens` [batch pos] (continuing `state`, left as it was, when given)."""
    state = DecodeState() if state is None else copy_state(state)
    logits = model(model.check_tokens(tokens), state=state)
    return logits, state


def transplant_state(model: Any, recipient: DecodeState, donor: DecodeState, sites: Any = None,
                     units: Sequence[int] | None = None) -> DecodeState:
    """A copy of `recipient` whose chosen sites' states h (their `units` only, when given) are the donor's.
    A donor of one row is given to every recipient row."""
    out = copy_state(recipient)
    for name, m in _sites(model, sites).items():
        h_r, h_d = recipient.ssm_state(m), donor.ssm_state(m)
        if h_r is None or h_d is None:
            raise ValueError(f"{name}: both states must have read a position (no state h yet)")
        h_d = h_d.to(h_r).expand_as(h_r) if h_d.shape[0] == 1 else h_d.to(h_r)
        if h_d.shape != h_r.shape:
            raise ValueError(f"{name}: donor state {tuple(h_d.shape)} does not fit the recipient's {tuple(h_r.shape)}")
        new = h_d.clone() if units is None else h_r.clone()
        if units is not None:
            idx = torch.as_tensor(list(units), device=h_r.device)
            new[:, idx] = h_d[:, idx]
        out.set_ssm_state(m, new)
    return out


def transplant(model: Any, donor: Tensor, recipient: Tensor, at: int, sites: Any = None,
               units: Sequence[int] | None = None) -> tuple[Tensor, DecodeState]:
    """(logits of recipient's positions after `at` [batch pos-at-1 d_vocab], the state after them): recipient
    read up to and including `at`, the chosen states replaced by the donor's after its last token, then
    continued. sites="all": continue from the donor's whole decoding state instead."""
    recipient = model.check_tokens(recipient)
    at = as_index(at, recipient.shape[1], "transplant: at", "positions of the recipient")
    if at == recipient.shape[1] - 1:
        raise ValueError(f"transplant: at={at}: the recipient ({recipient.shape[1]} tokens) must have a token after it")
    _, donor_state = read(model, donor)
    if sites == "all":
        state = donor_state
        if state.batch != recipient.shape[0]:
            state = state.select(torch.zeros(recipient.shape[0], dtype=torch.long))
    else:
        _, state = read(model, recipient[:, :at + 1])
        state = transplant_state(model, state, donor_state, sites, units)
    logits, state = read(model, recipient[:, at + 1:], state)
    return logits, state


def hand_edit_hooks(model: Any, donor: Tensor, recipient: Tensor, at: int, sites: Any = None,
                    units: Sequence[int] | None = None) -> list[tuple[str, Any]]:
    """Forward hooks for the whole-sequence run of `recipient` that a transplant must equal: each chosen
    site's hook_h[:, at] set to the donor's last state, and its hook_y[:, at] kept as the plain run's (a
    transplant replaces the state after position `at` was read; an edited hook_h also changes y_at)."""
    chosen = _sites(model, sites)
    with torch.no_grad():
        _, d_cache = model.run_with_cache(model.check_tokens(donor), names_filter=[m.hook_h.name for m in chosen.values()])
        _, r_cache = model.run_with_cache(model.check_tokens(recipient), names_filter=[m.hook_y.name for m in chosen.values()])
    hooks = []
    for m in chosen.values():
        h_d, y_at = d_cache[m.hook_h.name][:, -1], r_cache[m.hook_y.name][:, at]

        def on_h(h: Tensor, hook: Any, h_d: Tensor = h_d) -> Tensor:
            h = h.clone()
            src = h_d.to(h).expand_as(h[:, at]) if h_d.shape[0] == 1 else h_d.to(h)
            if units is None:
                h[:, at] = src
            else:
                idx = list(units)
                h[:, at, idx] = src[:, idx]
            return h

        def on_y(y: Tensor, hook: Any, y_at: Tensor = y_at) -> Tensor:
            y = y.clone()
            y[:, at] = y_at.to(y)
            return y

        hooks += [(m.hook_h.name, on_h), (m.hook_y.name, on_y)]
    return hooks


@torch.no_grad()
def generate_from(model: Any, state: DecodeState, tokens: Tensor, max_new_tokens: int) -> Tensor:
    """Greedy continuation: read `tokens` [batch pos] from (a copy of) `state`, then `max_new_tokens` tokens,
    each from the last; returns the new tokens [batch max_new_tokens]."""
    logits, state = read(model, tokens, state)
    out = []
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, state=state)
    return torch.cat(out, dim=1) if out else tokens.new_zeros((tokens.shape[0], 0))


def patchscope(model: Any, donor: Tensor, target: Tensor, at: int, max_new_tokens: int = 10, sites: Any = None,
               units: Sequence[int] | None = None) -> Tensor:
    """Greedy tokens [batch max_new_tokens] after the target prompt, whose chosen states at position `at`
    were replaced by the donor's (a state patchscope); `at` = -2 transplants just before the target's last token."""
    target = model.check_tokens(target)
    at = at + target.shape[1] if at < 0 else at
    _, state = read(model, target[:, :at + 1])
    _, donor_state = read(model, donor)
    state = transplant_state(model, state, donor_state, sites, units)
    return generate_from(model, state, target[:, at + 1:], max_new_tokens)
