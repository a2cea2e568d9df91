"""TransformerLens keywords that have no meaning on a hooked model, refused by name with what to use.

TL's `forward` (and so `run_with_cache`, `run_with_hooks`, SAELens's calls into a model) accepts
keywords beyond hooked's. Those that mean something here are taken by the methods themselves
(`prepend_bos`, `padding_side`, `start_at_layer`, `stop_at_layer`, `tokens`, `attention_mask`,
`return_type`, `loss_per_token`; `to_tokens(move_to_device=, truncate=)`; `run_with_cache(
names_filter=, return_cache_object=, ...)`). The rest are listed here: a value that changes nothing
(None) is accepted, anything else is refused with the reason, never silently dropped.
"""

from __future__ import annotations

from typing import Any

REFUSED = {
    "past_kv_cache": "TransformerLens's key-value cache object has no counterpart; hooked's incremental state is "
                     "`state=hooked.models.decode_state.DecodeState` (model.generate uses it)",
    "shortformer_pos_embed": "no hooked family adds positions at every layer (shortformer)",
}


def refuse_tl_keywords(kwargs: dict[str, Any]) -> None:
    """Raise for a keyword the forward does not take: TL's inapplicable ones by name (unless None)."""
    for name, value in kwargs.items():
        if name in REFUSED:
            if value is None:
                continue
            raise ValueError(f"{name}= is not supported: {REFUSED[name]}")
        raise TypeError(f"forward() got an unexpected keyword argument {name!r}")
