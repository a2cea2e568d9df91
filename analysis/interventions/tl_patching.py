"""TransformerLens's `patching.get_act_patch_*` names, each a thin call of `act_patch`.

Glossary (TL's shapes; every result is float32, as TL's)
    corrupted_tokens  the base run (TL's denoising convention): values come from `clean_cache`
    by_pos            one patch per (layer, position[, head])
    all_pos           one patch per (layer[, head]), every position at once
    metric            metric(logits) -> scalar

    get_act_patch_resid_pre / resid_mid / attn_out / mlp_out        [n_layers pos]
    get_act_patch_attn_head_{out,q,k,v}_by_pos                       [n_layers pos n_heads]
    get_act_patch_attn_head_pattern_by_pos                           [n_layers n_heads dest_pos]
    get_act_patch_attn_head_pattern_dest_src_pos                     [n_layers n_heads dest_pos src_pos]
    get_act_patch_attn_head_{out,q,k,v,pattern}_all_pos              [n_layers n_heads]
    get_act_patch_attn_head_all_pos_every                            [5 n_layers n_heads]
    get_act_patch_attn_head_by_pos_every                             [5 n_layers pos n_heads]
    get_act_patch_block_every                                        [3 n_layers pos]
"out" patches hook_z (TL's choice: a head's output is its z). k and v have n_kv_heads columns on GQA
models; the *_every stacks pad them with zeros to n_heads, as TL does. The dest/src grid is one
`patch` per pattern entry (act_patch sweeps one position axis), as TL's loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from analysis.interventions.patching import Metric, act_patch, patch

_TEMPLATES = {"resid_pre": "blocks.{layer}.hook_resid_pre", "resid_mid": "blocks.{layer}.hook_resid_mid",
              "attn_out": "blocks.{layer}.hook_attn_out", "mlp_out": "blocks.{layer}.hook_mlp_out",
              "out": "blocks.{layer}.attn.hook_z", "z": "blocks.{layer}.attn.hook_z",
              "q": "blocks.{layer}.attn.hook_q", "k": "blocks.{layer}.attn.hook_k",
              "v": "blocks.{layer}.attn.hook_v", "pattern": "blocks.{layer}.attn.hook_pattern"}


def _patch(model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric, what: str,
           over: tuple[str, ...]) -> Tensor:
    return act_patch(model, corrupted_tokens, clean_cache, metric, _TEMPLATES[what], over).float()


def get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    return _patch(model, corrupted_tokens, clean_cache, metric, "resid_pre", ("layer", "pos"))


def get_act_patch_resid_mid(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    return _patch(model, corrupted_tokens, clean_cache, metric, "resid_mid", ("layer", "pos"))


def get_act_patch_attn_out(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    return _patch(model, corrupted_tokens, clean_cache, metric, "attn_out", ("layer", "pos"))


def get_act_patch_mlp_out(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    return _patch(model, corrupted_tokens, clean_cache, metric, "mlp_out", ("layer", "pos"))


def _by_pos(what: str):
    def fn(model, corrupted_tokens, clean_cache, metric) -> Tensor:
        return _patch(model, corrupted_tokens, clean_cache, metric, what, ("layer", "pos", "head"))
    fn.__name__ = f"get_act_patch_attn_head_{what}_by_pos"
    fn.__doc__ = f"Patch hook_{'z' if what == 'out' else what} of each head at each position: [n_layers pos n_heads]."
    return fn


def _all_pos(what: str):
    def fn(model, corrupted_tokens, clean_cache, metric) -> Tensor:
        return _patch(model, corrupted_tokens, clean_cache, metric, what, ("layer", "head"))
    fn.__name__ = f"get_act_patch_attn_head_{what}_all_pos"
    fn.__doc__ = f"Patch hook_{'z' if what == 'out' else what} of each head at every position: [n_layers n_heads]."
    return fn


get_act_patch_attn_head_out_by_pos = _by_pos("out")
get_act_patch_attn_head_q_by_pos = _by_pos("q")
get_act_patch_attn_head_k_by_pos = _by_pos("k")
get_act_patch_attn_head_v_by_pos = _by_pos("v")
get_act_patch_attn_head_out_all_pos = _all_pos("out")
get_act_patch_attn_head_q_all_pos = _all_pos("q")
get_act_patch_attn_head_k_all_pos = _all_pos("k")
get_act_patch_attn_head_v_all_pos = _all_pos("v")
get_act_patch_attn_head_pattern_all_pos = _all_pos("pattern")


def get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    """Patch each head's pattern row of each destination position: [n_layers n_heads dest_pos]."""
    return _patch(model, corrupted_tokens, clean_cache, metric, "pattern", ("layer", "head", "pos"))


def get_act_patch_attn_head_pattern_dest_src_pos(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    """Patch each single pattern entry (head, dest, src): [n_layers n_heads dest_pos src_pos]."""
    pos = corrupted_tokens.shape[-1]
    out = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, pos, pos)
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            name = _TEMPLATES["pattern"].format(layer=layer)
            for head in range(model.cfg.n_heads):
                for dest in range(pos):
                    for src in range(pos):
                        logits = patch(model, corrupted_tokens, clean_cache, name, (head, dest, src))
                        out[layer, head, dest, src] = float(metric(logits))
    return out


def _pad_heads(t: Tensor, n_heads: int) -> Tensor:
    return F.pad(t, (0, n_heads - t.shape[-1]))


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    """[5 n_layers n_heads]: out (z), q, k, v, pattern, each head patched at every position."""
    args = (model, corrupted_tokens, clean_cache, metric)
    n = model.cfg.n_heads
    parts = [get_act_patch_attn_head_out_all_pos(*args), get_act_patch_attn_head_q_all_pos(*args),
             _pad_heads(get_act_patch_attn_head_k_all_pos(*args), n),
             _pad_heads(get_act_patch_attn_head_v_all_pos(*args), n), get_act_patch_attn_head_pattern_all_pos(*args)]
    return torch.stack(parts)


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    """[5 n_layers pos n_heads]: out (z), q, k, v, pattern, each head patched at each position."""
    args = (model, corrupted_tokens, clean_cache, metric)
    n = model.cfg.n_heads
    parts = [get_act_patch_attn_head_out_by_pos(*args), get_act_patch_attn_head_q_by_pos(*args),
             _pad_heads(get_act_patch_attn_head_k_by_pos(*args), n),
             _pad_heads(get_act_patch_attn_head_v_by_pos(*args), n),
             get_act_patch_attn_head_pattern_by_pos(*args).transpose(-1, -2)]
    return torch.stack(parts)


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric) -> Tensor:
    """[3 n_layers pos]: resid_pre, attn_out, mlp_out."""
    args = (model, corrupted_tokens, clean_cache, metric)
    return torch.stack([get_act_patch_resid_pre(*args), get_act_patch_attn_out(*args), get_act_patch_mlp_out(*args)])


__all__ = [n for n in dir() if n.startswith("get_act_patch_")]
