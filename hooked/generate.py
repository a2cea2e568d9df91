"""`model.generate`: TransformerLens's signature, one position per new token.

Glossary
    prompt          a str, a list of str (left-padded, with its mask) or tokens [batch pos] / [pos]
    state           a DecodeState (models/decode_state.py): attention keys and values, SSM conv
                    windows and recurrent states, so each new token costs one position's forward
                    (use_past_kv_cache=False recomputes the whole prefix every step instead)
    sampling        logits / temperature, minus freq_penalty per earlier occurrence, then top-k, then top-p (the smallest set of tokens whose
                    probability reaches top_p), then a draw; do_sample=False (or temperature 0) is
                    greedy (argmax). `seed` seeds a private generator (the global RNG is untouched).
    stop_at_eos     a row that produced eos (any of a list of ids) keeps emitting eos; generation stops
                    when every row has

Hooks attached around `generate` fire at every forward, on the new positions only.
Returns what came in: text -> text (prompt included, special tokens dropped, as TL), tokens ->
tokens [batch pos+new]
(return_type="str" / "tokens" forces one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hooked.models.decode_state import DecodeState
from hooked.validate import AnyOf, Flag, Instance, Integer, OneOf, Number, Seq, Text, checked


def next_token_logits(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                      freq_penalty: float = 0.0, seen: Tensor | None = None) -> Tensor:
    """The sampling distribution's logits [batch d_vocab] (float32 or wider; -inf outside top-k / top-p)
    from the last position's logits: divided by temperature (> 0), minus freq_penalty per earlier
    occurrence in `seen` [batch pos], then top-k (clamped to the vocabulary, as TL), then top-p."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if freq_penalty and seen is not None:
        counts = torch.stack([torch.bincount(row, minlength=logits.shape[-1]) for row in seen])
        logits = logits - freq_penalty * counts[:, :logits.shape[-1]]
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the first token past top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_next(logits: Tensor, *, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None, freq_penalty: float = 0.0, seen: Tensor | None = None) -> Tensor:
    """Next token per row from the last position's logits [batch d_vocab]: the argmax when greedy
    (do_sample=False or temperature 0, as TL), else a draw from `next_token_logits`."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    probs = next_token_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                              freq_penalty=freq_penalty, seen=seen).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _vocab(args: dict[str, Any]) -> int:
    return args["model"].cfg.d_vocab


TOKEN_ID = Integer(ge=0, lt=_vocab)


@torch.no_grad()
@checked(input=AnyOf(Text(empty=True), Seq(Text(empty=True)), Instance(Tensor, "a tensor of token ids")),
         max_new_tokens=Integer(ge=0), stop_at_eos=Flag(), eos_token_id=AnyOf(TOKEN_ID, Seq(TOKEN_ID), none=True),
         do_sample=Flag(), top_k=Integer(ge=1, none=True), top_p=Number(gt=0, le=1, none=True), temperature=Number(ge=0),
         freq_penalty=Number(ge=0), use_past_kv_cache=Flag(), prepend_bos=Flag(none=True),
         return_type=OneOf("input", "str", "tokens"), seed=Integer(ge=0, lt=2**63, none=True), verbose=Flag())
def generate(model: Any, input: str | list[str] | Tensor = "", max_new_tokens: int = 10, stop_at_eos: bool = True,
             eos_token_id: int | list[int] | None = None, do_sample: bool = True, top_k: int | None = None,
             top_p: float | None = None, temperature: float = 1.0, freq_penalty: float = 0.0,
             use_past_kv_cache: bool = True,
             prepend_bos: bool | None = None, return_type: str = "input", seed: int | None = None,
             verbose: bool = False) -> str | list[str] | Tensor:
    """Continue `input` by up to `max_new_tokens` tokens (see the module docstring).

    Arguments as TransformerLens's, checked at entry (hooked/validate.py): max_new_tokens >= 0 (0 returns
    the input); eos_token_id one id or a list of ids in [0, d_vocab) (a row stops at any of them and is
    then padded with the tokenizer's eos, else the list's first, as TL); top_k >= 1 (larger than the
    vocabulary keeps it all); top_p in (0, 1]; temperature >= 0 (0 is greedy); freq_penalty >= 0.
    Every prompt row must hold at least one token.
    """
    text_in = isinstance(input, (str, list))
    if text_in:
        tokens, mask = model.tokenize(input, prepend_bos=prepend_bos, padding_side="left")
        empty = (~mask.bool()).all(-1).nonzero().flatten().tolist()
        if prepend_bos is False:  # tokenize keeps a lone BOS rather than return nothing: "" has no token then
            empty = [i for i, text in enumerate([input] if isinstance(input, str) else input) if not text]
        if empty:
            where = "input" if isinstance(input, str) else f"input{empty}"
            raise ValueError(f"generate: {where} tokenizes to no token; a prompt needs at least one (pass "
                             "prepend_bos=True to start it with BOS, or drop the empty rows)")
        mask = None if bool(mask.all()) else mask.bool()
    else:
        tokens, mask = model.check_tokens(input), None
    tok = getattr(model, "tokenizer", None)
    stop_ids, pad_id = [], None
    if stop_at_eos:
        if eos_token_id is None:
            eos_token_id = getattr(tok, "eos_token_id", None)
            if eos_token_id is None:
                raise ValueError("generate: stop_at_eos needs an eos token: pass eos_token_id= or stop_at_eos=False")
        stop_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        tok_eos = getattr(tok, "eos_token_id", None)
        pad_id = eos_token_id if not isinstance(eos_token_id, list) else (tok_eos if tok_eos is not None else stop_ids[0])
    stops = torch.tensor(stop_ids, dtype=torch.long, device=tokens.device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=tokens.device).manual_seed(seed)
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    state = DecodeState() if use_past_kv_cache else None
    out, step_input, step_mask = tokens, tokens, mask
    for _ in range(max_new_tokens):
        if state is not None:
            logits = model(step_input, step_mask, state=state)
        else:
            full_mask = None if mask is None else torch.cat([mask, torch.ones_like(out[:, tokens.shape[1]:],
                                                                                     dtype=torch.bool)], 1)
            logits = model(out, full_mask)
        new = sample_next(logits[:, -1], do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator, freq_penalty=freq_penalty, seen=out)
        if stop_at_eos:
            new = torch.where(finished, torch.full_like(new, pad_id), new)
            finished |= torch.isin(new, stops)
        out = torch.cat([out, new[:, None]], dim=1)
        step_input, step_mask = new[:, None], None
        if verbose:
            print(model.to_string(out))
        if stop_at_eos and bool(finished.all()):
            break
    as_text = return_type == "str" or (return_type == "input" and text_in)
    if not as_text:
        return out
    texts = [model.tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in out]  # as TL (no pad, bos, eos)
    return texts[0] if isinstance(input, str) else texts
