"""`model.cfg` with TransformerLens's extra fields, derived from the model (never stored twice).

Glossary
    config        a family's frozen dataclass (GPT2Config, LlamaConfig, MambaConfig, ...)
    view          the same config as an instance of a subclass that adds, as properties:
                  device, dtype                the parameters' (they follow model.to(...))
                  normalization_type           "LN" or "RMS" from the norm modules ("LNPre"/"RMSPre"
                                               when every norm has weight 1 and no bias, i.e.
                                               after fold_ln, as TL names them)
                  positional_embedding_type    "standard" (learned), "rotary", or "none" (SSMs)
                  default_prepend_bos          the model's switch when set, else whether the tokenizer
                                               adds BOS (False without one)
                  n_key_value_heads            TL's name of n_kv_heads (None without GQA, as TL)
                  d_vocab_out, original_architecture, model_name
                  checkpoint_index, checkpoint_value, checkpoint_label_type   None (final weights only)
                  A field of the family's config with one of these names wins.
isinstance(model.cfg, GPT2Config) still holds and `dataclasses.replace(model.cfg, ...)` still works.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hooked.models.norms import LayerNorm, RMSNorm

_VIEWS: dict[type, type] = {}


def _model(cfg: Any) -> Any:
    model = cfg.__dict__.get("_model_ref", lambda: None)()
    if model is None:
        raise AttributeError("this config is not attached to a model (TL's derived fields need one)")
    return model


def _norms(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m) in (LayerNorm, RMSNorm)]  # Gemma's (1 + w) norms are not TL's


def _normalization_type(cfg: Any) -> str:
    norms = _norms(_model(cfg))
    kind = "LN" if norms and all(isinstance(m, LayerNorm) for m in norms) else "RMS"
    return kind + ("Pre" if norms and all(_unit(m) for m in norms) else "")


def _unit(norm: Any) -> bool:
    """Weight 1 and no (or a zero) bias: what fold_ln leaves."""
    bias = getattr(norm, "bias", None)
    return bool((norm.weight == 1).all()) and (bias is None or bool((bias == 0).all()))


def _positional(cfg: Any) -> str:
    model = _model(cfg)
    if getattr(model, "pos_embed", None) is not None:
        return "standard"
    return "rotary" if any(getattr(m, "rotary", None) is not None for m in model.modules()) else "none"


def _prepend_bos(cfg: Any) -> bool:
    switch = getattr(_model(cfg), "default_prepend_bos", None)  # the model's switch (base.py), when set
    if switch is not None:
        return bool(switch)
    tok = _model(cfg).tokenizer
    if tok is None or tok.bos_token_id is None:
        return False
    return tok("a", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]


def _kv_heads(cfg: Any) -> int | None:
    n_kv, n = getattr(cfg, "n_kv_heads", None), getattr(cfg, "n_heads", None)
    return n_kv if n_kv is not None and n_kv != n else None


EXTRA = {
    "device": lambda c: next(_model(c).parameters(), torch.empty(0)).device,
    "dtype": lambda c: next(_model(c).parameters(), torch.empty(0)).dtype,
    "normalization_type": _normalization_type,
    "positional_embedding_type": _positional,
    "default_prepend_bos": _prepend_bos,
    "n_key_value_heads": _kv_heads,
    "d_vocab_out": lambda c: c.d_vocab,
    "original_architecture": lambda c: getattr(_model(c), "family", type(_model(c)).__name__),
    "model_name": lambda c: getattr(_model(c), "family", type(_model(c)).__name__),
    # TL's training-checkpoint fields: hooked loads final weights only
    "checkpoint_index": lambda c: None,
    "checkpoint_value": lambda c: None,
    "checkpoint_label_type": lambda c: None,
}


def attach(cfg: Any, model: Any) -> Any:
    """The view of `cfg` for `model` (cfg unchanged; the view holds a weak reference to the model)."""
    base = type(cfg)
    if base not in _VIEWS:
        fields = set(getattr(base, "__dataclass_fields__", {})) | set(dir(base))
        props = {name: property(fn) for name, fn in EXTRA.items() if name not in fields}
        _VIEWS[base] = type(base.__name__, (base,), props | {"__doc__": base.__doc__, "__module__": base.__module__})
    view = object.__new__(_VIEWS[base])
    view.__dict__.update(cfg.__dict__)
    view.__dict__["_model_ref"] = weakref.ref(model)
    return view
