"""AtP*'s QK fix for the screen (Kramar et al. 2024): the softmax of downstream attention recomputed exactly.

Glossary
    site          an attention module with a pattern hook (`...attn.hook_pattern`) in a block after the
                  unit's block; sites in the unit's own block are left linear
    direct change dr_u: how the residual leaving the unit's block changes when the unit is ablated
                  (that block run alone, exactly, from the clean residual entering it; its later
                  sub-layers, e.g. the MLP, react too). Carried unchanged along the residual stream,
                  it is the unit's direct effect on every later block's input.
    pattern term  the part of the unit's effect that passes a site's softmax. Plain attribution
                  linearises it: <H, dr_u>, H = d <G, pattern> / d residual entering the site's block
                  along the pattern path only, G = d q / d pattern (q: the margin or answer log-prob).
                  The fix puts in its place <G, pattern(r + dr_u) - pattern(r)>, with the pattern
                  recomputed exactly (the site's block run up to its pattern hook and stopped there).
    refined       plain estimate + sum over sites of (exact pattern term - linear pattern term), per
                  example: exact in the direct change's effect on every later softmax, first order
                  in the pattern change's effect on q (AtP*'s approximation)
    cost          per unit, one run of its own block plus, per later site, the part of a block up to
                  the pattern (projections and scores); units of one layer run `replicas` per
                  forward, one per block of tiled rows. No attention downstream (Mamba, Mamba-2):
                  nothing to fix, the estimate is the plain one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.interventions.ablation import ablate_units_rows
from analysis.interventions.experts import ablate_expert_units
from hooked.models.model_map import Site, model_map


class _Stop(Exception):
    """Raised by the pattern hook: the rest of the block is not needed."""


def pattern_sites(model: Any) -> list[tuple[int, str]]:
    """(block, pattern hook name) of every attention module (a mixing through a softmax of scores), in
    forward order (the model map)."""
    return attention_patterns(model_map(model).mixers())


def attention_patterns(sites: Sequence[Site]) -> list[tuple[int, str]]:
    """`pattern_sites` among the model map's token-mixer `sites`."""
    mixings = [(s.layer, s.mixing()) for s in sites]
    return [(layer, m.matrix.name) for layer, m in mixings if m is not None and m.scores is not None]


def resid_hooks(model: Any) -> list[str]:
    return [b.hook_resid_pre.name for b in model.blocks]


def pattern_of(model: Any, resid: Tensor, layer: int, site: str, mask: Tensor | None, tokens: Tensor) -> Tensor:
    """The site's pattern when block `layer` reads `resid`; the block stops at the pattern hook."""
    got: dict[str, Tensor] = {}

    def hook(act: Tensor, hook: Any) -> None:
        got["pattern"] = act
        raise _Stop

    with contextlib.suppress(_Stop), model.hooks(fwd_hooks=[(site, hook)]):
        model(resid, mask, start_at_layer=layer, stop_at_layer=layer + 1, tokens=tokens)
    if "pattern" not in got:
        raise RuntimeError(f"{site} did not fire when block {layer} ran")
    return got["pattern"]


def pattern_weights(model: Any, resid: Tensor, layer: int, site: str, mask: Tensor | None, tokens: Tensor,
                    grads: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """(the site's pattern, [H = d <G, pattern> / d resid for each G in grads]): the linear pattern term of a
    residual change dr is <H, dr>, along the pattern path of block `layer` only."""
    x = resid.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        pattern = pattern_of(model, x, layer, site, mask, tokens)
        weights = [torch.autograd.grad((g.to(pattern) * pattern).sum(), x, retain_graph=True)[0].detach()
                   for g in grads]
    return pattern.detach(), weights


def _tile(x: Tensor | None, r: int) -> Tensor | None:
    return None if x is None else x.repeat(r, *([1] * (x.ndim - 1)))


def _ablated_rows(model: Any, chunk: Sequence[Any], mode: str, mean_cache: Any):
    """Block j of rows with chunk[j] ablated: heads batched, an expert alone (one per forward)."""
    if len(chunk) == 1 and chunk[0].kind != "head":  # zero only: write_attributions refused other modes
        return ablate_expert_units(model, chunk)
    return ablate_units_rows(model, [[u] for u in chunk], mode=mode, mean_cache=mean_cache)


def qk_corrections(model: Any, scorer: Any, units: Sequence[Any], att: dict[str, Any], owners: list[Tensor],
                   sites: list[tuple[int, str]], mode: str = "zero", mean_cache: Any = None,
                   replicas: int = 8) -> dict[str, dict[str, Tensor]]:
    """{unit label: {quantity: [example]}}: what the fix adds to the plain estimate of each quantity.

    att: `write_attributions(..., extra=[site hooks], keep=resid_hooks(model))` of the same scorer; sites:
    `pattern_sites(model)` (units: the model map's, carrying their sites).
    """
    n_ex = len(scorer.examples)
    keys = att["quantities"]
    out = {u.label: {k: torch.zeros(n_ex, dtype=torch.float64) for k in keys} for u in units}
    if not sites:
        return out
    layers = sorted({u.layer for u in units})
    for b, batch in enumerate(scorer.batches):
        mask, tokens = batch.attention_mask, batch.tokens
        resid = att["kept"]
        entering = {l: resid[name][b].detach() for l, name in enumerate(resid_hooks(model))}
        later = [(l2, site) for l2, site in sites if l2 > layers[0]]
        base, lin = {}, {}
        for l2, site in later:  # the clean pattern and the linear pattern term's weights H, once per site
            grads = [att["extra"][site][key][b] for key in keys]
            base[site], weights = pattern_weights(model, entering[l2], l2, site, mask, tokens, grads)
            lin.update({(site, key): w for key, w in zip(keys, weights)})
        keep = owners[b] >= 0
        for layer in layers:
            mine = [u for u in units if u.layer == layer]
            with torch.no_grad():
                clean_out = model(entering[layer], mask, start_at_layer=layer, stop_at_layer=layer + 1, tokens=tokens)
            heads = [u for u in mine if u.kind == "head"]
            chunks = [heads[i:i + replicas] for i in range(0, len(heads), replicas)] + [[u] for u in mine
                                                                                      if u.kind != "head"]
            for chunk in chunks:
                r = len(chunk)
                with torch.no_grad(), _ablated_rows(model, chunk, mode, mean_cache):
                    out_r = model(_tile(entering[layer], r), _tile(mask, r), start_at_layer=layer,
                                  stop_at_layer=layer + 1, tokens=_tile(tokens, r))
                dr = out_r - _tile(clean_out, r)  # [r*rows pos d_model]
                for l2, site in later:
                    if l2 <= layer:
                        continue
                    with torch.no_grad():
                        moved = pattern_of(model, _tile(entering[l2], r) + dr, l2, site, _tile(mask, r),
                                           _tile(tokens, r))
                    delta = (moved - _tile(base[site], r)).double()
                    for key in keys:
                        g = _tile(att["extra"][site][key][b], r).double()
                        exact = (g * delta).flatten(1).sum(-1)  # [r*rows]
                        linear = (_tile(lin[(site, key)], r).double() * dr.double()).flatten(1).sum(-1)
                        per_row = (exact - linear).view(r, -1).cpu()
                        for j, u in enumerate(chunk):
                            out[u.label][key].index_add_(0, owners[b][keep], per_row[j][keep])
    return out
