"""TransformerLens's `utils` names that a TL user's code imports: `get_act_name`, `lm_cross_entropy_loss`.

get_act_name(name, layer=None, layer_type=None) builds a hook name the way TL 3.9 does
("pattern", 3) -> "blocks.3.attn.hook_pattern", ("resid_pre", 0) -> "blocks.0.hook_resid_pre",
("scale", 2, "ln1") -> "blocks.2.ln1.hook_scale", ("scale") -> "ln_final.hook_scale", the short
form "pattern3" and TL's aliases ("attn" -> pattern, "attn_logits" -> attn_scores, "a" -> attn,
"m" -> mlp). It adds our SSM mixer hooks ("kernel", "h", "dt", ... -> "blocks.{l}.mixer.hook_*").
"""

from __future__ import annotations

import re

from hooked.models.base import lm_loss as _lm_loss

_ATTN = {"k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"}
_MLP = {"pre", "post", "mid", "pre_linear"}
_MIXER = {"in", "gate", "conv", "ssm_in", "dt", "B", "C", "A_bar", "B_bar", "h", "kernel", "y", "ssm_out",
          "gated", "head_out"}
_LAYER_TYPE_ALIAS = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_NAME_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """The full hook name for a short activation name (TransformerLens's `utils.get_act_name`)."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name  # already a full name
    match = re.match(r"([a-z_]+)(\d+)([a-z]?.*)", name)
    if match is not None:
        name, layer, layer_type = match.groups()
    name = _NAME_ALIAS.get(name, name)
    full = f"blocks.{layer}." if layer is not None else ""
    if name in _ATTN:
        layer_type = "attn"
    elif name in _MLP:
        layer_type = "mlp"
    elif name in _MIXER:
        layer_type = "mixer"
    elif layer_type in _LAYER_TYPE_ALIAS:
        layer_type = _LAYER_TYPE_ALIAS[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = f"ln_final.{full}"
    return full


def lm_cross_entropy_loss(logits, tokens, attention_mask=None, per_token: bool = False):
    """Mean next-token cross-entropy (TL's): over positions whose token and next token are real."""
    mask = None if attention_mask is None else attention_mask.bool()
    return _lm_loss(logits, tokens, mask, per_token)
