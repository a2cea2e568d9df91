"""Knockout: cut the information flow from source tokens to target tokens inside chosen layers.

Glossary
    edge        (target j, source i): what target position j reads from source position i in one
                layer. Row = target (query), column = source (key), as in hook_pattern and hook_kernel.
    sources, targets  positions shared by the batch (ints, negative ok, indexing the padded tensor) or
                bool masks [batch pos] (one row per example, so facts with different spans batch).
    site        a place where an edge can be cut: an attention module (anything with hook_attn_scores
                and hook_pattern under blocks.{l}., Zamba2's blocks.{l}.shared.attn included) or an SSM
                mixer (blocks.{l}.mixer with hook_y).
    c           the SSM channel axis: d_inner for Mamba-1 (a channel is a "head"), n_heads for Mamba-2.
    K[j, i]     the SSM kernel (DESIGN.md section 4): y_j = sum_i K[j, i] u_i, per channel / head.
    h           the SSM state (never x). `batch` is the batch size (B is the SSM input matrix).

What a cut does, per site kind
    attention, "scores"   -inf is added to the cut entries of hook_attn_scores before the softmax, so
                          each row renormalises over the edges left (Geva et al. 2023). A row whose
                          every visible key is cut gets an all-zero pattern (the head writes nothing
                          there) instead of NaN or a softmax over masked future keys.
    attention, "pattern"  the cut entries of hook_pattern are zeroed after the softmax (no
                          renormalisation).
    SSM mixer             y_j -= sum_{i cut} K[j, i] u_i at hook_y, on the listed channels only, with
                          u, dt, B, C read from this very forward (hook_ssm_in, hook_dt, hook_B, hook_C)
                          and A = -exp(A_log); the kernel entries come from the pairwise functions of
                          hooked.ops (mamba1_kernel_pairs, mamba2_kernel_pairs), so no pos x pos tensor
                          is built. The D skip (D u_j) is never cut.
    cut_conv=True         also removes the sources' taps of the causal conv into the targets:
                          hook_conv[j] -= weight[:, w-1-(j-i)] * hook_in[i] for sources i with
                          0 <= j - i < w. Whatever is computed from the conv output at the target (u;
                          Mamba-1's dt, B, C) follows. Conv channels of a cut channel/head are cut; the
                          channels shared by every head (Mamba-2's B and C) only when channels is None.
Every mode is causal: only entries with source <= target exist to be cut; nothing is unmasked.

Knockout reads dt, B, C (not hook_A_bar, hook_B_bar or hook_kernel), so edits another hook makes to
those three lazy quantities are not seen by the kernel terms it removes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from hooked.backends import exact_hook
from hooked.devices import onloaded
from hooked.ops.selective_scan import mamba1_kernel_pairs
from analysis.validate import index_list, index_mask, layer_index, layer_list, position_mask
from hooked.ops.ssd import mamba2_kernel_pairs

Positions = Union[int, Sequence[int], range, Tensor]
Channels = Union[None, Sequence[int], Tensor, dict]
ATTENTION_MODES = ("scores", "pattern")
_PAIR_ELEMENTS = 2**22  # elements of the per-chunk [pair channel (d_head)] tensors
_ANY_LENGTH = 2**62  # positions are range-checked at the forward, where the length is known


# ---------------------------------------------------------------------------------- positions
def _edge_pairs(target: Tensor, source: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(batch row, target j, source i) of every causal cut edge (i <= j)."""
    batch, pos = target.shape
    if batch * pos * pos <= 2**22:  # small: one dense [batch pos pos] bool mask
        causal = torch.ones(pos, pos, dtype=torch.bool, device=target.device).tril()
        row, j, i = (target[:, :, None] & source[:, None, :] & causal).nonzero(as_tuple=True)
        return row, j, i
    rows, js, iss = [], [], []
    for b in range(batch):  # long sequences: row by row, |targets| x |sources| each
        j, i = target[b].nonzero()[:, 0], source[b].nonzero()[:, 0]
        jj, ii = torch.meshgrid(j, i, indexing="ij")
        keep = ii <= jj
        rows.append(torch.full((int(keep.sum()),), b, dtype=torch.long, device=target.device))
        js.append(jj[keep])
        iss.append(ii[keep])
    return torch.cat(rows), torch.cat(js), torch.cat(iss)


# ------------------------------------------------------------------------------------- sites
def knockout_sites(model: Any, layer: int, names: Iterable[str] | None = None) -> tuple[list[str], list[str]]:
    """(attention module names, SSM mixer names) of block `layer`, found through the hook names."""
    prefix = f"blocks.{layer}."
    names = [n for n in (model.hook_dict if names is None else names) if n.startswith(prefix)]
    attn = [n[: -len(".hook_pattern")] for n in names if n.endswith(".hook_pattern")]
    ssm = [n[: -len(".hook_y")] for n in names if n.endswith(".hook_y") and n[: -len("y")] + "ssm_in" in names]
    return attn, ssm


def _ssm_A(mixer: torch.nn.Module) -> Tensor:
    """A = -exp(A_log): [d_inner d_state] (Mamba-1) or [n_heads] (Mamba-2)."""
    if not hasattr(mixer, "A_log"):
        raise TypeError(f"{type(mixer).__name__} has no A_log parameter: not an SSM mixer knockout understands")
    return -torch.exp(mixer.A_log)


def _conv_weight(mixer: torch.nn.Module) -> Tensor:
    """The depthwise conv filter [channels width] (nn.Conv1d's [channels 1 width] squeezed)."""
    for name, p in mixer.named_parameters():
        if "conv" in name and name.endswith("weight"):
            return p.reshape(p.shape[0], p.shape[-1])
    raise TypeError(f"{type(mixer).__name__} has no conv weight; cut_conv needs one")


def _channel_mask(channels: Any, n: int, where: str) -> Tensor | None:
    """Bool mask [n] from indices or a bool mask; None means every channel."""
    if channels is None:
        return None
    return index_mask(channels, n, f"channels of {where}", "channels")


# ------------------------------------------------------------------------------ the cut math
def attention_cut(scores_or_pattern: Tensor, cut: Bool[Tensor, "batch q k"], mode: str) -> tuple[Tensor, Tensor]:
    """Apply a cut to hook_attn_scores ("scores") or hook_pattern ("pattern"); see the module doc.

    Returns the edited tensor and, for "scores", the rows left with no visible key ([batch heads q]).
    """
    cut = cut[:, None]  # [batch 1 q k], every head
    x = scores_or_pattern
    if mode == "pattern":
        return x.masked_fill(cut, 0.0), cut.new_zeros(())
    live = x > torch.finfo(x.dtype).min / 2  # visible before the cut (causal, not padding)
    dead = (live & cut).any(-1) & ~(live & ~cut).any(-1)
    return x.masked_fill(cut, float("-inf")), dead


def ssm_cut(u: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, target: Tensor, source: Tensor,
            channels: Tensor | None) -> Tensor:
    """sum_{i cut} K[j, i] u_i at every target j: the amount to subtract from y (same shape as u).

    Mamba-1 (u [batch pos d_inner]) uses mamba1_kernel_pairs, Mamba-2 (u [batch pos n_heads d_head])
    mamba2_kernel_pairs: the pairs are cut into chunks, so memory is O(chunk * channels).
    """
    pairs_fn = mamba1_kernel_pairs if u.ndim == 3 else mamba2_kernel_pairs
    row, j, i = _edge_pairs(target, source)
    out_dtype = u.dtype
    work = torch.promote_types(u.dtype, torch.float32)  # at least float32, as the scan computes
    u, dt, B, C, A = (x.to(work) for x in (u, dt, B, C, A))
    delta = torch.zeros_like(u)
    per_pair = math.prod(u.shape[2:]) * (A.shape[-1] if A.ndim == 2 else 1)
    chunk = max(1, _PAIR_ELEMENTS // per_pair)
    for s in range(0, len(row), chunk):
        r, jj, ii = row[s : s + chunk], j[s : s + chunk], i[s : s + chunk]
        entry = pairs_fn(dt, A, B, C, r, jj, ii)  # [pair c]
        term = entry.reshape(entry.shape + (1,) * (u.ndim - 3)) * u[r, ii]  # [pair c (d_head)]
        delta = delta.index_put((r, jj), term, accumulate=True)
    if channels is not None:
        delta = delta * channels.to(delta.device).reshape((-1,) + (1,) * (u.ndim - 3)).to(delta.dtype)
    return delta.to(out_dtype)


def conv_cut(conv_in: Tensor, weight: Tensor, target: Tensor, source: Tensor,
             conv_channels: Tensor | None) -> Tensor:
    """sum over sources i in the window of target j of weight[:, w-1-(j-i)] * conv_in[i]: to subtract."""
    width = weight.shape[1]
    delta = torch.zeros_like(conv_in)
    for lag in range(min(width, conv_in.shape[1])):
        shifted_src = torch.zeros_like(source)
        shifted_src[:, lag:] = source[:, : source.shape[1] - lag]  # source at j - lag, seen from j
        hit = (target & shifted_src)[..., None].to(conv_in.dtype)
        shifted_in = torch.zeros_like(conv_in)
        shifted_in[:, lag:] = conv_in[:, : conv_in.shape[1] - lag]
        delta = delta + hit * weight[:, width - 1 - lag].to(conv_in.dtype) * shifted_in
    if conv_channels is not None:
        delta = delta * conv_channels.to(delta.device, delta.dtype)
    return delta


def _conv_channels(channels: Tensor | None, n_conv: int, d_inner: int) -> Tensor | None:
    """Conv channels of the cut channels/heads; channels past d_inner (shared B, C) only if all are cut."""
    if channels is None:
        return None
    mask = torch.zeros(n_conv, dtype=torch.bool)
    mask[:d_inner] = channels.repeat_interleave(d_inner // channels.shape[0])
    return mask


# ------------------------------------------------------------------------------ the context
@contextlib.contextmanager
def knockout(model: Any, sources: Positions, targets: Positions, layers: int | Iterable[int],
             channels: Channels = None, attention: str = "scores", cut_conv: bool = False) -> Iterator[Any]:
    """Cut every (target, source) edge in every listed layer while the context is open.

    Args:
        model: a hooked model. sources, targets: positions shared by the batch (negative ok) or bool
            masks [batch pos]. layers: block indices (negative ok); every attention module and SSM
            mixer of those blocks is cut (Zamba2: the Mamba-2 mixer and the shared attention;
            Falcon-H1: both parallel branches). A block with neither (NemotronH's MLP and MoE
            layers) moves nothing between positions: there is nothing to cut in it.
        channels: SSM channels / heads to cut (indices or a bool mask over c), or a dict
            {layer: channels} for per-layer sets (feature knockout); None = all. Attention layers
            always cut every head.
        attention: "scores" (-inf before softmax, renormalises) or "pattern" (zero after softmax).
        cut_conv: also remove the sources' conv taps into the targets (SSM layers).
    Nothing is edited on the model: hooks are added on entry and removed on exit, also on error.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    n_layers = model.cfg.n_layers
    layers = layer_list(layers, n_layers, "layers")
    for spec, what in ((sources, "sources"), (targets, "targets")):  # types now; ranges at the forward
        if not (torch.is_tensor(spec) and spec.dtype == torch.bool):
            index_list(spec, _ANY_LENGTH, what, "positions")
    if isinstance(channels, dict):
        channels = {layer_index(k, n_layers, "channels key"): v for k, v in channels.items()}
    hooks: list[tuple[str, Any]] = []
    names = set(model.hook_dict)
    for layer in layers:
        attn_sites, ssm_sites = knockout_sites(model, layer, names)  # none: an MLP-only block (NemotronH)
        for site in attn_sites:
            hooks += _attention_hooks(names, site, sources, targets, attention)
        for site in ssm_sites:
            if isinstance(channels, dict) and layer not in channels:
                raise ValueError(f"channels has no entry for layer {layer} (its keys: {sorted(channels)})")
            chan = channels[layer] if isinstance(channels, dict) else channels
            hooks += _ssm_hooks(model, site, sources, targets, chan, cut_conv)
    with model.hooks(fwd_hooks=hooks):
        yield model


def _attention_hooks(names: set[str], site: str, sources: Positions, targets: Positions, mode: str) -> list:
    state: dict[str, Tensor] = {}

    def edges(x: Tensor) -> Tensor:
        batch, pos = x.shape[0], x.shape[-1]
        t = position_mask(targets, batch, pos, x.device, "targets")
        s = position_mask(sources, batch, pos, x.device, "sources")
        return t[:, :, None] & s[:, None, :]

    def on_scores(scores: Tensor, hook: Any) -> Tensor | None:
        cut = edges(scores)
        if not cut.any():  # nothing to cut: leave the tensor itself (bit-identical downstream)
            return None
        new, state["dead"] = attention_cut(scores, cut, "scores")
        return new

    def on_pattern(pattern: Tensor, hook: Any) -> Tensor | None:
        if mode == "pattern":
            cut = edges(pattern)
            return attention_cut(pattern, cut, "pattern")[0] if cut.any() else None
        dead = state.pop("dead", None)
        return pattern if dead is None or not dead.any() else pattern.masked_fill(dead[..., None], 0.0)

    hooks = [(f"{site}.hook_pattern", on_pattern)]
    if mode == "scores":
        if f"{site}.hook_attn_scores" not in names:
            raise ValueError(f"{site} has no hook_attn_scores; use attention='pattern'")
        hooks.insert(0, (f"{site}.hook_attn_scores", on_scores))
    return hooks


def _ssm_hooks(model: Any, site: str, sources: Positions, targets: Positions, channels: Any,
               cut_conv: bool) -> list:
    mixer = model.get_submodule(site)
    chan = _channel_mask(channels, _ssm_A(mixer).shape[0], site)
    seen: dict[str, Tensor] = {}

    def masks(x: Tensor) -> tuple[Tensor, Tensor]:
        batch, pos = x.shape[:2]
        return (position_mask(targets, batch, pos, x.device, "targets"),
                position_mask(sources, batch, pos, x.device, "sources"))

    def keep(key: str):
        def fn(x: Tensor, hook: Any) -> None:
            seen[key] = x
        return fn

    def on_y(y: Tensor, hook: Any) -> Tensor | None:
        u, dt, B, C = (seen.pop(k) for k in ("u", "dt", "B", "C"))
        t, s = masks(y)
        if not (t.any() and s.any()) or (chan is not None and not chan.any()):
            return None  # nothing to cut: the tensor itself goes on
        return y - ssm_cut(u, dt, B, C, _ssm_A(mixer), t, s, chan)  # A read now: one graph per forward

    hooks = [(f"{site}.hook_ssm_in", keep("u")), (f"{site}.hook_dt", keep("dt")), (f"{site}.hook_B", keep("B")),
             (f"{site}.hook_C", keep("C")), (f"{site}.hook_y", exact_hook(on_y))]  # y from the exact path
    if cut_conv:
        conv_chan = _conv_channels(chan, _conv_weight(mixer).shape[0], _d_inner(mixer))

        def on_conv(conv: Tensor, hook: Any) -> Tensor | None:
            t, s = masks(conv)
            conv_in = seen.pop("in")
            if not (t.any() and s.any()) or (conv_chan is not None and not conv_chan.any()):
                return None
            return conv - conv_cut(conv_in, _conv_weight(mixer), t, s, conv_chan)  # read now: real when offloaded

        hooks = [(f"{site}.hook_in", keep("in")), (f"{site}.hook_conv", on_conv)] + hooks
    return hooks


def _d_inner(mixer: Any) -> int:
    """The mixer's inner width (out_proj's input): its first d_inner conv channels belong to u."""
    d_inner = getattr(getattr(mixer, "out_proj", None), "in_features", None)
    if d_inner is None:
        raise TypeError(f"{type(mixer).__name__} has no out_proj; cannot map channels to conv channels")
    return int(d_inner)


# ------------------------------------------------------------------------- decay and features
def decay_norms(model: Any, layer: int) -> Float[Tensor, "c"]:
    """||exp(A)||_1 over d_state at dt = 1, per channel (Mamba-1) or per head (Mamba-2).

    Large = slow decay (exp(A) near 1: the channel remembers far back); small = fast decay.
    Mamba-2 has one scalar A per head, so its value is d_state * exp(A_h).
    """
    mixer = model.get_submodule(f"blocks.{layer_index(layer, model.cfg.n_layers)}.mixer")
    with torch.no_grad(), onloaded(model, mixer):  # a dispatched model's offloaded weights made real
        A = _ssm_A(mixer).double()
        if A.ndim == 2:
            return torch.exp(A).sum(-1)
        return torch.exp(A) * getattr(model.cfg, "d_state", 1)


class DecaySplit(NamedTuple):
    fastest: Tensor  # channel indices with the smallest decay norms (fastest decay), ascending norm
    slowest: Tensor  # channel indices with the largest decay norms (slowest decay), descending norm
    norms: Tensor  # decay_norms(model, layer)


def decay_split(model: Any, layer: int, fraction: float = 1 / 3) -> DecaySplit:
    """The `fraction` of channels (heads) that decay fastest and the `fraction` that decay slowest."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    norms = decay_norms(model, layer)
    k = max(1, int(round(fraction * len(norms))))
    order = torch.argsort(norms, stable=True)
    return DecaySplit(order[:k], order.flip(0)[:k], norms)


@dataclass(frozen=True, eq=False)
class FeaturePlan:
    """Which SSM channels a feature knockout cuts and which it spares, per layer.

    group: "fastest" or "slowest" (the decay_split set chosen); reading: "cut" cuts that group and
    spares the rest (what the paper's labels say); "spare" spares that group and cuts the other
    channels (what the paper's code does).
    """

    group: str
    fraction: float
    reading: str
    cut: dict[int, Tensor]
    spared: dict[int, Tensor]

    def describe(self) -> str:
        n_cut = sum(len(v) for v in self.cut.values())
        n_spared = sum(len(v) for v in self.spared.values())
        what = f"the {self.group} {self.fraction:.3g}" if self.reading == "cut" else f"all but the {self.group} {self.fraction:.3g}"
        return f"cuts {what} of channels per layer ({n_cut} cut, {n_spared} spared over {len(self.cut)} layers)"


FEATURE_GROUPS = ("fastest", "slowest")
FEATURE_READINGS = ("cut", "spare")


def feature_plan(model: Any, layers: Iterable[int], group: str = "slowest", fraction: float = 1 / 3,
                 reading: str = "cut") -> FeaturePlan:
    """Rank each layer's channels by decay_norms and choose what to cut (see FeaturePlan)."""
    if group not in FEATURE_GROUPS:
        raise ValueError(f"group must be one of {FEATURE_GROUPS}, got {group!r}")
    if reading not in FEATURE_READINGS:
        raise ValueError(f"reading must be one of {FEATURE_READINGS}, got {reading!r}")
    cut, spared = {}, {}
    for layer in layer_list(layers, model.cfg.n_layers):
        if not knockout_sites(model, layer)[1]:
            continue  # no SSM mixer here: attention is cut whole
        split = decay_split(model, layer, fraction)
        chosen = getattr(split, group)
        rest = torch.ones(len(split.norms), dtype=torch.bool)
        rest[chosen] = False
        others = rest.nonzero()[:, 0]
        cut[layer], spared[layer] = (chosen, others) if reading == "cut" else (others, chosen)
    return FeaturePlan(group, fraction, reading, cut, spared)


@contextlib.contextmanager
def feature_knockout(model: Any, sources: Positions, targets: Positions, layers: Iterable[int],
                     group: str = "slowest", fraction: float = 1 / 3, reading: str = "cut",
                     **kwargs: Any) -> Iterator[FeaturePlan]:
    """Knockout restricted to SSM channels chosen by decay; yields the FeaturePlan (cut and spared).

    reading="cut": the chosen `group` (fastest or slowest `fraction` of channels, decay_split) is cut,
    the other channels are spared. reading="spare": the chosen group is SPARED and every other channel
    is cut; this is what the Mamba Knockout paper's code does. Attention layers in the window, if
    any, are cut whole. Other keyword arguments go to knockout (attention, cut_conv).
    """
    layers = list(layers)
    plan = feature_plan(model, layers, group, fraction, reading)
    if not plan.cut:
        raise ValueError(f"layers {layers} have no SSM mixer: a feature knockout needs one")
    with knockout(model, sources, targets, layers, channels=plan.cut, **kwargs):
        yield plan
