"""Head ablation, layer skipping and block replacement, all through hooks (weights never change).

Glossary
    head module  a module whose output is a sum of per-head writes: an attention module
                 ("blocks.3.attn", Zamba2's "blocks.5.shared.attn") or an SSM mixer
                 ("blocks.3.mixer"). `head_layout(model)` lists them with their head counts.
    head         (layer, h) on the layer's mixer or attention, or (module, h) for any head module:
                 ("blocks.3.attn", 2), ("blocks.5.shared.attn", 3). Attention: a query head.
                 Mamba-2: an SSM head (d_head channels). Mamba-1: one inner channel.
    write hook   where a head's write is cut: attention `hook_z` [batch pos n_heads d_head] (before
                 o_proj), SSM `hook_gated` [batch pos d_inner] (after the gate / gated norm, before
                 out_proj). Zeroing a head there == zeroing its columns of the output projection
                 (the projection's bias stays).
    mean ablation  the head's write replaced by its mean over batch and positions of `mean_cache`.
    keep-only    keep=True: in every listed head module, ablate every head that is not listed.
    skip         a skipped block passes its input through unchanged: resid_post := resid_pre.

G&A (Bick, Xing, Gu 2025) edits the weights in place; we use hooks, so the model is unchanged on
exit, also when the body raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from hooked.validate import Flag, Integer, OneOf, check, checked
from hooked.validate import as_index, index_list, layer_index, layer_list
from hooked.models.base import HookedModel
from hooked.models.model_map import Site, Unit, model_map, parse_label

HeadSpec = tuple[Any, int]  # (layer, h) or (module prefix, h)


def head_layout(model: Any) -> dict[str, Site]:
    """Every head module of the model (its token mixers' sites in the model map), in forward order: path ->
    Site (n_heads, width, hook: the write hook's name, cut_mask). Nothing runs."""
    return {s.path: s for s in model_map(model).mixers()}


def resolve_heads(model: Any, heads: Iterable[HeadSpec], layout: dict[str, Site] | None = None) -> dict[str, list[int]]:
    """{module prefix: sorted head indices}; (layer, h) means the layer's mixer or attention (its "H" or "C"
    units). `layout`: head_layout(model), when the caller has it already."""
    layout = head_layout(model) if layout is None else layout
    out: dict[str, set[int]] = {}
    for spec in heads:
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise ValueError(f"a head is (layer, h) or (module, h), got {spec!r}")
        where, h = spec
        if isinstance(where, str):
            prefix = where
        else:
            layer = layer_index(where, model.cfg.n_layers, f"the layer of head {spec!r}")
            own = [p for p, s in layout.items() if s.layer == layer and s.tag in ("H", "C")]  # L{layer}H{h}
            if not own:
                raise ValueError(f"layer {where} has no attention or mixer heads")
            prefix = own[0]
        if prefix not in layout:
            raise ValueError(f"the layer of head {spec!r}: {prefix!r} is not a head module; known: "
                             f"{', '.join(list(layout)[:6])}, ...")
        n = layout[prefix].n_heads
        out.setdefault(prefix, set()).add(as_index(h, n, f"head {spec!r}", f"heads of {prefix!r}"))
    return {p: sorted(hs) for p, hs in out.items()}


@contextlib.contextmanager
def attached(model: Any, hooks: Sequence[tuple[str, Callable, bool]]) -> Iterator[None]:
    """Attach (name, fn, prepend) hooks for this thread / task only (the model's scoped `hooks()`); all are
    removed on exit, whatever happens, and a bad name attaches nothing."""
    with model.hooks(fwd_hooks=[(name, fn) for name, fn, pre in hooks if not pre]), \
            model.hooks(fwd_hooks=[(name, fn) for name, fn, pre in hooks if pre], prepend=True):
        yield


def _write_mask(module: Site, heads: list[int], device: torch.device) -> Tensor:
    """Bool mask over the write hook's trailing axes (the site's cut_mask): attention [n_heads 1], SSM [d_inner]."""
    return module.cut_mask(heads, device)


def _mean_of(mean_cache: Any, name: str) -> Tensor:
    if mean_cache is None:
        raise ValueError("mode='mean' needs mean_cache (a cache or dict holding the write hooks)")
    try:
        act = mean_cache[name]
    except KeyError:
        raise KeyError(f"mean_cache has no {name!r}: run_with_cache with names_filter including it") from None
    return act.float().mean(dim=(0, 1)) if act.ndim >= 3 else act.float()


@contextlib.contextmanager
@checked(keep=Flag(), mode=OneOf("zero", "mean"))
def ablate_heads(model: Any, heads: Iterable[HeadSpec], keep: bool = False, mode: str = "zero",
                 mean_cache: Any = None) -> Iterator[Any]:
    """Ablate heads (zero or mean) at their write hook; keep=True ablates the unlisted heads instead.

    Zero ablation equals zeroing the heads' columns of o_proj (attention) or out_proj (Mamba-2
    heads after the gated norm; Mamba-1 channels). Mean ablation replaces each head's write with
    its mean over batch and positions in `mean_cache`.
    """
    layout = head_layout(model)
    picks = [(layout[p], hs) for p, hs in resolve_heads(model, heads, layout).items()]
    if keep:
        picks = [(site, [h for h in range(site.n) if h not in set(hs)]) for site, hs in picks]
    with attached(model, _site_hooks(picks, mode, mean_cache)):
        yield model


@contextlib.contextmanager
def ablate_units(model: Any, units: Iterable[Unit], mode: str = "zero", mean_cache: Any = None) -> Iterator[Any]:
    """`ablate_heads` for the model map's head units: each carries its site, so the map is not asked again."""
    with attached(model, _site_hooks(list(_by_site(units).values()), mode, mean_cache)):
        yield model


def _by_site(units: Iterable[Unit]) -> dict[str, tuple[Site, list[int]]]:
    """{site path: (site, sorted unit indices)} of units carrying their sites."""
    out: dict[str, tuple[Site, set[int]]] = {}
    for u in units:
        out.setdefault(u.module, (u.placed(), set()))[1].update(u.heads)
    return {p: (site, sorted(hs)) for p, (site, hs) in out.items()}


def _site_hooks(picks: Sequence[tuple[Site, list[int]]], mode: str, mean_cache: Any) -> list[tuple[str, Callable, bool]]:
    """(write hook, ablation, prepend) for each (site, its units to ablate) with units."""
    check(mode, "mode", OneOf("zero", "mean"))
    return [(site.hook, _ablation_hook(site, hs, _mean_of(mean_cache, site.hook) if mode == "mean" else None), False)
            for site, hs in picks if hs]


def _ablation_hook(module: Site, heads: list[int], mean: Tensor | None) -> Callable:
    def hook(act: Tensor, hook: Any) -> Tensor:
        mask = _write_mask(module, heads, act.device)
        fill = torch.zeros((), dtype=act.dtype, device=act.device) if mean is None else mean.to(act)
        return torch.where(mask, fill, act)

    return hook


@contextlib.contextmanager
def ablate_heads_rows(model: Any, groups: Sequence[Iterable[HeadSpec]], mode: str = "zero",
                      mean_cache: Any = None) -> Iterator[Any]:
    """Batched ablation: the batch is split into len(groups) equal blocks of rows, block j runs with
    the heads of groups[j] ablated (zero or mean, as `ablate_heads`), so r different ablations cost one
    forward of r tiled copies of the input (`ChoiceScorer.scores(replicas=r)` tiles that way).

    Each row's values equal `ablate_heads(model, groups[j])` on that row alone up to the rounding of
    a larger matmul (tests: within 1e-6). When it pays, see `analysis.ga.ranking.replicas_for`.
    """
    layout = head_layout(model)
    chosen = [resolve_heads(model, g, layout) for g in groups]
    with attached(model, _rows_hooks(layout, chosen, mode, mean_cache)):
        yield model


@contextlib.contextmanager
def ablate_units_rows(model: Any, groups: Sequence[Iterable[Unit]], mode: str = "zero",
                      mean_cache: Any = None) -> Iterator[Any]:
    """`ablate_heads_rows` for groups of the model map's head units (they carry their sites)."""
    picked = [_by_site(g) for g in groups]
    sites = {p: site for c in picked for p, (site, _) in c.items()}
    with attached(model, _rows_hooks(sites, [{p: hs for p, (_, hs) in c.items()} for c in picked], mode, mean_cache)):
        yield model


def _rows_hooks(sites: dict[str, Site], chosen: list[dict[str, list[int]]], mode: str,
                mean_cache: Any) -> list[tuple[str, Callable, bool]]:
    """One write hook per site that some group ablates: block j of rows gets group j's mask."""
    check(mode, "mode", OneOf("zero", "mean"))
    hooks = []
    for prefix in sorted({p for c in chosen for p in c}):
        site = sites[prefix]
        masks = torch.stack([_write_mask(site, c.get(prefix, []), torch.device("cpu")) for c in chosen])
        mean = _mean_of(mean_cache, site.hook) if mode == "mean" else None
        hooks.append((site.hook, _row_ablation_hook(masks, mean), False))
    return hooks


def _row_ablation_hook(masks: Tensor, mean: Tensor | None) -> Callable:
    """masks [groups, *trailing write axes]; rows of block j get masks[j]."""
    def hook(act: Tensor, hook: Any) -> Tensor:
        groups = masks.shape[0]
        if act.shape[0] % groups:
            raise ValueError(f"{hook.name}: {act.shape[0]} rows do not split into {groups} equal blocks")
        per_row = masks.to(act.device).repeat_interleave(act.shape[0] // groups, dim=0)  # [batch ...]
        per_row = per_row.reshape(act.shape[0], *([1] * (act.ndim - masks.ndim)), *masks.shape[1:])
        fill = torch.zeros((), dtype=act.dtype, device=act.device) if mean is None else mean.to(act)
        return torch.where(per_row, fill, act)

    return hook


# ---------------------------------------------------------------------------------- layers
@contextlib.contextmanager
def skip_layers(model: Any, layers: Iterable[int]) -> Iterator[Any]:
    """Run without the listed blocks: each one's resid_post is replaced by its resid_pre (exact).

    The block still runs (its hooks fire) but its output is its input. Hooks the user put on a
    skipped block's resid_post run after ours and see the passed-through residual.
    """
    chosen = layer_list(layers, model.cfg.n_layers)  # one layer, a list, range or generator of them
    hooks = []
    for layer in chosen:
        seen: dict[str, Tensor] = {}
        block = model.blocks[layer]
        hooks.append((block.hook_resid_pre.name, _remember(seen), False))
        hooks.append((block.hook_resid_post.name, _restore(seen), True))
    with attached(model, hooks):
        yield model


def _remember(seen: dict[str, Tensor]) -> Callable:
    def hook(resid: Tensor, hook: Any) -> None:
        seen["resid"] = resid

    return hook


def _restore(seen: dict[str, Tensor]) -> Callable:
    def hook(resid: Tensor, hook: Any) -> Tensor:
        return seen.pop("resid")

    return hook


def prune_from_end(model: Any, evaluate: Callable[[Any], Any], keep: Iterable[int] | None = None,
                   progress: bool = True) -> list[dict[str, Any]]:
    """Keep layers [0, k) for each k in `keep` (default 0..n_layers); rows {"kept_layers", "score"}."""
    n = model.cfg.n_layers
    counts = list(range(n + 1)) if keep is None else [check(k, "prune_from_end: keep", Integer(ge=0, le=n))
                                                      for k in _iterable(keep, "prune_from_end: keep")]
    rows = []
    for k in tqdm(counts, desc="prune", disable=not progress):
        with skip_layers(model, range(k, n)):
            rows.append({"kept_layers": k, "score": _plain(evaluate(model))})
    return rows


def remove_and_restore(model: Any, evaluate: Callable[[Any], Any], layers: Iterable[int] | None = None,
                       progress: bool = True) -> list[dict[str, Any]]:
    """Remove one layer at a time, evaluate, restore; first row is the full model (layer None)."""
    n = model.cfg.n_layers
    order = list(range(n)) if layers is None else index_list(layers, n, "remove_and_restore: layers", "layers of the model")
    rows = [{"removed_layer": None, "score": _plain(evaluate(model))}]
    for layer in tqdm(order, desc="remove", disable=not progress):
        with skip_layers(model, [layer]):
            rows.append({"removed_layer": int(layer), "score": _plain(evaluate(model))})
    return rows


def _iterable(value: Any, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what}: expected a list of layer counts, got {value!r}")
    return list(value)


def _plain(value: Any) -> Any:
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


@contextlib.contextmanager
def replace_block(model: Any, layer: int, donor: Any, donor_layer: int | None = None) -> Iterator[Any]:
    """Run `model` with block `layer` swapped for a block of `donor` (the G&A hybrid experiment).

    `donor` is a hooked model of the same width (its block `donor_layer`, default `layer`, is used)
    or a block module. The block list entry is swapped and restored on exit; no weight is touched.
    While swapped, the donor block's hooks fire under the donor's names and `model`'s hooks of that
    layer do not fire.
    """
    layer = layer_index(layer, model.cfg.n_layers)
    if isinstance(donor, HookedModel):
        if donor.cfg.d_model != model.cfg.d_model:
            raise ValueError(f"widths differ: model d_model={model.cfg.d_model}, donor d_model={donor.cfg.d_model}")
        donor_layer = layer_index(layer if donor_layer is None else donor_layer, donor.cfg.n_layers, "donor_layer")
        block = donor.blocks[donor_layer]
    else:
        block = donor
    _check_block(model, block, layer)
    original = model.blocks[layer]
    model.blocks[layer] = block
    try:
        yield model
    finally:
        model.blocks[layer] = original


def _check_block(model: Any, block: Any, layer: int) -> None:
    """A trial run of `block` on a zero residual [1 2 d_model]: a block of another width (or no block)
    fails here, naming the layer, instead of inside the caller's forward."""
    d_model = model.cfg.d_model
    if not callable(block):
        raise TypeError(f"replace_block: layer {layer}'s replacement must be a block module, got {type(block).__name__}")
    p = next(model.parameters())
    resid = torch.zeros(1, 2, d_model, dtype=p.dtype, device=p.device)
    ctx = model.make_context((1, 2), None, torch.zeros(1, 2, dtype=torch.long, device=p.device), p.device)
    ctx.embedding = resid
    try:
        with torch.no_grad():
            out = block(resid, ctx)
    except Exception as e:
        raise ValueError(f"replace_block: the block for layer {layer} does not run on this model's residual "
                         f"[batch pos d_model={d_model}] ({type(e).__name__}: {e})") from None
    if not torch.is_tensor(out) or out.shape != resid.shape:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"replace_block: the block for layer {layer} returns {got}, expected the residual "
                         f"shape {tuple(resid.shape)} (d_model={d_model})")


def parse_head(label: str) -> HeadSpec:
    """Parse "L3H5" -> (3, 5), "L5SH3" -> ("blocks.5.shared.attn", 3), "L0M3" -> ("blocks.0.mixer", 3)."""
    layer, tag, h, last = parse_label(label)  # the model map's grammar
    if tag not in ("SH", "H", "M") or last != h:
        raise ValueError(f"a head label looks like L3H5, L5SH3 or L0M3, got {label!r}")
    return {"SH": (f"blocks.{layer}.shared.attn", h), "M": (f"blocks.{layer}.mixer", h)}.get(tag, (layer, h))
