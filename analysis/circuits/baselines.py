"""What an ablated edge carries: the senders' baseline activations (patch, zero, mean).

Glossary
    baseline      the activations an ablated edge's sender takes in its receiver's input instead of this
                  run's: a runs.Activations of the chunk's shape ([n batch pos d_model] per sender group, and
                  the token embedding side blocks read). Edge patching (runs.Patcher) takes it as its source
                  and EAP's score product as the far end of diff = baseline - clean, so verification and
                  the estimates ablate the same way.
    patch         the corrupt run's activations (a recorded forward on `corrupt`, the clean batch's shape)
    zero          zeros for every sender. The embedding sender ("embed", the stream entering block 0:
                  token and position embeddings, times any embedding multiplier) is zero too, and so is the
                  token embedding that side blocks read (hook_embed): an ablated edge from it carries nothing.
    mean          the mean over a reference batch (`reference=`: prompts as clean takes them, prompts.py),
                  sender by sender (the embedding sender's and hook_embed's included): over prompts and their
                  real positions (per_position=False, "whole": one d_model vector per sender, for clean
                  prompts of any lengths), or over prompts at each position (per_position=True: reference
                  and clean prompts all of one length). Sums in float64, stored in the model's dtype.
    ablated run   every edge carries the baseline: each receiver reads the sum of the senders' baselines
                  (patch: the corrupt run itself; zero: a zero stream; mean: the mean stream). Its metric is
                  the far end of faithfulness, (circuit - ablated) / (clean - ablated), and EdgeScores'
                  `corrupt_metric` (zero and mean: one patched forward per chunk, no gradient).
    EAP-IG        "eap-ig" (inputs) interpolates the token embedding (hook_embed) from the baseline's to the
                  clean one: patch, the corrupt run's; zero, 0; mean, the reference's mean token embedding
                  (per position or whole). A position embedding (GPT-2) is the clean run's at every step, so
                  with zero or mean the path starts at the baseline's token embedding with clean positions,
                  not at the baseline's stream. "eap-ig-activations" interpolates each sender group's own
                  output between its baseline and clean (integrated.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from analysis.circuits.attribution import chunks
from analysis.circuits.graph import Graph
from analysis.circuits.prompts import Prompts, check_metric, prompt_pair, prompts_of
from analysis.circuits.runs import Activations, patched, record

INTERVENTIONS = ("patch", "zero", "mean")


class Baseline:
    """One intervention for one graph: `activations(part, clean_chunk)` gives the baseline of a chunk of the
    clean prompts (with the corrupt logits when it ran a forward), `ablated(...)` the fully ablated run's
    logits."""

    def __init__(self, graph: Graph, kind: str, corrupt: Prompts | None = None,
                 means: tuple[list[Tensor], Tensor] | None = None) -> None:
        self.graph, self.kind, self.corrupt, self.means = graph, kind, corrupt, means

    def activations(self, model: Any, part: slice, clean: Prompts,
                    tail: int | None = None) -> tuple[Tensor | None, Activations]:
        """(the corrupt logits or None, the baseline of the prompts `part`, whose clean prompts are `clean`)."""
        if self.kind == "patch":
            x = self.corrupt.rows(part)
            return record(model, self.graph, x.tokens, x.attention_mask, tail=tail)
        acts = Activations(self.graph)
        batch, pos = clean.tokens.shape
        d = model.hook_shape("blocks.0.hook_resid_pre", batch=1, pos=1)[-1]  # the stream's width, as its hooks say
        like = next(model.parameters())
        for k, (g, ss) in enumerate(zip(self.graph.sender_groups, self.graph.sender_slices)):
            shape = (ss.stop - ss.start, batch, pos, d)
            if self.means is None:
                acts.acts[id(g)] = like.new_zeros(()).expand(shape)  # a view: nothing is allocated
            else:
                acts.acts[id(g)] = self.means[0][k].expand(shape)
        acts.emb = like.new_zeros(()).expand(1, batch, pos, d) if self.means is None else \
            self.means[1].expand(1, batch, pos, d)
        return None, acts

    def ablated(self, model: Any, clean: Prompts, acts: Activations, corrupt_logits: Tensor | None,
                tail: int | None = None) -> Tensor:
        """Logits of the run with every edge at the baseline (patch: the corrupt run's, already recorded)."""
        if corrupt_logits is not None:
            return corrupt_logits
        ones = torch.ones(1, len(self.graph), dtype=next(model.parameters()).dtype)
        return patched(model, self.graph, clean.tokens, acts, ones, clean.attention_mask, tail=tail)


def means_of(model: Any, graph: Graph, reference: Prompts, per_position: bool,
             batch_size: int | None) -> tuple[list[Tensor], Tensor]:
    """Per sender group its mean activation [n 1 1|pos d_model] over the reference's real positions (see the
    glossary), and the token embedding's [1 1 1|pos d_model]."""

    def read(r: Prompts) -> list[Tensor]:
        _, acts = record(model, graph, r.tokens, r.attention_mask)
        return [acts.get(g) for g in graph.sender_groups] + [acts.emb]

    *groups, emb = real_means(model, reference, per_position, batch_size, read)
    return groups, emb


def real_means(model: Any, reference: Prompts, per_position: bool, batch_size: int | None,
               read: Any) -> list[Tensor]:
    """The means of the tensors `read(chunk)` ([... batch pos d]) over the reference's prompts and real
    positions, or over its prompts at each position ([... 1 1|pos d]); sums in float64, the model's dtype."""
    keep = (-3,) if per_position else (-3, -2)  # batch, or batch and positions
    count = reference.batch if per_position else int(reference.lengths.sum())
    sums: list[Tensor] | None = None
    for part in chunks(reference.batch, batch_size):
        r = reference.rows(part)
        real = (torch.ones_like(r.tokens, dtype=torch.float64) if r.attention_mask is None else
                r.attention_mask.double())[:, :, None]  # pad positions count for nothing
        now = [(x.double() * real).sum(keep, keepdim=True) for x in read(r)]
        sums = now if sums is None else [a + b for a, b in zip(sums, now)]
    dtype = next(model.parameters()).dtype
    return [(s / count).to(dtype) for s in sums]


def prepare(model: Any, graph: Graph, clean: Any, corrupt: Any, intervention: str, reference: Any,
            per_position: bool, batch_size: int | None, attention_mask: Any = None,
            metric: Any = None) -> tuple[Prompts, Baseline]:
    """(the clean prompts, the Baseline), every argument checked against the intervention by name (callers
    check `intervention` is one of INTERVENTIONS). attention_mask: the padding of the clean (and corrupt)
    token batches; metric: refused when it would read padding (prompts.py)."""
    if intervention != "mean" and reference is not None:
        raise ValueError(f"reference is the batch intervention='mean' averages over; intervention={intervention!r} "
                         "does not read it")
    if intervention != "mean" and per_position:
        raise ValueError(f"per_position is a choice of intervention='mean'; intervention={intervention!r} has none")
    if intervention == "patch":
        if corrupt is None:
            raise ValueError("intervention='patch' needs corrupt tokens (the run whose activations are patched in)")
        clean, corrupt = prompt_pair(model, clean, corrupt, attention_mask, metric)
        return clean, Baseline(graph, "patch", corrupt=corrupt)
    if corrupt is not None:
        raise ValueError(f"intervention={intervention!r} does not read corrupt tokens: pass corrupt=None")
    clean = prompts_of(model, clean, attention_mask, "clean")
    if metric is not None and clean.padded:
        check_metric(metric, clean)
    if intervention == "zero":
        return clean, Baseline(graph, "zero")
    if reference is None:
        raise ValueError("intervention='mean' needs reference= (the prompts the means are taken over)")
    reference = prompts_of(model, reference, None, "reference")
    if per_position and (reference.padded or clean.padded or reference.width != clean.width):
        raise ValueError(f"per_position=True needs the reference and the clean prompts all of one length; got "
                         f"reference lengths {sorted(set(reference.lengths.tolist()))}, clean "
                         f"{sorted(set(clean.lengths.tolist()))} (or per_position=False: one mean over positions)")
    return clean, Baseline(graph, "mean", means=means_of(model, graph, reference, per_position, batch_size))
