"""Information flow to the last token (Geva et al. 2023; Endy et al. 2025, "Mamba Knockout").

Glossary
    window      layers [l, l + window), clipped at the last layer, for every start layer l
    source set  subject / relation / last / first tokens of each fact (analysis.tasks.known_facts)
    target      the last token (position -1: rows are left-padded)
    p, p_ko     probability of the answer's first token at the last position, clean / knocked out
    change      100 * (p_ko - p) / p, the relative change in %, per fact, source set and window;
                reported as the mean over facts with a t-interval (95% by default); beside it the
                answer log-prob change log(p_ko / p) (nats) with its t-interval
    prefix reuse  blocks before the window are untouched by the knockout, so the clean residual
                entering block l (one cached clean run per batch) is the start of every window at l
    replicas    windows per forward: the rows are tiled once per window and each layer's knockout
                cuts only the rows whose window holds that layer (per-row source masks), so r windows
                cost one forward from the earliest of their starts (`tiles_for` is the rule; 1: one
                window per forward). Equal to one window per forward up to rounding (tests).

Only facts the model gets right are kept by default (top-1 next token = the answer's first token).
Every forward runs under no_grad, rows of several facts and all source sets share one batch (left
padding, per-row bool masks), and logits are computed at the last position only.
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from analysis.tasks.known_facts import SOURCE_SETS, FactPrompt, load_facts, pad_id, pad_left, prepare_facts, source_masks
from analysis.interventions.batching import tiles_for
from analysis.interventions.knockout import knockout, knockout_sites
from analysis.tasks.scoring import model_device
from analysis.intervals import mean_interval
from hooked.validate import layer_list
from hooked.validate import Flag, Integer, OneOf, Number, Seq, checked


# ----------------------------------------------------------------------------------- results
@dataclass
class InfoFlowResult:
    """changes[f, s, w]: % change of fact f's answer probability, source set s, window w."""

    window: int
    sources: tuple[str, ...]
    starts: list[int]  # first layer of each window
    ends: list[int]  # one past its last layer
    facts: list[dict[str, Any]]  # kept facts with their clean probability p_clean
    changes: Tensor  # [n_facts n_sources n_windows], %
    settings: dict[str, Any] = field(default_factory=dict)
    confidence: float = 0.95

    def summary(self) -> list[dict[str, Any]]:
        """One row per (source set, window): mean change and its t-interval over facts."""
        rows = []
        n = self.changes.shape[0]
        for s, name in enumerate(self.sources):
            for w, (start, end) in enumerate(zip(self.starts, self.ends)):
                mean, lo, hi = mean_interval(self.changes[:, s, w], self.confidence)
                # the continuous metric beside it: answer log-prob change log(p_ko / p), in nats
                logp = torch.log((1 + self.changes[:, s, w] / 100).clamp(min=1e-12))
                lp_mean, lp_lo, lp_hi = mean_interval(logp, self.confidence)
                rows.append({"source": name, "window_start": start, "window_end": end, "mean": mean,
                             "ci_low": lo, "ci_high": hi, "logprob_change": lp_mean, "logprob_ci_low": lp_lo,
                             "logprob_ci_high": lp_hi, "n": n})
        return rows

    def to_json(self, path: str | Path) -> None:
        data = {"window": self.window, "sources": list(self.sources), "starts": self.starts, "ends": self.ends,
                "confidence": self.confidence, "settings": self.settings, "summary": self.summary(),
                "facts": [{**f, "changes": {name: self.changes[i, s].tolist() for s, name in enumerate(self.sources)}}
                          for i, f in enumerate(self.facts)]}
        Path(path).write_text(json.dumps(data, indent=1))

    def to_csv(self, path: str | Path, per_fact: bool = False) -> None:
        """The summary table, or (per_fact) one row per fact, source set and window."""
        if per_fact:
            rows = [{"known_id": f.get("known_id", i), "subject": f["subject"], "attribute": f["attribute"],
                     "p_clean": f["p_clean"], "source": name, "window_start": start, "window_end": end,
                     "change": float(self.changes[i, s, w])}
                    for i, f in enumerate(self.facts) for s, name in enumerate(self.sources)
                    for w, (start, end) in enumerate(zip(self.starts, self.ends))]
        else:
            rows = self.summary()
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["source"])
            writer.writeheader()
            writer.writerows(rows)

    def plot(self, path: str | Path | None = None, ax: Any = None, title: str | None = None) -> Any:
        return plot_info_flow(self, path, ax, title)


def plot_info_flow(result: InfoFlowResult, path: str | Path | None = None, ax: Any = None,
                   title: str | None = None) -> Any:
    """One line per source set over the window start, shaded t-interval (the paper's figure)."""
    import matplotlib

    if ax is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = (plt.subplots(figsize=(6, 3.5)) if ax is None else (ax.figure, ax))
    rows = result.summary()
    for name in result.sources:
        mine = [r for r in rows if r["source"] == name]
        x = [r["window_start"] for r in mine]
        ax.plot(x, [r["mean"] for r in mine], marker="o", ms=3, label=name)
        ax.fill_between(x, [r["ci_low"] for r in mine], [r["ci_high"] for r in mine], alpha=0.2)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel(f"window start layer (window of {result.window} layers)")
    ax.set_ylabel("change in p(answer) (%)")
    ax.set_title(title or f"Knockout to the last token, {result.changes.shape[0]} facts")
    ax.legend(title="source")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig


# --------------------------------------------------------------------------------- forwards
def _device(model: Any) -> torch.device:
    return model_device(model)


def _last_probs(model: Any, resid: Tensor) -> Tensor:
    """Next-token probabilities at the last position from the final residual [batch pos d_model]."""
    logits = model.unembed(model.ln_final(resid[:, -1:]))[:, 0]
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def _clean_run(model: Any, tokens: Tensor, mask: Tensor, keep_prefix: bool) -> tuple[Tensor, dict[int, Tensor]]:
    """Clean last-token probabilities and, when asked, the residual entering every block."""
    n = model.cfg.n_layers
    if not keep_prefix:
        return _last_probs(model, model(tokens, attention_mask=mask, stop_at_layer=n)), {}
    names = [b.hook_resid_pre.name for b in model.blocks]
    resid, cache = model.run_with_cache(tokens, attention_mask=mask, stop_at_layer=n, names_filter=names)
    return _last_probs(model, resid), {l: cache[names[l]] for l in range(n)}


@torch.no_grad()
def screen(model: Any, prompts: Sequence[FactPrompt], n: int | None = None, batch_size: int = 32,
           require_correct: bool = True, progress: bool = True) -> tuple[list[tuple[FactPrompt, float]], int]:
    """((prompt, clean answer probability) of the first `n` facts kept, in order; how many were run).

    Kept = the top-1 next token is the answer's first token (when require_correct)."""
    kept: list[tuple[FactPrompt, float]] = []
    pad, device = pad_id(model.tokenizer), _device(model)
    bar = tqdm(total=len(prompts), desc="screening facts", disable=not progress)
    n_run = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        tokens, mask = pad_left([fp.ids for fp in chunk], pad, device)
        probs = _clean_run(model, tokens, mask, keep_prefix=False)[0]
        for fp, p in zip(chunk, probs):
            if not require_correct or int(p.argmax()) == fp.answer:
                kept.append((fp, float(p[fp.answer])))
        bar.update(len(chunk))
        n_run += len(chunk)
        if n is not None and len(kept) >= n:
            break
    bar.close()
    return (kept[:n] if n is not None else kept), n_run


# ----------------------------------------------------------------------------------- sweep
@torch.no_grad()
@checked(window=Integer(ge=1), sources=Seq(OneOf(*SOURCE_SETS)), relation_includes_last=Flag(), batch_size=Integer(ge=1),
         n=Integer(ge=1, none=True), require_correct=Flag(), attention=OneOf("scores", "pattern"), cut_conv=Flag(),
         reuse_prefix=Flag(), confidence=Number(gt=0, lt=1), progress=Flag(), replicas=Integer(ge=1, none=True))
def info_flow(model: Any, facts: Iterable[dict[str, Any]] | str | Path | None = None, window: int = 9,
              sources: Sequence[str] = SOURCE_SETS, relation_includes_last: bool = True, batch_size: int = 16,
              n: int | None = None, require_correct: bool = True, attention: str = "scores",
              channels: Any = None, cut_conv: bool = False, reuse_prefix: bool = True,
              confidence: float = 0.95, starts: Iterable[int] | None = None,
              progress: bool = True, replicas: int | None = None) -> InfoFlowResult:
    """Knock out each source set -> last token in every window of `window` layers; see the module doc.

    Args:
        facts: fact dicts, a path to a known_1000.json-style file, or None (the shipped copy).
        n: keep at most this many facts (after the correctness screen); None keeps all.
        batch_size: facts per forward (each contributes one row per source set).
        attention, channels, cut_conv: passed to knockout.
        reuse_prefix: start each window's forward from the cached clean residual at its first layer.
        starts: window start layers to run (default: every layer).
        replicas: windows per forward (None: the rule `tiles_for`; 1: one window per forward).
        confidence: of the t-intervals over facts, in (0, 1).
    """
    n_layers = model.cfg.n_layers
    starts = list(range(n_layers)) if starts is None else layer_list(starts, n_layers, "starts")
    model._need_tokenizer()
    if channels is not None and not any(knockout_sites(model, layer)[1] for layer in range(n_layers)):
        raise ValueError("info_flow: channels restricts the cut of SSM mixers, and the model has none (attention "
                         "always cuts every head): drop channels")
    if facts is None or isinstance(facts, (str, Path)):
        facts = load_facts(facts)
    prompts, skipped = prepare_facts(model.tokenizer, facts)
    kept, n_screened = screen(model, prompts, n, max(batch_size * len(sources), 1), require_correct, progress)
    if not kept:
        raise ValueError(f"no fact kept: {n_screened} screened, none the model gets right"
                         + (" (pass require_correct=False / --all-facts to keep them)" if require_correct else ""))
    ends = [min(l + window, n_layers) for l in starts]
    order = sorted(range(len(kept)), key=lambda i: len(kept[i][0]))  # similar lengths pad less
    changes = torch.zeros(len(kept), len(sources), len(starts), dtype=torch.float64)
    p_clean = torch.zeros(len(kept), dtype=torch.float64)
    pad, device = pad_id(model.tokenizer), _device(model)
    bar = tqdm(total=len(kept) * len(starts), desc="knockout windows", unit="fact-window", disable=not progress)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0: b0 + batch_size]
        chunk = [kept[i][0] for i in idx]
        tokens, mask = pad_left([fp.ids for fp in chunk], pad, device)
        answers = torch.tensor([fp.answer for fp in chunk], device=device)
        probs, prefix = _clean_run(model, tokens, mask, keep_prefix=reuse_prefix)
        clean = probs.gather(1, answers[:, None])[:, 0].double()
        p_clean[idx] = clean.cpu()
        rows = len(sources)
        src = torch.cat([source_masks(chunk, s, tokens.shape[1], relation_includes_last) for s in sources]).to(device)
        tokens_r, mask_r, answers_r = tokens.repeat(rows, 1), mask.repeat(rows, 1), answers.repeat(rows)
        r = replicas or tiles_for(model, len(tokens_r), tokens.shape[1])
        for w0 in range(0, len(starts), r):
            group = list(range(w0, min(w0 + r, len(starts))))
            k, lo, hi = len(group), min(starts[w] for w in group), max(ends[w] for w in group)
            with contextlib.ExitStack() as stack:
                for layer in range(lo, hi):  # each layer cuts the rows whose window holds it
                    per_row = torch.cat([src if starts[w] <= layer < ends[w] else torch.zeros_like(src)
                                         for w in group])
                    if per_row.any():
                        stack.enter_context(knockout(model, per_row, [-1], [layer], channels=_layer_channels(
                            model, channels, layer), attention=attention, cut_conv=cut_conv))
                if reuse_prefix:
                    resid = model(prefix[lo].repeat(rows * k, 1, 1), attention_mask=mask_r.repeat(k, 1),
                                  start_at_layer=lo, stop_at_layer=n_layers, tokens=tokens_r.repeat(k, 1))
                else:
                    resid = model(tokens_r.repeat(k, 1), attention_mask=mask_r.repeat(k, 1), stop_at_layer=n_layers)
            p_ko = _last_probs(model, resid).gather(1, answers_r.repeat(k)[:, None])[:, 0].double()
            change = 100 * (p_ko.view(k, rows, len(chunk)) - clean) / clean
            for j, w in enumerate(group):
                changes[idx, :, w] = change[j].T.cpu()
            bar.update(len(chunk) * k)
    bar.close()
    fact_rows = [{**{k: kept[i][0].fact.get(k) for k in ("known_id", "subject", "attribute", "prompt")},
                  "p_clean": float(p_clean[i])} for i in range(len(kept))]
    settings = {"model": getattr(model.cfg, "name", getattr(model, "family", type(model).__name__)), "attention": attention,
                "cut_conv": cut_conv, "relation_includes_last": relation_includes_last,
                "require_correct": require_correct, "n_facts_given": len(prompts) + len(skipped), "n_screened": n_screened,
                "n_skipped": len(skipped), "n_kept": len(kept),
                "channels": None if channels is None else str(channels)}
    return InfoFlowResult(window, tuple(sources), starts, ends, fact_rows, changes, settings, confidence)


def _layer_channels(model: Any, channels: Any, layer: int) -> Any:
    """What knockout gets for one layer: the channels (or the layer's entry of a {layer: channels} dict)
    where the layer has an SSM mixer, None where it has none (attention is cut whole)."""
    if channels is None or not knockout_sites(model, layer)[1]:
        return None
    if isinstance(channels, dict):
        if layer not in channels:
            raise ValueError(f"info_flow: channels has no entry for layer {layer} (its keys: {sorted(channels)})")
        return channels[layer]
    return channels


def markdown_table(result: InfoFlowResult) -> str:
    """Window start down, source sets across: 'mean [low, high]' in %."""
    rows = {(r["source"], r["window_start"]): r for r in result.summary()}
    lines = ["| window | " + " | ".join(result.sources) + " |", "|---" * (len(result.sources) + 1) + "|"]
    for start, end in zip(result.starts, result.ends):
        cells = [f"{rows[s, start]['mean']:+.1f} [{rows[s, start]['ci_low']:+.1f}, {rows[s, start]['ci_high']:+.1f}]"
                 for s in result.sources]
        lines.append(f"| {start}-{end - 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
