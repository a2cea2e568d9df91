"""Knockout: cut the information flow from source tokens to target tokens inside chosen layers.

Glossary
    edge        (target j, source i): what target position j reads from source position i in one
                layer. Row = target (query), column = source (key), as in hook_pattern and hook_kernel.
    sources, targets  positions shared by the batch (ints, negative ok, indexing the padded tensor) or
                bool masks [batch pos] (one row per example, so facts with different spans batch).
    site        a place where an edge can be cut: a TokenMixer of the block (hooked/models/protocol.py):
                attention (Zamba2's blocks.{l}.shared.attn included) or an SSM mixer. Each mixer
                says how its edges are cut (`cut_edges`); the arithmetic is hooked/ops/edge_cut.py.
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

While decoding with a DecodeState (`model(new_tokens, state=state)`, `generate`), positions index the
whole sequence read so far, past and new (negative ones count from its end; positions not read yet
are cut when they are read, and a bool mask may be wider than the sequence), and every step cuts
exactly the edges of the whole-sequence forward at its positions: an SSM carries the part of its state
that came from cut sources across steps (hooked/models/cut_record.py). A step that cannot be exact is
refused with a `PastCutMismatch` (a StateRefused) naming the positions: targets or sources that move
with the sequence's end (targets=[-1] refuses the step after the prefill: decode such knockouts with
generate(..., use_past_kv_cache=False)), or a knockout entered after positions holding its sources or
targets were read without it.

Knockout reads dt, B, C (not hook_A_bar, hook_B_bar or hook_kernel), so edits another hook makes to
those three lazy quantities are not seen by the kernel terms it removes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch
from jaxtyping import Float
from torch import Tensor

from hooked.validate import Flag, Number, check, checked
from hooked.validate import check_positions, index_mask, layer_index, layer_list, position_mask
from hooked.devices import onloaded
from hooked.hook_points import scoped_hooks
from hooked.models.model_map import Site, model_map
from hooked.models.protocol import ATTENTION_MODES

Positions = Union[int, Sequence[int], range, Tensor]
Channels = Union[None, Sequence[int], Tensor, dict]


# ------------------------------------------------------------------------------------- sites
def layer_mixers(model: Any, layer: int) -> list[Site]:
    """The model map's site of every TokenMixer in block `layer` (attention, SSM mixers; Zamba2's shared
    attention too), in forward order. An MLP-only block has none."""
    return [s for s in model_map(model).layer_sites(layer) if s.mixes_tokens]


def knockout_sites(model: Any, layer: int) -> tuple[list[str], list[str]]:
    """(names of the mixers that cut every head: attention; of those that cut the listed channels only: the
    recurrent mixers) of block `layer`, from the model map."""
    mixers = layer_mixers(model, layer)
    return [s.path for s in mixers if not s.recurrent], [s.path for s in mixers if s.recurrent]


def _channel_mask(channels: Any, n: int, where: str) -> Tensor | None:
    """Bool mask [n] from indices or a bool mask; None means every channel."""
    if channels is None:
        return None
    return index_mask(channels, n, "channels", f"channels of {where}")


# ------------------------------------------------------------------------------ the context
@contextlib.contextmanager
@checked(cut_conv=Flag())
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
        check_positions(spec, what)
    if isinstance(channels, dict):
        channels = {layer_index(k, n_layers, "channels key"): v for k, v in channels.items()}
        stray = sorted(set(channels) - set(layers))
        if stray:
            raise ValueError(f"channels has entries for layers {stray}, which are not in layers={layers}: "
                             "nothing would be cut there")

    def masks(batch: int, pos: int, device: torch.device, open_end: bool = False) -> tuple[Tensor, Tensor]:
        return (position_mask(targets, batch, pos, device, "targets", open_end),
                position_mask(sources, batch, pos, device, "sources", open_end))

    hooks: list[tuple[Any, Any]] = []
    with_ssm: set[int] = set()
    for layer in layers:
        for site in layer_mixers(model, layer):  # none: an MLP-only block (NemotronH)
            chan = None
            if site.recurrent:  # attention cuts every head and reads no channels
                if isinstance(channels, dict) and layer not in channels:
                    raise ValueError(f"channels has no entry for layer {layer} (its keys: {sorted(channels)})")
                chan = _channel_mask(channels[layer] if isinstance(channels, dict) else channels, site.n, site.path)
                with_ssm.add(layer)
            hooks += site.module.cut_edges(masks, chan, attention=attention, cut_conv=cut_conv)
    if channels is not None and not with_ssm:
        raise ValueError(f"channels restricts the cut of SSM mixers, and layers {layers} have none (attention "
                         "always cuts every head): drop channels, or use ablate_heads for single heads")
    no_ssm = sorted(set(channels) - with_ssm) if isinstance(channels, dict) else []
    if no_ssm:
        raise ValueError(f"channels has entries for layers {no_ssm}, which have no SSM mixer to restrict")
    with scoped_hooks([(point, fn, False) for point, fn in hooks]):
        yield model


# ------------------------------------------------------------------------- decay and features
def decay_norms(model: Any, layer: int) -> Float[Tensor, "c"]:
    """||exp(A)||_1 over d_state at dt = 1, per channel (Mamba-1) or per head (Mamba-2): the layer's SSM
    mixer's `decay_norms()`.

    Large = slow decay (exp(A) near 1: the channel remembers far back); small = fast decay.
    Mamba-2 has one scalar A per head, so its value is d_state * exp(A_h).
    """
    layer = layer_index(layer, model.cfg.n_layers)
    ssm = [s.module for s in layer_mixers(model, layer) if s.recurrent]
    if not ssm:
        raise TypeError(f"block {layer} has no state-space mixer: decay_norms needs one")
    with torch.no_grad(), onloaded(model, ssm[0]):  # a dispatched model's offloaded weights made real
        return ssm[0].decay_norms()


class DecaySplit(NamedTuple):
    fastest: Tensor  # channel indices with the smallest decay norms (fastest decay), ascending norm
    slowest: Tensor  # channel indices with the largest decay norms (slowest decay), descending norm
    norms: Tensor  # decay_norms(model, layer)


def decay_split(model: Any, layer: int, fraction: float = 1 / 3) -> DecaySplit:
    """The `fraction` of channels (heads) that decay fastest and the `fraction` that decay slowest."""
    fraction = check(fraction, "decay_split: fraction", Number(gt=0, le=1))
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
