"""Weight processing, as an explicit opt-in (TransformerLens's `from_pretrained` defaults, by hand).

Glossary
    reader       a linear layer that reads a norm's output: attention q/k/v (after ln1), the MLP's
                 up/gate (after ln2), an SSM mixer's in_proj (after ln1), the unembedding (after
                 ln_final). Found from the module structure (a module with `ln1` and `attn`, `ln2`
                 and `mlp`, `ln1` and `mixer`; the model's `ln_final` and `unembed`), so every family
                 built from these blocks is covered.
    writer       a matrix that writes into the residual stream: the embeddings, o_proj, the MLP's
                 down_proj, a mixer's out_proj.

fold_ln                norm weight w and bias b move into each reader: W' = W diag(w), b' = b_reader
                       + W b; the norm keeps weight 1 and bias 0. After a LayerNorm the readers are
                       also centred over d_model (their input has zero mean, so this changes nothing).
                       RMSNorm models: the weight folds, nothing is centred (TL's RMSPre).
center_writing_weights every writer minus its mean over d_model (LayerNorm models only: an RMSNorm
                       does not remove the mean, so centring would change the model; skipped with a
                       warning, as TL does).
center_unembed         W_U minus its mean over the vocabulary (and b_U likewise): logits change by a
                       constant per position, log-probabilities do not.
fold_value_biases      b_O += sum_h b_V[h] W_O[h]; b_V = 0 (each head's pattern sums to 1). Skipped with a
                       warning on attention with sinks (GPT-OSS: a row sums to 1 - the sink's share).

A tied unembedding is untied first when a step would change it (folding ln_final, centring W_E or
W_U): the processed model is no longer tied. Nothing here runs unless asked.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from hooked.models.norms import LayerNorm
from hooked.validate import Flag, checked


@checked(fold_ln=Flag(), center_writing_weights=Flag(), center_unembed=Flag(), fold_value_biases=Flag())
def process_weights(model: Any, fold_ln: bool = True, center_writing_weights: bool = True,
                    center_unembed: bool = True, fold_value_biases: bool = True) -> Any:
    """Apply the chosen steps in place (TL's order) and return the model.

    Refused on a dispatched model with offloaded weights (meta between forwards): processing
    rewrites weights in place, which an offload store would not keep."""
    offloaded = sorted({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.is_meta})
    if offloaded:
        raise ValueError(f"weight processing needs every weight in memory; {len(offloaded)} modules are offloaded "
                         f"({', '.join(offloaded[:3])}{', ...' if len(offloaded) > 3 else ''}): load the model "
                         "without device_map to process its weights")
    if center_unembed and getattr(getattr(model, "unembed", None), "softcap", None) is not None:
        raise ValueError("center_unembed shifts each position's logits by a constant, which the final soft-cap "
                         "(Gemma 2) does not pass through: the probabilities would change; use center_unembed=False")
    with torch.no_grad():
        if fold_ln:
            fold_layer_norm(model)
        if center_writing_weights:
            center_writers(model)
        if center_unembed:
            center_unembedding(model)
        if fold_value_biases:
            fold_value_bias(model)
    return model


# ---------------------------------------------------------------------------------- helpers
def _untie(model: Any) -> None:
    unembed = model.unembed
    if getattr(unembed, "tied", False):  # hooked.models.embed.Unembed reading the embedding
        unembed.__dict__["_tied_to"] = None
        unembed.weight = nn.Parameter(model.embed.weight.detach().clone())
    elif unembed.weight is model.embed.weight:
        unembed.weight = nn.Parameter(model.embed.weight.detach().clone())


def _add_bias(lin: nn.Module, delta: Tensor) -> None:
    if lin.bias is None:
        lin.bias = nn.Parameter(delta.clone())
    else:
        lin.bias.add_(delta)


def _readers(model: Any) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(norm, [linear readers]) for every norm reading the residual stream."""
    pairs: dict[int, tuple[nn.Module, dict[int, nn.Module]]] = {}  # by norm, readers by id: shared blocks once

    def add(norm: nn.Module, readers: list[nn.Module]) -> None:
        found = pairs.setdefault(id(norm), (norm, {}))[1]
        for r in readers:
            for lin in _matrices(r):
                found[id(lin)] = lin

    for block in model.blocks:
        for norm, readers in block.norm_readers():  # the block protocol (hooked/models/block.py)
            add(norm, readers)
    add(model.ln_final, [model.unembed])
    for norm, readers in pairs.values():
        if not readers:
            raise ValueError(f"fold_ln: found no linear layer reading {type(norm).__name__}")
    return [(norm, list(readers.values())) for norm, readers in pairs.values()]


def _matrices(reader: nn.Module) -> list[nn.Module]:
    """The weight matrices applied to a reader's input: a linear layer, or an adapted one's base and
    low-rank `down` (Zamba2's per-invocation LoRA: base(x) + up(down(x)))."""
    if isinstance(getattr(reader, "weight", None), Tensor) and reader.weight.ndim == 2:
        return [reader]
    if isinstance(getattr(reader, "base", None), nn.Linear) and isinstance(getattr(reader, "down", None), nn.Linear):
        return [reader.base, reader.down]
    raise ValueError(f"fold_ln: {type(reader).__name__} has no weight matrix to fold a norm into")


def _is_layer_norm(model: Any) -> bool:
    return all(isinstance(norm, LayerNorm) for norm, _ in _readers(model))


# ------------------------------------------------------------------------------------ steps
def fold_layer_norm(model: Any) -> None:
    _untie(model)
    for norm, readers in _readers(model):
        if not isinstance(getattr(norm, "weight", None), Tensor):
            continue  # a step reading the stream itself (OLMo-hybrid's post-norm layers): nothing to fold
        center = isinstance(norm, LayerNorm)
        offset = getattr(norm, "weight_offset", 0.0)  # Gemma's (1 + w) norms: the gain is w + 1
        w, b = norm.weight.detach().clone() + offset, getattr(norm, "bias", None)
        for lin in readers:
            if b is not None:
                delta = lin.weight @ b
                _add_bias(lin, delta)
            lin.weight.mul_(w)
            if center:
                lin.weight.sub_(lin.weight.mean(-1, keepdim=True))
        norm.weight.fill_(1.0 - offset)
        if b is not None:
            b.zero_()


def center_writers(model: Any) -> None:
    if not _is_layer_norm(model):
        warnings.warn("center_writing_weights skipped: the model's norms are not LayerNorms (an RMSNorm keeps "
                      "the mean, so centring would change the outputs)", stacklevel=3)
        return
    _untie(model)
    writers: list[Tensor] = [model.embed.weight]
    if getattr(model, "pos_embed", None) is not None:
        writers.append(model.pos_embed.weight)
    for w in writers:  # rows are d_model vectors
        w.sub_(w.mean(-1, keepdim=True))
    for module in model.modules():
        for name in ("o_proj", "down_proj", "out_proj"):
            lin = getattr(module, name, None)
            if isinstance(lin, nn.Linear) and lin.out_features == model.cfg.d_model:
                lin.weight.sub_(lin.weight.mean(0, keepdim=True))  # columns are d_model vectors
                if lin.bias is not None:
                    lin.bias.sub_(lin.bias.mean())


def center_unembedding(model: Any) -> None:
    _untie(model)
    W = model.unembed.weight  # [d_vocab d_model]
    W.sub_(W.mean(0, keepdim=True))
    if getattr(model.unembed, "bias", None) is not None:
        model.unembed.bias.sub_(model.unembed.bias.mean())


def fold_value_bias(model: Any) -> None:
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if attn is None or getattr(attn.v_proj, "bias", None) is None:
            continue
        if getattr(attn, "sinks", None) is not None:  # sink_attention.py: rows sum to less than 1
            warnings.warn("fold_value_biases skipped on attention with sinks: a pattern row sums to 1 minus the "
                          "sink's share, so b_V does not fold into b_O", stacklevel=3)
            continue
        folded = torch.einsum("hd,hdm->m", attn.b_V, attn.W_O)
        _add_bias(attn.o_proj, folded)
        attn.v_proj.bias.zero_()
