"""Attribution screening: every unit's ablation effect estimated from one forward and one backward.

Glossary
    write        a unit's output at its module's write hook (attention `hook_z`, SSM `hook_gated`:
                 see analysis.interventions.ablation); ablating the unit replaces its slice of the
                 write by `fill` (0, or the mean write for mean ablation). For an expert unit the
                 write is its routing weight (`hook_routing_weights`, in the slots where
                 `hook_chosen` names it): zero-ablating the expert zeroes those weights
                 (`ablate_experts`), and the MoE output is linear in them, so the estimate is first
                 order in what follows the MoE only.
    estimate     first order (attribution patching, Nanda 2023; Kramar et al. 2024, AtP): the change
                 of a per-example quantity q is ~ sum over positions and features of
                 dq/dwrite * (fill - write), restricted to the unit's heads. One forward of every
                 prompt with the writes on the graph, one backward per quantity, for all units at once.
    margin       per example: the answer's score minus the best other choice's (> 0: right). The
                 estimated accuracy after ablation counts the examples whose estimated margin
                 (margin + its estimated change) is > 0; `est_drop` = accuracy now - that.
    logprob      per example: the answer's log-probability normalised over the choices;
                 `est_logprob_drop` = minus the mean estimated change.
    margin drop  `est_margin_drop` = minus the mean estimated margin change: it does not saturate
                 where the model is sure (answer probability ~1 flattens the log-prob's gradient,
                 not the gap to the runner-up).
    saturation   a first-order estimate misses what is nonlinear downstream (a softmax that
                 saturates, a redundant twin that takes over). Two refinements (`refine=`):
                 "scores" linearises each choice's score (one backward per choice) and applies the
                 log-softmax over the choices and the margin's max exactly: a sure answer (p ~ 1)
                 flattens its own log-prob's gradient, not its rivals' scores. "qk" adds AtP*'s QK
                 fix (`analysis.ga.qk_fix`): every later attention pattern recomputed exactly for the
                 unit's direct change. Either way the screen's top candidates are then ablated
                 exactly (`rank_heads(method="screened")`), plus a random control set that measures
                 what the screen missed.
    gradient path  each write is replaced by a copy on the graph (requiring grad); through lazy hooks
                 this is kept as an edit (`hooked.hook_points.through_hook`), so no nudge is needed.
                 The copy is not detached from earlier writes: d q / d write is the total derivative,
                 through every later head, MLP and SSM (a detached copy would give only the paths
                 that avoid every later hooked write, and miss heads that act through later ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from analysis.interventions.ablation import _mean_of
from hooked.models.model_map import Site, Unit, model_map
from analysis.tasks.scoring import ChoiceScorer

REFINES = ("none", "scores", "qk")


def _row_owner(scorer: ChoiceScorer) -> list[Tensor]:
    """Per whole-row batch (`scorer.batches`): the example each row belongs to ([rows], -1: none)."""
    out = []
    for batch in scorer.batches:
        owner = torch.full((len(batch.tokens),), -1, dtype=torch.long)
        owner[batch.rows.cpu()] = batch.owner.cpu() // scorer.n_choices
        out.append(owner)
    return out


def write_attributions(model: Any, scorer: ChoiceScorer, modules: Sequence[str], mode: str = "zero",
                       mean_cache: Any = None, extra: Sequence[str] = (), keep: Sequence[str] = (),
                       per_choice: bool = False) -> dict[str, Any]:
    """Per head module or MoE: estimated change of each example's quantities when each of its heads
    (experts) is ablated: {quantity: {prefix: [example head]}, "base_margin": [example],
    "base_logprob": [example], "base_scores": [example choice], "answers": [example], "quantities": names}.

    Quantities: "margin" and "logprob" (two backwards), or with per_choice every choice's score
    "choice0", "choice1", ... (one backward per choice; `estimate_effects` then applies the exact
    log-softmax over the choices). extra: more hook names whose activations and gradients are
    returned per batch (out["extra"][name] = {"value": [...], quantity: [...]}); keep: hook names whose
    activations alone are returned (out["kept"][name] = [...]). Used by `analysis.ga.qk_fix`.
    """
    mp = model_map(model)  # asked once: head modules and mixtures of experts
    known = {s.path: s for s in mp}
    unknown = [p for p in modules if p not in known]
    if unknown:
        raise ValueError(f"{unknown} are neither head modules nor mixture-of-experts MLPs of this model")
    return site_attributions(model, scorer, [known[p] for p in modules], mode, mean_cache, extra, keep, per_choice)


def site_attributions(model: Any, scorer: ChoiceScorer, sites: Sequence[Site], mode: str = "zero",
                      mean_cache: Any = None, extra: Sequence[str] = (), keep: Sequence[str] = (),
                      per_choice: bool = False) -> dict[str, Any]:
    """`write_attributions` of the model map's `sites` (token mixers and mixtures of experts)."""
    moe_sites = [s for s in sites if not s.mixes_tokens]
    if moe_sites and mode != "zero":
        raise ValueError(f"expert units are zero-ablated only, got mode={mode!r}")
    mods = [s for s in sites if s.mixes_tokens]
    routing = {s.module.hook_routing_weights.name: s for s in moe_sites}  # expert writes are cut at their weights
    acts: dict[str, list[Tensor]] = {m.hook: [] for m in mods}
    acts.update({name: [] for name in routing})
    acts.update({name: [] for name in extra})
    seen: dict[str, list[Tensor]] = {s.module.hook_chosen.name: [] for s in moe_sites}
    seen.update({name: [] for name in keep})

    def grab(act: Tensor, hook: Any) -> Tensor:
        # stay on the graph: a detached copy would cut every path from earlier writes through this
        # one, and earlier units' estimates would miss their effect through later heads
        x = act.clone() if act.requires_grad else act.detach().clone().requires_grad_(True)
        acts[hook.name].append(x)
        return x

    def look(act: Tensor, hook: Any) -> None:
        seen[hook.name].append(act.detach())

    hooks = [(name, grab) for name in acts] + [(name, look) for name in seen]
    n_ex, n_ch = len(scorer.examples), scorer.n_choices
    device = next(model.parameters()).device
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        # one activation per forward and hook; owners: the example of each row of each forward. The QK
        # fix (extra / keep) reads scorer.batches' whole rows, so it gets them here too
        answers = scorer.answers().to(device)
        flat, owners = scorer.flat_scores(whole_rows=bool(extra or keep))
        raw = flat.view(n_ex, n_ch)
        invalid = torch.tensor([[c >= len(e.choices) for c in range(n_ch)] for e in scorer.examples], device=device)
        scores = raw.masked_fill(invalid, float("-inf"))
        margin, logprob = _margin_logprob(scores, answers)
        if per_choice:  # an absent choice's row of `raw` is 0, its gradient 0
            quantities = {f"choice{c}": raw[:, c] for c in range(n_ch)}
        else:
            quantities = {"margin": margin, "logprob": logprob}
        names = list(acts)
        leaves = [x for name in names for x in acts[name]]
        grads = {}
        for k, (key, q) in enumerate(quantities.items()):
            grads[key] = torch.autograd.grad(q.sum(), leaves, retain_graph=k < len(quantities) - 1, allow_unused=True)
    owners = [o.cpu() for o in owners]
    out: dict[str, Any] = {key: {} for key in quantities}
    out.update({"base_margin": margin.detach().cpu(), "base_logprob": logprob.detach().cpu(),
                "base_scores": scores.detach().cpu(), "answers": answers.cpu(), "quantities": list(quantities),
                "extra": {}, "kept": {name: seen[name] for name in keep}})
    i = 0
    for name in names:
        count = len(acts[name])
        if name in extra:
            out["extra"][name] = {"value": [a.detach() for a in acts[name]],
                                  **{key: list(g[i:i + count]) for key, g in grads.items()}}
            i += count
            continue
        if name in routing:
            site = routing[name]
            prefix, width, fill = site.path, site.n, torch.zeros((), dtype=torch.float64)
            picks = seen[site.module.hook_chosen.name]
        else:
            m = next(m for m in mods if m.hook == name)
            prefix, width, picks = m.prefix, m.n_heads, None
            fill = torch.zeros((), dtype=torch.float64) if mode == "zero" else _mean_of(mean_cache, m.hook).double()
        for key, g_key in grads.items():
            per_ex = torch.zeros(n_ex, width, dtype=torch.float64)
            for b, act in enumerate(acts[name]):
                g = g_key[i + b]
                if g is None:
                    continue
                a = act.detach().double().cpu()
                prod = g.double().cpu() * (fill - a)  # [rows pos ...]
                if picks is None:
                    per_unit = prod.sum(1).reshape(len(a), width, -1).sum(-1)  # [rows n_heads]
                else:  # each slot's term goes to the expert chosen there: [rows n_experts]
                    per_unit = torch.zeros(len(a), width, dtype=torch.float64).scatter_add_(
                        1, picks[b].cpu().flatten(1), prod.flatten(1))
                real = owners[b] >= 0
                per_ex.index_add_(0, owners[b][real], per_unit[real])
            out[key][prefix] = per_ex
        i += count
    return out


def estimate_effects(model: Any, scorer: ChoiceScorer, units: Sequence[Any], mode: str = "zero",
                     mean_cache: Any = None, refine: str = "none", replicas: int = 8) -> dict[str, dict[str, float]]:
    """{unit label: {"est_drop", "est_logprob_drop", "est_margin_drop"}} from one forward and one backward per
    quantity; heads, channel groups and experts alike (a unit's `heads` index its module's columns).

    refine (the glossary's "refinements"): "none" (first order in margin and log-prob), "scores"
    (first order in each choice's score, exact after), "qk" ("scores" plus AtP*'s QK fix,
    `analysis.ga.qk_fix`; `replicas` units per forward there).
    """
    mp = model_map(model)  # asked once: the units' sites and the attention the QK fix recomputes
    return unit_effects(model, scorer, mp.placed(units), mp.mixers(), mode, mean_cache, refine, replicas)


def unit_effects(model: Any, scorer: ChoiceScorer, units: Sequence[Unit], sites: Sequence[Site], mode: str = "zero",
                 mean_cache: Any = None, refine: str = "none", replicas: int = 8) -> dict[str, dict[str, float]]:
    """`estimate_effects` of the model map's `units` (they carry their sites); `sites`: the map's token mixers."""
    if refine not in REFINES:
        raise ValueError(f"refine must be one of {REFINES}, got {refine!r}")
    extra, keep, patterns = (), (), []
    if refine == "qk":
        from analysis.ga.qk_fix import attention_patterns, resid_hooks

        patterns = attention_patterns(sites)
        extra, keep = [name for _, name in patterns], resid_hooks(model)
    placed = {u.module: u.placed() for u in units}
    att = site_attributions(model, scorer, [placed[p] for p in sorted(placed)], mode, mean_cache, extra, keep,
                            per_choice=refine != "none")
    fix = None
    if refine == "qk":
        from analysis.ga.qk_fix import qk_corrections

        fix = qk_corrections(model, scorer, units, att, _row_owner(scorer), patterns, mode, mean_cache, replicas)
    base = att["base_margin"]
    right_now = (base > 0).double().mean().item()
    out = {}
    for u in units:
        heads = list(u.heads)
        change = {key: att[key][u.module][:, heads].sum(-1) + (fix[u.label][key] if fix else 0.0)
                  for key in att["quantities"]}
        if refine == "none":
            d_margin, d_logprob = change["margin"], change["logprob"]
        else:
            d_margin, d_logprob = _choice_changes(att, torch.stack([change[k] for k in att["quantities"]], -1),
                                                  att["answers"])
        out[u.label] = {"est_drop": right_now - ((base + d_margin) > 0).double().mean().item(),
                        "est_logprob_drop": -d_logprob.mean().item(), "est_margin_drop": -d_margin.mean().item()}
    return out


def _choice_changes(att: dict[str, Any], d_scores: Tensor, answers: Tensor) -> tuple[Tensor, Tensor]:
    """Margin and answer log-prob changes [example] from estimated choice-score changes [example choice],
    exactly (the runner-up may change; the log-softmax over the choices is not linearised)."""
    margin, logprob = _margin_logprob(att["base_scores"] + d_scores, answers)  # -inf stays -inf for absent choices
    return margin - att["base_margin"], logprob - att["base_logprob"]


def _margin_logprob(scores: Tensor, answers: Tensor) -> tuple[Tensor, Tensor]:
    """Per example: answer score minus the best other choice's, and the answer's log-prob over the choices."""
    right = scores.gather(1, answers[:, None])[:, 0]
    others = scores.scatter(1, answers[:, None], float("-inf")).max(-1).values
    return right - others, scores.log_softmax(-1).gather(1, answers[:, None])[:, 0]
