"""Activation patching: one generic loop plus small setters (the TransformerLens `patching.py` shape).

Glossary
    base run      the run of `tokens` that is patched. Denoising: tokens = corrupted input, values
                  from the clean cache (how much does this activation restore?). Noising: tokens =
                  clean input, values from the corrupted cache (how much does it break?). `patch`
                  and `act_patch` do both: pass the right (tokens, cache) pair, or use
                  `run_patching(..., direction=...)`.
    source cache  where patched values come from (`clean_cache` in the signatures); it must hold
                  the patched hooks (lazy ones such as hook_h or hook_result too: name them in
                  run_with_cache's names_filter) with the base run's batch and length.
    over          the axes swept by `act_patch`: "layer" (the `{layer}` of the template), "pos",
                  "head" (alias "channel": n_heads, or d_inner for Mamba-1 states and channels).
                  Axis positions in the activation: hook_pattern / hook_attn_scores / hook_kernel
                  are [batch head q_pos k_pos] (pos = the query); every other hook is
                  [batch pos head ...].
    index         what `patch` replaces: None (everything), a dict {"pos": 3, "head": 1}, or a
                  tuple of indices applied after the batch axis.
    metric        `metric(logits) -> scalar`; helpers below: logit difference, answer
                  probability, and the normalised patching score (clean -> 1, corrupted -> 0).
    prefix reuse  patching a hook inside block l cannot change the residual entering block l, so
                  the base run's residual before each layer is computed once (`stop_at_layer`)
                  and every patched run starts there (`start_at_layer`).
    attribution patching   the first-order estimate metric(base) + (source - base) . d metric /
                  d activation, from one forward and one backward on the base run (Nanda 2023).
    screened patching      `screened_patch`: the estimate everywhere, exact patches for the indices
                  with the largest estimated effect and a random control set that measures what the
                  estimate missed.
    replicas      r different patches in one forward: the base run is tiled r times along the
                  batch axis, block j of rows gets patch j, and the metric is taken per block
                  (`analysis.interventions.batching.tiles_for` is the rule; replicas=1 runs one patch
                  per forward). Equal to one patch per forward within 1e-6 (tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from analysis.interventions.batching import tiles_for
from hooked.state_edit import set_everywhere
from hooked.validate import Integer, NotAnIndex, axis_index, check, layer_list, metric_value

Metric = Callable[[Tensor], Any]
Setter = Callable[[Tensor, Tensor, tuple], Tensor]
AXES = ("layer", "pos", "head", "channel")
STREAM_AXES = ("d_model", "d_vocab")  # an axis of the residual stream or logits is no head


# ---------------------------------------------------------------------------------- setters
def set_slice(act: Tensor, source: Tensor, index: tuple) -> Tensor:
    """The activation with `[:, *index]` taken from the source (the default setter)."""
    out = act.clone()
    full = (slice(None),) + index
    out[full] = source[full].to(out)
    return out


def axis_dim(point: Any, axis: str) -> int:
    """Where `axis` ("pos", "head"/"channel") lives in the activation of HookPoint `point`, from its
    declared axes: "pos" is the (query) position axis; "head" and "channel" name the first width axis
    after batch and positions (heads, SSM channels, experts), never the residual stream's d_model."""
    if axis == "pos":
        return point.axis("pos")
    if axis not in ("head", "channel"):
        raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")
    widths = [i for i, a in enumerate(point.axes) if a != "batch" and a not in ("pos", "q_pos", "k_pos")]
    if not widths or point.axes[widths[0]] in STREAM_AXES:
        raise ValueError(f"{point.name} has no {axis!r} axis: its activation is [{' '.join(point.axes)}]")
    return widths[0]


def index_tuple(point: Any, index: dict[str, Any] | tuple | int | None,
                shape: Sequence[int] | None = None) -> tuple:
    """Normalise `index` to a tuple applied after the batch axis.

    With the activation's `shape`, every axis named in a dict must exist on that hook (a "head" of a
    [batch pos d_model] stream is refused, not taken as a d_model component) and every integer is
    checked against its axis (negative counts from the end; floats, bools and strings are refused).
    """
    if index is None:
        return ()
    if isinstance(index, dict):
        if not index:
            return ()
        dims = {}
        for a, i in index.items():
            d = axis_dim(point, a)
            if d in dims:
                raise ValueError(f"index {index!r}: two names for one axis of {point.name} ('head' and 'channel' "
                                 f"are aliases)")
            if not (isinstance(i, slice) or _scalar(i)):
                raise NotAnIndex(f"index {index!r}: the value for {a!r} must be one integer or a slice, got {i!r} "
                                 f"(lists would pair up with other axes' lists, not cross them)")
            dims[d] = i
        out = tuple(dims.get(d, slice(None)) for d in range(1, max(dims) + 1))
    else:
        out = index if isinstance(index, tuple) else (index,)
    if shape is not None:
        if len(out) > len(shape) - 1:
            raise IndexError(f"index {index!r} has {len(out)} entries; {point.name} has {len(shape) - 1} axes after batch")
        out = tuple(axis_index(i, shape[d + 1], f"index {index!r} on {point.name}, axis {d + 1}")
                    for d, i in enumerate(out))
    return out


def _scalar(i: Any) -> bool:
    return not isinstance(i, (list, tuple, range, str, bytes)) and not getattr(i, "ndim", 0)


# ------------------------------------------------------------------------------ patched runs
def _point(model: Any, name: str) -> Any:
    """The HookPoint named `name` (a KeyError with close matches when there is none)."""
    return model._resolve(name)[0]



def _source(clean_cache: Any, name: str) -> Tensor:
    try:
        return clean_cache[name]
    except KeyError:
        raise KeyError(f"the source cache has no {name!r}; include it in run_with_cache's names_filter") from None


def _patch_hook(source: Tensor, index: tuple, setter: Setter) -> Callable:
    def hook(act: Tensor, hook: Any) -> Tensor:
        if source.shape != act.shape:
            raise ValueError(f"{hook.name}: the source has shape {tuple(source.shape)}, the run {tuple(act.shape)}")
        return setter(act, source, index)

    return hook


def _rows_patch_hook(source: Tensor, indices: Sequence[tuple], setter: Setter) -> Callable:
    """Block j of the (tiled) batch gets `setter(block, source, indices[j])`."""
    def hook(act: Tensor, hook: Any) -> Tensor:
        n = source.shape[0]
        if act.shape[0] != n * len(indices) or act.shape[1:] != source.shape[1:]:
            raise ValueError(f"{hook.name}: the source has shape {tuple(source.shape)}, the run {tuple(act.shape)} "
                             f"({len(indices)} patches tiled)")
        return torch.cat([setter(act[j * n:(j + 1) * n], source, idx) for j, idx in enumerate(indices)])

    return hook


def _tile(x: Tensor | None, r: int) -> Tensor | None:
    return None if x is None or r == 1 else x.repeat(r, *([1] * (x.ndim - 1)))


def _patched_values(model: Any, inp: Tensor, start: int | None, tokens: Tensor, attention_mask: Tensor | None,
                    name: str, source: Tensor, indices: Sequence[tuple], setter: Setter,
                    metric: Metric) -> list[float]:
    """metric of the base run with each patch in `indices`, all in one forward (r = len(indices) replicas)."""
    r = len(indices)
    if r == 1:
        return [metric_value(metric(_run(model, inp, start, tokens, attention_mask,
                                         [(name, _patch_hook(source, indices[0], setter))])))]
    hook = _rows_patch_hook(source, indices, setter)
    logits = _run(model, _tile(inp, r), start, _tile(tokens, r), _tile(attention_mask, r), [(name, hook)])
    n = tokens.shape[0]
    return [metric_value(metric(logits[j * n:(j + 1) * n])) for j in range(r)]


def patch_replicas(model: Any, tokens: Tensor, replicas: int | None, source: Tensor | None = None) -> int:
    """Patches per forward: `replicas`, or the batching rule (`tiles_for`) for this base run and patched
    activation (`source`: its size per row counts when it exceeds the stream's) when None."""
    if replicas is None:
        per_row = 0 if source is None else source[0].numel()
        return tiles_for(model, tokens.shape[0], tokens.shape[1] if tokens.ndim > 1 else 1, per_row=per_row)
    return check(replicas, "replicas", Integer(ge=1))  # patches per forward (None: the rule, above)


def _run(model: Any, inp: Tensor, start: int | None, tokens: Tensor, attention_mask: Tensor | None,
         hooks: list[tuple[str, Callable]]) -> Tensor:
    with model.hooks(fwd_hooks=hooks):
        if start is None:
            return model(inp, attention_mask)
        return model(inp, attention_mask, start_at_layer=start, tokens=tokens)


def patch(model: Any, tokens: Tensor, clean_cache: Any, hook_name: str, index: Any = None, *,
          attention_mask: Tensor | None = None, setter: Setter = set_slice) -> Tensor:
    """Logits of `tokens` with the activation `hook_name` (or its slice `index`) from `clean_cache`."""
    source = _source(clean_cache, hook_name)
    hook = _patch_hook(source, index_tuple(_point(model, hook_name), index, source.shape), setter)
    return _run(model, tokens, None, tokens, attention_mask, [(hook_name, hook)])


def layer_inputs(model: Any, tokens: Tensor, attention_mask: Tensor | None, layers: Sequence[int],
                 start_at_layer: int | None = None, resid: Tensor | None = None) -> Iterator[tuple[int, Tensor]]:
    """(l, residual entering block l) of the base run for each l in `layers` (ascending), computed once;
    `layers` may include n_layers (the final residual, before ln_final). With start_at_layer + resid (the
    residual entering that block): the run resumes there, under the hooks attached now, and yields later
    layers only.

    Runs without gradients (a model may take another, equally exact path when autograd records).
    """
    if (start_at_layer is None) != (resid is None):
        raise ValueError("layer_inputs: pass start_at_layer and resid together")
    if start_at_layer is None:
        with torch.no_grad():
            resid = model(tokens, attention_mask, stop_at_layer=0)
        at = 0
    elif any(layer <= start_at_layer for layer in layers):
        raise ValueError(f"a run from layer {start_at_layer} yields later layers only, got {sorted(set(layers))}")
    else:
        at = start_at_layer
    for layer in sorted(layers):
        if layer > at:
            with torch.no_grad():
                resid = model(resid, attention_mask, start_at_layer=at, stop_at_layer=layer, tokens=tokens)
            at = layer
        yield layer, resid


def _hook_layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" and len(parts) > 2 else None


def act_patch(model: Any, tokens: Tensor, clean_cache: Any, metric: Metric, hook_name_template: str,
              over: Sequence[str] = ("layer", "pos"), *, attention_mask: Tensor | None = None,
              setter: Setter = set_slice, reuse_prefix: bool = True, progress: bool = False,
              layers: Sequence[int] | None = None, replicas: int | None = None) -> Tensor:
    """Patch every index of `over` in turn and record `metric`; a tensor indexed by `over`.

    `hook_name_template` holds `{layer}` when "layer" is in `over` ("blocks.{layer}.attn.hook_z").
    The layer axis spans all n_layers; layers without that hook, or left out of `layers` (a subset
    to sweep), hold NaN (Zamba2's shared blocks exist in some layers only). replicas: patches of one
    layer per forward, one per block of tiled batch rows (None: the rule `tiles_for`; 1: one per
    forward). `metric` is called on each block's logits, which have the base run's batch size.
    """
    over = _check_over(over, hook_name_template)
    if "layer" in over:
        wanted = range(model.cfg.n_layers) if layers is None else layer_list(layers, model.cfg.n_layers)
        layers = [l for l in wanted if hook_name_template.format(layer=l) in model.hook_dict]
        if not layers:
            model.names_matching(hook_name_template.format(layer=wanted[0]))  # raises with close matches
    else:
        layers = [None]
    names = {l: hook_name_template.format(layer=l) if l is not None else hook_name_template for l in layers}
    first = _source(clean_cache, names[layers[0]])
    r = patch_replicas(model, tokens, replicas, first)
    inner = [a for a in over if a != "layer"]
    ranges = [range(first.shape[axis_dim(_point(model, names[layers[0]]), a)]) for a in inner]
    shape = [model.cfg.n_layers if a == "layer" else len(ranges[inner.index(a)]) for a in over]
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    bar = tqdm(total=len(layers) * _count(ranges), desc="act_patch", disable=not progress)
    with torch.no_grad():
        for layer, base in _bases(model, tokens, attention_mask, layers, names, reuse_prefix):
            name = names[layer]
            source = _source(clean_cache, name)
            start = None if base is tokens else layer
            combos = list(itertools.product(*ranges))
            for s in range(0, len(combos), r):
                chunk = combos[s:s + r]
                indices = [index_tuple(_point(model, name), dict(zip(inner, combo))) for combo in chunk]
                values = _patched_values(model, base, start, tokens, attention_mask, name, source, indices, setter,
                                         metric)
                for combo, value in zip(chunk, values):
                    out[tuple(layer if a == "layer" else combo[inner.index(a)] for a in over)] = value
                bar.update(len(chunk))
    bar.close()
    return out


def _check_over(over: Sequence[str], template: str) -> tuple[str, ...]:
    """`over` as a tuple of distinct known axes; "layer" in it exactly when the template has {layer}."""
    if isinstance(over, str):
        over = (over,)
    over = tuple(over)
    bad = [a for a in over if a not in AXES]
    if bad or len(set(over)) != len(over):
        raise ValueError(f"over must name distinct axes among {AXES}, got {over}")
    if not isinstance(template, str):
        raise TypeError(f"hook_name_template must be a str, got {type(template).__name__}")
    has_layer = "{layer}" in template
    if "layer" in over and not has_layer:
        raise ValueError(f"over has 'layer' but the template {template!r} has no {{layer}} to fill in")
    if has_layer and "layer" not in over:
        raise ValueError(f"the template {template!r} has {{layer}} but over={over} does not sweep 'layer'")
    return over


def _count(ranges: list[range]) -> int:
    n = 1
    for r in ranges:
        n *= len(r)
    return n


def _bases(model: Any, tokens: Tensor, attention_mask: Tensor | None, layers: list, names: dict,
           reuse_prefix: bool) -> Iterator[tuple[Any, Tensor]]:
    """(layer, what the patched runs start from): the residual entering the hook's block, or tokens.

    Lazy: only one layer's residual is held at a time.
    """
    reusable = [l for l in layers if l is not None and reuse_prefix and _hook_layer(names[l]) == l]
    inputs = layer_inputs(model, tokens, attention_mask, reusable)
    for layer in layers:
        yield (next(inputs) if layer in reusable else (layer, tokens))


# -------------------------------------------------------------------------------- helpers
def resid_patch(model, tokens, clean_cache, metric, which: str = "pre", over=("layer", "pos"), **kw) -> Tensor:
    """Residual stream before ("pre"), between ("mid") or after ("post") each block, by layer and position."""
    return act_patch(model, tokens, clean_cache, metric, f"blocks.{{layer}}.hook_resid_{which}", over, **kw)


def output_patch(model, tokens, clean_cache, metric, what: str = "attn", over=("layer", "pos"), **kw) -> Tensor:
    """A block's output by layer and position: what = "attn", "mlp" or "mixer" (hook_{what}_out)."""
    return act_patch(model, tokens, clean_cache, metric, f"blocks.{{layer}}.hook_{what}_out", over, **kw)


def head_patch(model, tokens, clean_cache, metric, by_pos: bool = False, hook: str = "z", module: str = "attn",
               **kw) -> Tensor:
    """Attention heads' outputs (hook_z, or hook_result), by (layer, head) or (layer, pos, head).

    module="shared.attn" patches Zamba2's shared-attention invocations.
    """
    over = ("layer", "pos", "head") if by_pos else ("layer", "head")
    return act_patch(model, tokens, clean_cache, metric, f"blocks.{{layer}}.{module}.hook_{hook}", over, **kw)


def ssm_state_patch(model, tokens, clean_cache, metric, over=("layer", "pos", "head"), **kw) -> Tensor:
    """SSM states hook_h by layer, position and head (Mamba-2) or channel (Mamba-1)."""
    return act_patch(model, tokens, clean_cache, metric, "blocks.{layer}.mixer.hook_h", over, **kw)


def run_patching(model: Any, clean_tokens: Tensor, corrupted_tokens: Tensor, metric: Metric, hook_name_template: str,
                 over: Sequence[str] = ("layer", "pos"), direction: str = "denoising", normalise: bool = True,
                 attention_mask: Tensor | None = None, **kw) -> Tensor:
    """Cache the source run, patch the base run, optionally normalise (clean -> 1, corrupted -> 0).

    direction="denoising": base = corrupted, values from clean. "noising": base = clean, values
    from corrupted. Both runs share `attention_mask` (same lengths and padding).
    """
    if direction not in ("denoising", "noising"):
        raise ValueError(f"direction must be 'denoising' or 'noising', got {direction!r}")
    base, src = (corrupted_tokens, clean_tokens) if direction == "denoising" else (clean_tokens, corrupted_tokens)
    keep = _template_filter(hook_name_template)
    with torch.no_grad():
        clean_logits = model(clean_tokens, attention_mask)
        corrupted_logits = model(corrupted_tokens, attention_mask)
        _, cache = model.run_with_cache(src, attention_mask, names_filter=keep)
        values = act_patch(model, base, cache, metric, hook_name_template, over, attention_mask=attention_mask, **kw)
    if not normalise:
        return values
    return normalised_score(values, metric_value(metric(clean_logits)), metric_value(metric(corrupted_logits)))


def _template_filter(template: str) -> Callable[[str], bool]:
    head, _, tail = template.partition("{layer}")
    return (lambda n: n.startswith(head) and n.endswith(tail)) if "{layer}" in template else (lambda n: n == template)


# --------------------------------------------------------------------------------- metrics
def _at(logits: Tensor, pos: int) -> Tensor:
    x = logits[:, pos]
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def logit_diff(answer: Any, wrong: Any, pos: int = -1) -> Metric:
    """Metric: mean over the batch of logit[answer] - logit[wrong] at `pos` (ids: int or [batch])."""
    def metric(logits: Tensor) -> Tensor:
        x = _at(logits, pos)
        a = torch.as_tensor(answer, device=x.device).expand(x.shape[0])
        w = torch.as_tensor(wrong, device=x.device).expand(x.shape[0])
        return (x.gather(1, a[:, None]) - x.gather(1, w[:, None])).mean()

    return metric


def answer_prob(answer: Any, pos: int = -1) -> Metric:
    """Metric: mean over the batch of the probability of `answer` at `pos`."""
    def metric(logits: Tensor) -> Tensor:
        p = _at(logits, pos).softmax(-1)
        a = torch.as_tensor(answer, device=p.device).expand(p.shape[0])
        return p.gather(1, a[:, None]).mean()

    return metric


def normalised_score(values: Tensor, clean_value: float, corrupted_value: float) -> Tensor:
    """(value - corrupted) / (clean - corrupted): 1 where a patch gives the clean metric, 0 the corrupted."""
    if clean_value == corrupted_value:
        raise ValueError("clean and corrupted metrics are equal: the normalised score is undefined")
    return (values - corrupted_value) / (clean_value - corrupted_value)


# -------------------------------------------------------------------- attribution patching
def attribution_patch(model: Any, tokens: Tensor, clean_cache: Any, metric: Metric, hook_name_template: str,
                      over: Sequence[str] = ("layer", "pos"), *, attention_mask: Tensor | None = None) -> Tensor:
    """First-order estimate of `act_patch` (same axes, same NaN layers) from one forward + backward.

    estimate[idx] = metric(base) + sum over the unswept axes of (source - base) * d metric / d act,
    the gradient taken on the base run. Each hooked activation is replaced by a copy of itself so
    that lazy quantities (hook_h, hook_kernel, hook_result) sit on the path to the logits. No
    parameter gradient is accumulated (torch.autograd.grad on the activations only).
    A recurrent state (hook_h) patched at one position is continued from there, so its gradient is the
    total derivative through the later states; when `over` has no "pos", every index spans every
    position and every state is set (hooked/state_edit.py), so the gradient is each state's own effect.
    """
    over = _check_over(over, hook_name_template)
    layers = [l for l in range(model.cfg.n_layers) if hook_name_template.format(layer=l) in model.hook_dict] \
        if "layer" in over else [None]
    if not layers:
        model.names_matching(hook_name_template.format(layer=0))  # raises with close matches
    names = {l: hook_name_template.format(layer=l) if l is not None else hook_name_template for l in layers}
    for name in names.values():  # the source cache must be of this very input: no broadcasting
        model.names_matching(name)
        _source(clean_cache, name)
    acts: dict[str, Tensor] = {}

    def grab(act: Tensor, hook: Any) -> Tensor:
        acts[hook.name] = _on_graph(act, hook.name)
        return acts[hook.name] if "pos" in over else set_everywhere(acts[hook.name])

    with torch.enable_grad():
        logits = _run(model, tokens, None, tokens, attention_mask, [(n, grab) for n in names.values()])
        value = metric(logits)
        base = metric_value(value.detach() if torch.is_tensor(value) else value)
        grads = torch.autograd.grad(value, [acts[n] for n in names.values()], allow_unused=True)
    inner = [a for a in over if a != "layer"]
    parts = {}
    for (layer, name), grad in zip(names.items(), grads):
        if grad is None:
            raise RuntimeError(f"the metric's gradient does not reach {name!r}: that activation is not on the "
                               "path to the logits")
        act = acts[name].detach()
        source = _source(clean_cache, name)
        if source.shape != act.shape:
            raise ValueError(f"{name}: the source cache has shape {tuple(source.shape)}, the base run "
                             f"{tuple(act.shape)} (same batch and length needed)")
        prod = (source.to(act) - act) * grad
        keep = [axis_dim(_point(model, name), a) for a in inner]
        rest = [d for d in range(prod.ndim) if d not in keep]
        parts[layer] = prod.permute(keep + rest).flatten(len(keep)).sum(-1).detach().double().cpu() + base
    if "layer" not in over:
        return parts[None]
    first = next(iter(parts.values()))
    out = torch.full((model.cfg.n_layers, *first.shape), float("nan"), dtype=torch.float64)
    for layer, est in parts.items():
        out[layer] = est
    return out.permute(*[0 if a == "layer" else 1 + inner.index(a) for a in over])


def _on_graph(act: Tensor, name: str) -> Tensor:
    """A copy of `act` that the model uses downstream, so d metric / d copy is the attribution gradient.

    A lazy quantity (DESIGN.md section 4) returned equal but carrying its own gradient path is an
    edit to the model (`hooked.hook_points.through_hook`), so it stays on the path to the logits.
    """
    return act.clone() if act.requires_grad else act.detach().clone().requires_grad_(True)


def screened_patch(model: Any, tokens: Tensor, clean_cache: Any, metric: Metric, hook_name_template: str,
                   over: Sequence[str] = ("layer", "pos"), *, attention_mask: Tensor | None = None,
                   verify_top: int = 20, n_control: int = 5, seed: int = 0,
                   baseline: float | None = None, replicas: int | None = None,
                   setter: Setter = set_slice) -> dict[str, Tensor]:
    """`act_patch` screened: `attribution_patch` for every index, then exact patches of the `verify_top`
    indices with the largest |estimate - baseline| and of `n_control` random others.

    Returns {"estimate": attribution tensor, "exact": act_patch values where verified (NaN elsewhere),
    "verified": bool tensor, "control": bool tensor}; the axes are those of `act_patch`. baseline:
    the unpatched metric (default: computed on `tokens`), from which the estimates' size is measured.
    The exact patches of one layer run `replicas` per forward (as `act_patch`), from the base run's
    residual entering that layer.
    """
    import random

    over = _check_over(over, hook_name_template)
    est = attribution_patch(model, tokens, clean_cache, metric, hook_name_template, over, attention_mask=attention_mask)
    if baseline is None:
        with torch.no_grad():
            baseline = float(metric(model(tokens, attention_mask)))
    size = (est - baseline).abs().nan_to_num(-1.0).reshape(-1)
    order = size.argsort(descending=True).tolist()
    valid = [i for i in order if size[i] >= 0]
    top = valid[:verify_top]
    rest = valid[verify_top:]
    control = random.Random(seed).sample(rest, min(n_control, len(rest)))
    exact = torch.full_like(est, float("nan"))
    verified = torch.zeros(est.shape, dtype=torch.bool)
    is_control = torch.zeros(est.shape, dtype=torch.bool)
    by_layer: dict[Any, list[tuple[int, tuple]]] = {}
    for flat in top + control:
        idx = {a: int(v) for a, v in zip(over, torch.unravel_index(torch.tensor(flat), est.shape))}
        layer = idx.pop("layer", None)
        by_layer.setdefault(layer, []).append((flat, tuple(idx[a] for a in over if a != "layer")))
    inner = [a for a in over if a != "layer"]
    layers = sorted(by_layer, key=lambda l: -1 if l is None else l)
    names = {l: hook_name_template.format(layer=l) if l is not None else hook_name_template for l in layers}
    r = patch_replicas(model, tokens, replicas, _source(clean_cache, names[layers[0]]) if layers else None)
    with torch.no_grad():
        for layer, base in _bases(model, tokens, attention_mask, layers, names, True):
            name, items = names[layer], by_layer[layer]
            source = _source(clean_cache, name)
            start = None if base is tokens else layer
            for s in range(0, len(items), r):
                chunk = items[s:s + r]
                indices = [index_tuple(_point(model, name), dict(zip(inner, combo))) for _, combo in chunk]
                values = _patched_values(model, base, start, tokens, attention_mask, name, source, indices, setter,
                                         metric)
                for (flat, _), value in zip(chunk, values):
                    exact.view(-1)[flat] = value
                    verified.view(-1)[flat] = True
                    is_control.view(-1)[flat] = flat in control
    return {"estimate": est, "exact": exact, "verified": verified, "control": is_control}


def compare_attribution(exact: Tensor, approx: Tensor, baseline: float = 0.0) -> dict[str, float]:
    """Agreement of attribution and exact patching: Pearson r, max |error|, top-5 overlap of |effect|.

    effect = value - baseline (pass the unpatched metric to rank by the size of each patch's effect).
    """
    ok = ~(exact.isnan() | approx.isnan())
    e, a = exact[ok].double() - baseline, approx[ok].double() - baseline
    r = torch.corrcoef(torch.stack([e, a]))[0, 1].item() if e.numel() > 1 else float("nan")
    k = min(5, e.numel())
    top = len(set(e.abs().topk(k).indices.tolist()) & set(a.abs().topk(k).indices.tolist())) / max(k, 1)
    return {"pearson": r, "max_abs_error": (e - a).abs().max().item(), "top5_overlap": top}
