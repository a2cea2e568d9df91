"""What every hooked model shares: tokens in, logits out, blocks in between.

Glossary
    tokens          [batch pos] integer ids
    attention_mask  [batch pos], 1 for real tokens, 0 for padding (left or right)
    resid           [batch pos d_model] the residual stream
    Context         what every block may need besides the residual: the mask, position ids
                    (counted over real tokens only, so left padding does not shift positions), the
                    tokens, the original embedding (Zamba2's shared blocks read it), and the
                    DecodeState of incremental decoding (None otherwise; decode_state.py)

A model subclass builds `self.blocks` (an nn.ModuleList whose blocks take `(resid, ctx)`),
`self.ln_final`, `self.unembed`, implements `embed_input(tokens, ctx) -> resid`, and calls
`self.setup()` at the end of its `__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from hooked.hook_points import HookedRootModule, hook_free
from hooked.models.decode_state import DecodeState, stepping
from hooked.sae.methods import SAEMethods
from hooked.tl_config import attach
from hooked.tl_keywords import refuse_tl_keywords
from hooked.tl_switches import TLSwitches
from hooked.validate import AnyOf, Flag, Instance, Integer, OneOf, Seq, Text, WrongType, check, checked, layer_bound, token_ids
from hooked.weights import ModelWeights


TEXTS = AnyOf(Text(empty=True), Seq(Text(empty=True)))  # one text or a batch of them


@dataclass
class Context:
    attention_mask: Bool[Tensor, "batch pos"] | None
    position_ids: Int[Tensor, "batch pos"]
    tokens: Int[Tensor, "batch pos"] | None = None
    embedding: Float[Tensor, "batch pos d_model"] | None = None
    state: DecodeState | None = None
    key_mask: Bool[Tensor, "batch keys"] | None = None  # with a state: padding of past and new keys

    def keys_mask(self) -> Bool[Tensor, "batch keys"] | None:
        """Padding of every key an attention layer sees (the past ones too while decoding)."""
        return self.key_mask if self.state is not None else self.attention_mask

    def to(self, device: str | torch.device) -> "Context":
        """A copy with every tensor field on `device`, the rest (the decoding state) kept as it is: a block
        on another device gets its Context so (accelerate moves a module's arguments with `.to`), and
        while decoding it must read and extend the same state, and see the padding of the past keys."""
        return Context(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})


def _moved(value: Any, device: str | torch.device) -> Any:
    return value.to(device) if torch.is_tensor(value) else value


def lm_loss(logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"],
            mask: Bool[Tensor, "batch pos"] | None, per_token: bool = False) -> Tensor:
    """-log p(next token), mean over positions whose token and next token are real (TL's loss).
    The mean of no position is refused (a sequence of one token, or rows with no two real tokens in a row)."""
    if tokens.shape[1] < 2 and not per_token:
        raise ValueError(f"return_type='loss' needs sequences of at least 2 tokens (a next token to predict), "
                         f"got {tokens.shape[1]}")
    log_probs = logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    if mask is not None:
        keep = mask[:, :-1] & mask[:, 1:]
        log_probs = log_probs.masked_fill(~keep, 0.0)
        n = keep.sum()
        if not per_token and int(n) == 0:
            raise ValueError("return_type='loss': no position has a real token followed by a real token "
                             "(attention_mask leaves nothing to predict)")
    else:
        n = log_probs.numel()
    return -log_probs if per_token else -log_probs.sum() / n


class HookedModel(SAEMethods, TLSwitches, ModelWeights, HookedRootModule):
    """Base class: validation of inputs, tokenizer helpers, `start_at_layer` / `stop_at_layer`.

    BOS and padding of text (TransformerLens's switches): `default_prepend_bos` None (hooked's default)
    keeps the tokenizer's own choice; True / False prepend or drop BOS as TL's `cfg.default_prepend_bos`
    does (TL's default is True: `loaders.tl.HookedTransformer` sets it). `default_padding_side` pads
    a batch of texts given to the model ("left", with the mask; TL-style models: "right", as TL).
    Every text-taking call also takes `prepend_bos=` / `padding_side=`, overriding these for that call.
    """

    tokenizer: Any = None
    default_prepend_bos: bool | None = None
    default_padding_side: str = "left"

    @property
    def cfg(self) -> Any:
        """The family's config, with TransformerLens's derived fields (device, dtype, ...: tl_config.py)."""
        return attach(self.__dict__["_raw_cfg"], self)

    @cfg.setter
    def cfg(self, value: Any) -> None:
        self.__dict__["_raw_cfg"] = value

    @property
    def dims(self) -> dict[str, int]:
        """Sizes of the axes every hook may use (hook_points.py); modules below add their own."""
        return {"d_model": self.cfg.d_model, "d_vocab": self.cfg.d_vocab}

    # ---------------------------------------------------------------------------- to override
    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        raise NotImplementedError

    def resid_writers(self, layer: int) -> list[str]:
        """Hook names of the outputs block `layer` adds to the residual stream (its `writers()`)."""
        return [w.out_hook.name for w in self.blocks[layer].writers()]

    # --------------------------------------------------------------------------------- forward
    def forward(
        self,
        input: Tensor | str | list[str],  # tokens [batch pos] or [pos], text, or a residual (start_at_layer)
        attention_mask: Tensor | None = None,
        *,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        tokens: Tensor | None = None,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
        state: DecodeState | None = None,
        prepend_bos: bool | None = None,
        padding_side: str | None = None,
        **tl_only: Any,
    ) -> Any:
        """Logits [batch pos d_vocab], or the residual before block `stop_at_layer` when it is given.

        With `start_at_layer`, `input` is the residual stream entering that block (e.g. returned by a
        run with `stop_at_layer`); pass the same `attention_mask`, and `tokens` where a model needs
        them past the embedding (Zamba2).
        return_type (TransformerLens's): "logits", "loss" (mean next-token cross-entropy over the
        positions whose token and next token are real; [batch pos-1] with loss_per_token), "both"
        ((logits, loss)) or None.
        state: a DecodeState (TL's past_kv_cache): `input` holds only the new tokens, the model
        reads the past from the state and adds the new positions to it (hooks see new positions).
        With `start_at_layer` too, the state must already hold the new positions for the blocks below
        (DecodeState.entries_of: a resumed run); `stop_at_layer` may only be the last layer (the final
        residual, before ln_final).
        prepend_bos, padding_side (TransformerLens's): how text input is tokenized (see the class
        docstring); ignored for tokens, as TL ignores them. TL's `past_kv_cache` and
        `shortformer_pos_embed` are refused by name (tl_keywords.py).
        """
        refuse_tl_keywords(tl_only)
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if return_type in ("loss", "both"):
            check(loss_per_token, "loss_per_token", Flag())
        if isinstance(input, (str, list)):
            if attention_mask is not None:
                raise ValueError("attention_mask is computed from text; pass tokens to give your own mask")
            input, attention_mask = self.tokenize(input, prepend_bos, padding_side)
        n = self.cfg.n_layers
        start = layer_bound(start_at_layer, n, "start_at_layer", default=0)
        stop = layer_bound(stop_at_layer, n, "stop_at_layer", default=n)
        if start > stop:
            raise ValueError(f"start_at_layer ({start}) is after stop_at_layer ({stop})")
        if state is not None and stop != n:
            raise ValueError("state= records every layer of the new positions: stop_at_layer must be the last "
                             f"({n}) or None, got {stop_at_layer}")
        if start == 0 and start_at_layer is None:
            tokens = self.check_tokens(input)
            input = tokens
            ctx = self.make_context(tokens.shape, attention_mask, tokens, input.device, state)
            resid = self.embed_input(tokens, ctx)
        else:
            if not torch.is_tensor(input) or not input.is_floating_point() or input.ndim != 3:
                raise ValueError("with start_at_layer, input must be the residual stream [batch pos d_model]")
            width = self.dims.get("d_stream", self.cfg.d_model)  # d_stream: hyper-connected streams (Qwen4-Exp)
            if input.shape[-1] != width or input.shape[1] == 0:
                raise ValueError(f"with start_at_layer, input must be the residual stream [batch pos d_model="
                                 f"{width}] with pos >= 1, got shape {tuple(input.shape)}")
            p = next(self.parameters(), None)
            if p is not None and input.dtype != p.dtype:
                raise ValueError(f"with start_at_layer, the residual's dtype must be the model's ({p.dtype}), "
                                 f"got {input.dtype}")
            if tokens is not None:
                tokens = self.check_tokens(tokens)
            ctx = self.make_context(input.shape[:2], attention_mask, tokens, input.device, state)
            resid = input
        if state is None and hook_free():  # nothing reads the forward's marks (and compiling sees no context)
            for block in self.blocks[start:stop]:
                resid = block(resid, ctx)
        else:
            with stepping(state):  # hooks indexing positions (knockout) read the past length from the state
                for block in self.blocks[start:stop]:
                    resid = block(resid, ctx)
        if state is not None:
            state.advance(ctx.attention_mask, *resid.shape[:2], resid.device)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        if return_type in ("logits", None):
            return logits if return_type == "logits" else None
        if tokens is None:
            raise ValueError("return_type='loss' needs the tokens: pass tokens= with start_at_layer")
        loss = lm_loss(logits, tokens, ctx.attention_mask, loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def loss_fn(self, logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
                per_token: bool = False) -> Tensor:
        """TL's loss: next-token cross-entropy over positions whose token and next token are real."""
        mask = None if attention_mask is None else attention_mask.to(logits.device).bool()
        return lm_loss(logits, tokens.to(logits.device), mask, per_token)

    @checked(input=AnyOf(TEXTS, Instance(Tensor, "a tensor of token ids")), max_new_tokens=Integer(ge=0))
    def generate(self, input: str | list[str] | Tensor = "", max_new_tokens: int = 10, **kwargs: Any) -> Any:
        """TransformerLens's generate (greedy or sampled; incremental state): hooked/generate.py."""
        from hooked.generate import generate

        return generate(self, input, max_new_tokens, **kwargs)

    def _batch_pos(self, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        """(batch, pos) of a forward's input (text too), for run_with_cache's size check."""
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, (str, list)) and self.tokenizer is not None:
            return tuple(self.tokenize(x, kwargs.get("prepend_bos"), kwargs.get("padding_side"))[0].shape)
        return super()._batch_pos(args, kwargs)

    # ------------------------------------------------------------------------------- checking
    def check_tokens(self, tokens: Any) -> Int[Tensor, "batch pos"]:
        if not torch.is_tensor(tokens):
            raise TypeError(f"tokens must be a tensor of ids, a string or a list of strings, got {type(tokens).__name__}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.dtype not in (torch.int64, torch.int32):  # int8 / int16 / uint8 ids: the embedding takes int64
            tokens = tokens.long()
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [batch pos] with pos >= 1, got shape {tuple(tokens.shape)}")
        bad = (tokens < 0) | (tokens >= self.cfg.d_vocab)
        if bad.any():
            ids = sorted(set(tokens[bad].tolist()))[:10]
            raise ValueError(f"token ids outside the vocabulary [0, {self.cfg.d_vocab}): {ids}")
        return tokens

    def make_context(self, shape: tuple[int, int] | torch.Size, attention_mask: Tensor | None,
                     tokens: Tensor | None, device: torch.device, state: DecodeState | None = None) -> Context:
        ctx = self._plain_context(shape, attention_mask, tokens, device)
        if ctx.attention_mask is not None and (state is None or state.length == 0):
            empty = (~ctx.attention_mask.any(-1)).nonzero().flatten().tolist()
            if empty:  # a row that reads nothing has no defined output
                raise ValueError(f"attention_mask: rows {empty[:10]} have no real token (all 0)")
        if state is None:
            return ctx
        batch, pos = int(shape[0]), int(shape[1])
        state.begin(self, batch)
        ctx.state = state
        ctx.position_ids = state.positions(ctx.attention_mask, batch, pos, device)
        ctx.key_mask = state.key_mask(ctx.attention_mask, batch, pos, device)
        return ctx

    def _plain_context(self, shape: tuple[int, int] | torch.Size, attention_mask: Tensor | None,
                       tokens: Tensor | None, device: torch.device) -> Context:
        batch, pos = int(shape[0]), int(shape[1])
        if attention_mask is None:
            position_ids = torch.arange(pos, device=device).expand(batch, pos)
            return Context(None, position_ids, tokens)
        if not torch.is_tensor(attention_mask):
            attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.ndim == 1:
            attention_mask = attention_mask[None]
        if tuple(attention_mask.shape) != (batch, pos):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, tokens are {(batch, pos)}")
        if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        if mask.all():  # nothing padded: the plain causal path, bit-identical to no mask
            return Context(None, torch.arange(pos, device=device).expand(batch, pos), tokens)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return Context(mask, position_ids, tokens)

    # ------------------------------------------------------------------------------ tokenizer
    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; load it from a checkpoint that has one or set model.tokenizer")
        return self.tokenizer

    @checked(text=TEXTS, prepend_bos=Flag(none=True), padding_side=OneOf("left", "right", none=True),
             move_to_device=Flag())
    def tokenize(self, text: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                 move_to_device: bool = True) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """(tokens, attention_mask) for one text or a batch, padded on `padding_side`
        (None: `default_padding_side`).

        prepend_bos=None follows `default_prepend_bos` (None there: the tokenizer's own choice);
        True adds BOS where the tokenizer does not; False drops the one it adds.
        """
        tok = self._need_tokenizer()
        if prepend_bos is None:
            prepend_bos = self.default_prepend_bos
        padding_side = self.default_padding_side if padding_side is None else padding_side
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        texts = [text] if isinstance(text, str) else list(text)
        rows = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
        bos = tok.bos_token_id
        if prepend_bos and bos is not None:
            rows = [r if r[:1] == [bos] else [bos] + r for r in rows]
        if prepend_bos is False and bos is not None:
            rows = [r[1:] if r[:1] == [bos] and len(r) > 1 else r for r in rows]
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            sl = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
            tokens[b, sl] = torch.tensor(r)
            mask[b, sl] = 1
        if not move_to_device:
            return tokens, mask
        device = self._device()
        return tokens.to(device), mask.to(device)

    @checked(text=TEXTS, prepend_bos=Flag(none=True), padding_side=OneOf("left", "right", none=True),
             move_to_device=Flag(), truncate=Flag())
    def to_tokens(self, text: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = "right",
                  move_to_device: bool = True, truncate: bool = True) -> Int[Tensor, "batch pos"]:
        """Token ids [batch pos]. A batch is padded on the RIGHT by default (as TransformerLens does):
        causal models then compute every real position exactly without a mask. Left padding needs the
        mask: use `tokenize` (tokens and mask) or pass text to the model. `truncate` cuts to n_ctx
        where the model has a position limit; `move_to_device=False` leaves the ids on the CPU."""
        tokens = self.tokenize(text, prepend_bos, padding_side or "right", move_to_device)[0]
        limit = getattr(self.cfg, "n_ctx", None)
        if truncate and limit is not None and getattr(self, "pos_embed", None) is not None:
            tokens = tokens[:, :limit]
        return tokens

    def to_str_tokens(self, text: str | list | Tensor, prepend_bos: bool | None = None,
                      padding_side: str = "right") -> list[str] | list[list[str]]:
        """One string per token. A str or 1-D tensor gives a list; a list of texts or a 2-D tensor
        gives one list per row (padding included, so that entries line up with positions)."""
        tok = self._need_tokenizer()
        if isinstance(text, list):
            return [self.to_str_tokens(t, prepend_bos, padding_side) for t in text]
        if isinstance(text, str):
            ids = self.to_tokens(text, prepend_bos)[0]
        elif torch.is_tensor(text):
            if text.is_floating_point() or text.is_complex() or text.dtype == torch.bool:
                raise WrongType(f"to_str_tokens: a tensor must hold token ids (integers), got {text.dtype}")
            ids = token_ids(text.reshape(1) if text.ndim == 0 else text, self.cfg.d_vocab, "to_str_tokens: tokens")
            if ids.ndim == 2:
                return [self.to_str_tokens(row) for row in ids] if ids.shape[0] > 1 else self.to_str_tokens(ids[0])
            if ids.ndim != 1:
                raise ValueError(f"to_str_tokens takes [pos] or [batch pos] tokens, got shape {tuple(ids.shape)}")
        else:
            raise TypeError(f"to_str_tokens takes a str, a list or a tensor, got {type(text).__name__}")
        return [tok.decode([i]) for i in ids.tolist()]

    @checked(string=Text())
    def to_single_token(self, string: str) -> int:
        """The id of `string` when it is exactly one token (no BOS); otherwise a ValueError."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {self.to_str_tokens(ids)}")
        return int(ids.item())

    def get_token_position(self, single_token: str | int, input: str | Tensor, mode: str = "first",
                           prepend_bos: bool | None = None, padding_side: str = "right") -> int:
        """Position of `single_token` in `input` (one sequence): its first or last occurrence."""
        check(mode, "get_token_position: mode", OneOf("first", "last"))
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos, padding_side)
        elif torch.is_tensor(input) and input.ndim in (1, 2):
            tokens = self.check_tokens(input)
        else:
            shape = f"shape {tuple(input.shape)}" if torch.is_tensor(input) else type(input).__name__
            raise WrongType(f"get_token_position: input must be a str or tokens [pos] / [1 pos], got {shape}")
        if tokens.shape[0] != 1:
            raise ValueError(f"get_token_position takes one sequence, got batch {tokens.shape[0]}")
        tokens = tokens[0]
        token = self.to_single_token(single_token) if isinstance(single_token, str) else \
            check(single_token, "get_token_position: single_token", Integer(ge=0, lt=self.cfg.d_vocab))
        where = (tokens == token).nonzero().flatten()
        if where.numel() == 0:
            raise ValueError(f"token {token} ({self._need_tokenizer().decode([token])!r}) is not in the input")
        return int(where[0] if mode == "first" else where[-1])

    def to_string(self, tokens: Tensor | int | list | Any) -> str | list[str]:
        """Text of tokens (TL's): an int, a 0-d or 1-D tensor, list or array gives a str; [batch pos] a list."""
        tok = self._need_tokenizer()
        if isinstance(tokens, (int, np.integer)) or (torch.is_tensor(tokens) and tokens.ndim == 0):
            tokens = torch.as_tensor([int(tokens)])  # one id (TL's to_string(256))
        if isinstance(tokens, np.ndarray):
            tokens = torch.from_numpy(tokens)
        if isinstance(tokens, (list, tuple)):
            tokens = token_ids(tokens, self.cfg.d_vocab, "to_string: tokens")
        if not torch.is_tensor(tokens) or tokens.ndim not in (1, 2) or tokens.is_floating_point():
            shown = f"shape {tuple(tokens.shape)} {tokens.dtype}" if torch.is_tensor(tokens) else type(tokens).__name__
            raise WrongType(f"to_string: tokens must be token ids [pos] or [batch pos], got {shown}")
        tokens = token_ids(tokens, self.cfg.d_vocab, "to_string: tokens")
        if tokens.ndim == 2:
            return [tok.decode(t.tolist(), clean_up_tokenization_spaces=False) for t in tokens]
        return tok.decode(tokens.tolist(), clean_up_tokenization_spaces=False)
