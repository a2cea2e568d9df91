"""Expert ablation for mixture-of-experts MLPs (hooked/models/moe.py): the expert analogue of ablate_heads.

Glossary
    expert spec    (layer, e) for the MoE at blocks.{layer}.mlp, or (module prefix, e), e.g. ("blocks.3.mlp", 5)
    moe_layout     {prefix: number of experts} of every MoE in the model, in forward order
    renormalise    after zeroing, scale each token's remaining weights so that they sum to what all its
                   weights summed to (a router that renormalises over its top k, as Granite 4's, would
                   have given the remaining experts these weights had it chosen only them); a token whose
                   every chosen expert is ablated keeps zero

Zeroing an expert's routing weight wherever it was chosen (renormalise=False) equals zeroing that
expert's down-projection: its output no longer reaches the residual, and nothing else changes.
The routing itself (which experts are chosen) is left as the router made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from analysis.interventions.ablation import attached
from hooked.models.model_map import Unit, model_map
from hooked.models.protocol import ExpertMixture
from hooked.validate import as_index, layer_index

ExpertSpec = tuple[Any, int]


def moe_layout(model: Any) -> dict[str, int]:
    """{"blocks.{l}.mlp": n_experts} for every mixture of experts (the model map's expert sites)."""
    return {s.path: s.n for s in model_map(model) if not s.mixes_tokens}


def resolve_experts(model: Any, experts: Iterable[ExpertSpec]) -> dict[str, list[int]]:
    """{MoE prefix: sorted expert ids}; (layer, e) means blocks.{layer}.mlp."""
    mp = model_map(model)  # asked once
    layout = {s.path: s.n for s in mp if not s.mixes_tokens}
    out: dict[str, set[int]] = {}
    for spec in experts:
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise ValueError(f"an expert is (layer, e) or (module, e), got {spec!r}")
        where, e = spec
        if isinstance(where, str):
            prefix = where
        else:
            layer = layer_index(where, model.cfg.n_layers, f"the layer of expert {spec!r}")
            prefix = next((s.path for s in mp.layer_sites(layer) if not s.mixes_tokens), f"block {layer}")
        if prefix not in layout:
            known = ", ".join(layout) or "none"
            raise ValueError(f"the layer of expert {spec!r}: {prefix!r} is not a mixture-of-experts MLP; the model's MoE "
                             f"layers: {known}")
        n = layout[prefix]
        out.setdefault(prefix, set()).add(as_index(e, n, f"expert {spec!r}", f"experts of {prefix!r}"))
    return {p: sorted(es) for p, es in out.items()}


def _hooks(moe: ExpertMixture, experts: list[int], renormalise: bool) -> list:
    seen: dict[str, Tensor] = {}

    def on_chosen(chosen: Tensor, hook: Any) -> None:
        seen["chosen"] = chosen

    def on_weights(weights: Tensor, hook: Any) -> Tensor:
        ids = torch.as_tensor(experts, device=weights.device)
        cut = torch.isin(seen.pop("chosen"), ids)
        kept = weights.masked_fill(cut, 0.0)
        if not renormalise:
            return kept
        total, left = weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
        return torch.where(left != 0, kept * (total / torch.where(left != 0, left, 1.0)), kept)

    return [(moe.hook_chosen.name, on_chosen, False), (moe.hook_routing_weights.name, on_weights, False)]


@contextlib.contextmanager
def ablate_experts(model: Any, experts: Iterable[ExpertSpec], renormalise: bool = False) -> Iterator[Any]:
    """Zero the listed experts' routing weights wherever they are chosen; hooks removed on exit.

    renormalise=False equals zeroing the experts' down_proj; renormalise=True rescales each token's
    remaining weights to the total it had (module docstring).
    """
    mp = model_map(model)
    hooks = [h for prefix, ids in resolve_experts(model, experts).items() for h in _hooks(mp.site(prefix).module, ids,
                                                                                          renormalise)]
    with attached(model, hooks):
        yield model


@contextlib.contextmanager
def ablate_expert_units(model: Any, units: Iterable[Unit], renormalise: bool = False) -> Iterator[Any]:
    """`ablate_experts` for the model map's expert units: each carries its site, so the map is not asked again."""
    picked: dict[str, tuple[ExpertMixture, set[int]]] = {}
    for u in units:
        picked.setdefault(u.module, (u.placed().module, set()))[1].update(u.heads)
    with attached(model, [h for moe, ids in picked.values() for h in _hooks(moe, sorted(ids), renormalise)]):
        yield model
