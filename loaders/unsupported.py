"""HF config values a family's model does not implement, refused by name before anything is built.

`UNSUPPORTED[arch name]` lists (field, allowed, why): a config dict whose `field` is present with a value
`allowed(value)` rejects raises ConfigError naming the field, its value and why. Fields HF's modeling
code reads are each either read by the family's config mapping or listed here or ignored for a stated
reason: tests/test_config_fields.py walks every family's HF modeling source and holds that table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loaders.checks import ConfigError

Rule = tuple[str, Callable[[Any, dict[str, Any]], bool], str]

SILU = ("silu", "swish")


def _silu(value: Any, hf: dict[str, Any]) -> bool:
    return value in SILU


def _falsy(value: Any, hf: dict[str, Any]) -> bool:
    return not value


def _groups_fit(value: Any, hf: dict[str, Any]) -> bool:  # topk_group: groups kept, of n_group
    return value is None or value <= (hf.get("n_group") or 1)


_MIXER_ACT = ("hidden_act", _silu, "HF applies hidden_act in the Mamba mixer too (after its conv, and to the "
                                   "gate), where this model applies SiLU; only 'silu' is implemented")
_GROUPS = ("topk_group", _groups_fit, "the router keeps topk_group of n_group expert groups, so it cannot exceed "
                                      "n_group")

UNSUPPORTED: dict[str, tuple[Rule, ...]] = {
    "gpt2": (("add_cross_attention", _falsy, "cross-attention layers (an encoder-decoder GPT-2) are not "
                                             "implemented; a causal LM never reads them"),),
    "bamba": (_MIXER_ACT,),
    "granitemoehybrid": (_MIXER_ACT,),
    "falcon_h1": (_MIXER_ACT,),
    "jamba": (_MIXER_ACT,),
    "nemotron_h": (_GROUPS,),
    "kimi_linear": (_GROUPS,),
    "zamba2": (("attention_hidden_size", lambda v, hf: v is None or v == 2 * hf.get("hidden_size", v / 2),
                "the shared block attends over [hidden, embedding], 2 * hidden_size features, as HF's config "
                "sets it by default; another width is not implemented"),),
}


def check_supported(arch: str, hf: dict[str, Any], origin: str) -> None:
    """Raise ConfigError for the first field of `hf` whose value family `arch` does not implement."""
    for field, allowed, why in UNSUPPORTED.get(arch, ()):
        if field in hf and not allowed(hf[field], hf):
            raise ConfigError(f"{origin}: {arch} config {field}={hf[field]!r} is not supported: {why}")
