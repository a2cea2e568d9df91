"""Which branch of a hybrid aggregates on the KV task? Parallel (Falcon-H1: attention + Mamba-2 side by
side) or sequential (gdn-kv: a Gated DeltaNet layer, then an attention layer): a layer's branches are the
ones it has.

Glossary
    branch        a layer's attention (`blocks.{l}.attn`, its write `hook_attn_out`) or its mixer (Mamba-2,
                  the delta rule: `blocks.{l}.mixer`, `hook_mixer_out`); Falcon-H1 sums the two
    aggregate     the query's last token reading the queried pair's newline (the segment-final token
                  that gathered the pair); prompts `<bos> (k : v \\n) x n  k ?` (fmt "k?")
    read mass     at the query, attention: the pattern's weight on the queried newline; SSM: the
                  row-normalised |kernel| weight on it (per head, mean over prompts), and how often it
                  is the head's largest newline entry
    edge cut      the query's reads of every newline removed in ONE branch of one layer: attention by
                  zeroing those pattern entries, SSM by zeroing those kernel entries (exact: y += (K' - K) u);
                  context cut: the reads of every context token (bos .. last newline), at `?` or at the key
    roles         key, colon, value, newline of the queried pair: where the reading heads look

    python scripts/branch_report.py organism/falcon-h1-kv --n 8 --samples 300 --out docs/results/organisms/falcon_h1_kv
writes summary.json and prints the tables the report quotes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from analysis.ga import head_units, rank_heads
from analysis.tasks import token_kv


def accuracy_with(model: Any, p: token_kv.KVPrompts, hooks: list) -> float:
    from analysis.tasks.scoring import choice_scores, logits_of

    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        logits = logits_of(model, p.tokens)
    return token_kv.correct(choice_scores(logits, p.choices), p).float().mean().item()


def zero(t: torch.Tensor, hook: Any) -> torch.Tensor:
    return torch.zeros_like(t)


def cut_reads(newlines: torch.Tensor) -> Any:
    """Zero the last row's entries at the newline columns of a pattern or kernel [b h q k]."""
    def fn(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[..., -1, newlines] = 0
        return t
    return fn


ROLES = {"key": -3, "colon": -2, "value": -1, "newline": 0}  # offsets from each pair's newline


def read_mass(model: Any, p: token_kv.KVPrompts, row: int = -1) -> dict[str, dict[str, float]]:
    """Per head, at query row `row` (-1: the last token, -2: the queried key): the normalised |weight| on
    each role of the queried pair, and how often that role of the queried pair beats the same role of
    every other pair (top)."""
    nl = torch.tensor(p.pair_newlines())
    rows = torch.arange(p.tokens.shape[0])
    names = [n for n in model.hook_dict if n.endswith(("attn.hook_pattern", "mixer.hook_kernel"))]
    with torch.no_grad():
        _, cache = model.run_with_cache(p.tokens, names_filter=names)
    out = {}
    for name in names:
        w = cache[name][:, :, row, :].abs()  # [b h k]
        w = w / w.sum(-1, keepdim=True)
        prefix = name.rsplit(".", 1)[0]
        for h in range(w.shape[1]):
            entry = {}
            for role, off in ROLES.items():
                cols = nl + off
                entry[role] = w[rows, h, cols[p.answer]].mean().item()
                entry[f"top_{role}"] = (w[:, h, cols].argmax(-1) == p.answer).float().mean().item()
            out[f"{prefix}:{h}"] = entry
    return out


def cut_segment(model: Any, p: token_kv.KVPrompts, sites: list[str], row: int = -1) -> float:
    """Accuracy when the query row's reads of EVERY context token (bos to the last newline) are removed
    in `sites` (attention patterns / SSM kernels)."""
    last = p.pair_newlines()[-1]
    cols = torch.arange(0, last + 1)
    def fn(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[..., row, cols] = 0
        return t
    return accuracy_with(model, p, [(s, fn) for s in sites])


def has(model: Any, layer: int, branch: str) -> bool:
    return f"blocks.{layer}.hook_{branch}_out" in model.hook_dict


WEIGHTS = {"attn": "attn.hook_pattern", "mixer": "mixer.hook_kernel"}


def gather_cuts(model: Any, p: token_kv.KVPrompts) -> dict[str, float]:
    """Accuracy when every value token stops reading every key token (edges value_j <- key_i, i <= j) in
    layer 0: in the attention pattern only, the SSM kernel only, or both plus the conv taps (knockout)."""
    from analysis.interventions import knockout

    nl = torch.tensor(p.pair_newlines())
    values, keys = nl - 1, nl - 3
    def fn(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[..., values[:, None], keys[None, :]] = 0  # upper triangle is zero already
        return t
    batch, pos = p.tokens.shape
    tgt = torch.zeros(batch, pos, dtype=torch.bool)
    tgt[:, values] = True
    src = torch.zeros(batch, pos, dtype=torch.bool)
    src[:, keys] = True
    out = {f"L0 {b} {'pattern' if b == 'attn' else 'kernel'}": accuracy_with(model, p, [(f"blocks.0.{WEIGHTS[b]}", fn)])
           for b in ("attn", "mixer") if has(model, 0, b)}
    with knockout(model, src, tgt, [0], attention="pattern", cut_conv=True):
        out["L0 all + conv (knockout)"] = accuracy_with(model, p, [])
    with knockout(model, src, tgt, [0], attention="pattern", cut_conv=False):
        out["L0 all, no conv cut (knockout)"] = accuracy_with(model, p, [])
    return out


def write_read_cuts(model: Any, p: token_kv.KVPrompts, layer: int = 0) -> dict[str, float]:
    """Accuracy with knockout edges of one mixer layer cut: where a pair's key reaches the position that
    writes it (keys -> values / newlines, through the kernel only or the conv taps too) and where the
    query reads (the queried key -> `?`; the values / newlines -> `?`, kernel)."""
    from analysis.interventions import knockout

    nl = torch.tensor(p.pair_newlines())
    keys, values = nl - 3, nl - 1
    batch, pos = p.tokens.shape

    def mask(cols: Any) -> torch.Tensor:
        m = torch.zeros(batch, pos, dtype=torch.bool)
        m[:, cols] = True
        return m

    def cut(src: Any, tgt: Any, conv: bool) -> float:
        with knockout(model, mask(src), mask(tgt), [layer], cut_conv=conv):
            return accuracy_with(model, p, [])

    out = {}
    for what, tgt in (("values", values), ("newlines", nl), ("values and newlines", torch.cat([values, nl]))):
        out[f"keys -> {what}: kernel"] = cut(keys, tgt, False)
        out[f"keys -> {what}: kernel + conv taps"] = cut(keys, tgt, True)
    out["query key -> ?: kernel"] = cut([pos - 2], [pos - 1], False)
    out["query key -> ?: kernel + conv taps"] = cut([pos - 2], [pos - 1], True)
    for what, src in (("values", values), ("newlines", nl), ("values and newlines", torch.cat([values, nl]))):
        out[f"{what} -> ?: kernel"] = cut(src, [pos - 1], False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", default="organism/falcon-h1-kv", nargs="?")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--rank-samples", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from loaders import from_pretrained

    model = from_pretrained(a.model)
    p = token_kv.prompts(a.n, a.samples, seed=100 + a.n, fmt="k?")
    nl = torch.tensor(p.pair_newlines())
    n_layers = model.cfg.n_layers
    summary: dict[str, Any] = {"n": a.n, "samples": a.samples, "base": accuracy_with(model, p, [])}
    layers = {b: [l for l in range(n_layers) if has(model, l, b)] for b in ("attn", "mixer")}
    kinds = {"attn": "attention", "mixer": "mixers"}
    branches = {}
    for b, ls in layers.items():
        for l in ls:
            branches[f"L{l} {b}"] = accuracy_with(model, p, [(f"blocks.{l}.hook_{b}_out", zero)])
        branches[f"all {kinds[b]}"] = accuracy_with(model, p, [(f"blocks.{l}.hook_{b}_out", zero) for l in ls])
    summary["branch_ablation"] = branches
    cuts = {}
    for b, ls in layers.items():
        for l in ls:
            cuts[f"L{l} {b}"] = accuracy_with(model, p, [(f"blocks.{l}.{WEIGHTS[b]}", cut_reads(nl))])
        cuts[f"all {kinds[b]}"] = accuracy_with(model, p, [(f"blocks.{l}.{WEIGHTS[b]}", cut_reads(nl)) for l in ls])
    summary["query_reads_cut"] = cuts
    context = {}
    for b, ls in layers.items():
        for l in ls:
            for row, what in ((-1, "?"), (-2, "key")):
                context[f"L{l} {b} at {what}"] = cut_segment(model, p, [f"blocks.{l}.{WEIGHTS[b]}"], row)
        context[f"all {kinds[b]} at ?"] = cut_segment(model, p, [f"blocks.{l}.{WEIGHTS[b]}" for l in ls])
    summary["context_reads_cut"] = context
    summary["gather_cut"] = gather_cuts(model, p)
    if has(model, 0, "mixer"):
        summary["write_read_cuts"] = write_read_cuts(model, p)
    mass_prompts = token_kv.prompts(a.n, 200, seed=7, fmt="k?")
    summary["read_mass"] = read_mass(model, mass_prompts)
    summary["read_mass_at_key"] = read_mass(model, mass_prompts, row=-2)
    examples = token_kv.examples(a.n, a.rank_samples, seed=200 + a.n, fmt="k?")
    ranking = rank_heads(model, examples, head_units(model), progress=False, pairs_top_k=4)
    summary["ranking"] = ranking.rows
    summary["pairs"] = ranking.pairs
    for key in ("base", "branch_ablation", "query_reads_cut", "context_reads_cut", "gather_cut", "write_read_cuts"):
        if key in summary:
            print(key, json.dumps(summary[key], indent=1))
    for key in ("read_mass", "read_mass_at_key"):
        print(key)
        for unit, e in summary[key].items():
            print(f"  {unit:18s} " + " ".join(f"{r} {e[r]:.2f}/{e['top_' + r]:.2f}" for r in ROLES))
    print("ranking (top 8)", [(r["unit"], round(r["drop"], 3)) for r in ranking.rows[:8]])
    print("pairs", [(q["pair"], round(q["drop"], 3), round(q["single_drops"], 3)) for q in ranking.pairs])
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
