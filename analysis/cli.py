"""The `hooked` console script: `hooked hooks MODEL`, `hooked parity MODEL [--out DIR]`, ...

Glossary
    MODEL       anything `loaders.from_pretrained` reads: an alias ("smollm2-135m"), a .gguf file, a
                checkpoint directory (config.json + safetensors), a hub repo id (from the cache)
    command     a function `run(args) -> int` registered with `@command(name, help, *arguments)`,
                where each `arg(...)` takes argparse's `add_argument` parameters and a `rule`
                (hooked.validate) for its value. Adding a subcommand is one function and its
                decorator; `main` builds the parser from COMMANDS, the one command table
    options     checked against their rules after parsing and before the command runs, so a bad
                value is refused before any model is loaded; an output directory (`WritableDir`)
                is created and proven writable last, once every other option passed
    parity row  one compared quantity: "embed", "resid_post {l}", "ln_final" (our
                ln_final.hook_normalized against HF's last hidden state, which is taken after the
                final norm), "logits". HF's hidden_states come in two layouts: attention models give
                [block 0 input, block 0..n-2 outputs, final norm]; the Mamba family
                (POST_BLOCK_HIDDEN_STATES) gives [block 0..n-1 outputs, final norm]
    rel diff    max |ours - HF| / max |HF| over the tensor, the maximum over prompts (DESIGN section 6)
    top-1       the argmax token; "agreement" counts positions where ours and HF's are the same

Exit status: 0 on success; `parity` returns 1 when a row exceeds --tol or a next token differs;
2 for a bad option or a model that cannot be loaded (the error is printed).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hooked.models.model_map import model_map
from analysis.validate import CommaInts, ExistingFile, WritableDir
from hooked.validate import Integer, Number, Rule, Seq, Text

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_PROMPTS = ["The capital of France is", "The Eiffel Tower is located in the city of",
                   "Memorize the following dictionary:\nlantern:42\norchid:7\nThe value of the key 'orchid' is"]
POST_BLOCK_HIDDEN_STATES = ("mamba", "falcon_mamba", "mamba2")  # HF model_types (transformers 5.24)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

Arg = tuple[tuple[str, ...], dict[str, Any], Rule | None]
COMMANDS: dict[str, tuple[str, tuple[Arg, ...], Callable[[Any], int]]] = {}


def arg(*flags: str, rule: Rule | None = None, **kwargs: Any) -> Arg:
    """One argument of a command, as `parser.add_argument(*flags, **kwargs)` takes it, and the rule its value obeys."""
    return flags, kwargs, rule


def command(name: str, help: str, *arguments: Arg):
    """Register `run(args) -> int` as the subcommand `name`."""

    def register(run: Callable[[Any], int]) -> Callable[[Any], int]:
        COMMANDS[name] = (help, arguments, run)
        return run

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hooked", description="Hook-everything language models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, arguments, run) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help, description=help)
        for flags, kwargs, _ in arguments:
            sub.add_argument(*flags, **kwargs)
        sub.set_defaults(run=run)
    return parser


def check_options(args: argparse.Namespace) -> None:
    """Every option of the command against its rule (values normalised in place); output directories last."""
    arguments = COMMANDS[args.command][1]
    ordered = sorted((a for a in arguments if a[2] is not None), key=lambda a: isinstance(a[2], WritableDir))
    for flags, kwargs, rule in ordered:
        dest = kwargs.get("dest") or flags[-1].lstrip("-").replace("-", "_")
        setattr(args, dest, rule.check(getattr(args, dest), flags[0]))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_options(args)
        with torch.no_grad():  # no command needs gradients; scoped, so in-process callers keep theirs
            return int(args.run(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"hooked {args.command}: error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------- shared
MODEL_ARG = arg("model", rule=Text(), help="alias (smollm2-135m), .gguf file, checkpoint directory or hub repo id")


def load(model: str, dtype: str | None = None) -> Any:
    from loaders import from_pretrained

    return from_pretrained(model, dtype=DTYPES[dtype] if dtype else None)


def prompt_tokens(model: Any, prompt: str, n_random: int = 8) -> Tensor:
    """[1 pos] token ids of `prompt`; without a tokenizer, `n_random` ids drawn from a seed of the prompt."""
    if model.tokenizer is not None:
        return model.to_tokens(prompt)
    g = torch.Generator().manual_seed(sum(map(ord, prompt)))
    return torch.randint(0, model.cfg.d_vocab, (1, n_random), generator=g)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


# ------------------------------------------------------------------------------------------ hooks
@command("hooks", "print every hook name with its shape on a short prompt", MODEL_ARG,
         arg("--prompt", default=DEFAULT_PROMPT, rule=Text(),
             help="text to run (random ids when the model has no tokenizer)"),
         arg("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: the checkpoint's)"))
def hooks_command(args: Any) -> int:
    model = load(args.model, args.dtype)
    tokens = prompt_tokens(model, args.prompt)
    rows = hook_shapes(model, tokens)
    print(markdown_table(["hook", "shape", "dtype"], rows))
    print(f"\n{len(rows)} hooks; input tokens {list(tokens.shape)}")
    return 0


def hook_shapes(model: Any, tokens: Tensor) -> list[tuple[str, str, str]]:
    """(name, shape, dtype) of every hook in forward order for `tokens`, from the hooks' declared
    axes (`model.hook_shape`): nothing is built, so lazy quantities of any size are listed too."""
    batch, pos = (1, tokens.shape[0]) if tokens.ndim == 1 else tuple(tokens.shape)
    p = next(model.parameters())
    dtypes = {"model": p.dtype, "wide": torch.promote_types(p.dtype, torch.float32), "int64": torch.int64}
    return [(name, str(list(point.shape(batch, pos))), str(dtypes[point.element]).removeprefix("torch."))
            for name, point in model.hook_dict.items()]


# ----------------------------------------------------------------------------------------- parity
@command("parity", "compare our logits and every layer's residual with Hugging Face's; save a table and a figure",
         MODEL_ARG,
         arg("--out", default="out/parity", rule=WritableDir(), help="output directory (default: out/parity)"),
         arg("--prompts", nargs="+", default=DEFAULT_PROMPTS, rule=Seq(Text()), help="prompts to run, one batch each"),
         arg("--tol", type=float, default=1e-3, rule=Number(ge=0),
             help="largest relative difference that passes (default 1e-3)"),
         arg("--revision", default=None, help="hub revision, for a repo id"))
def parity_command(args: Any) -> int:
    from loaders import from_pretrained
    from loaders.load import resolve_checkpoint

    source = resolve_checkpoint(args.model, revision=args.revision)
    ours = from_pretrained(source, dtype=torch.float32)
    hf = load_hf(source)
    batches = [prompt_tokens(ours, p) for p in args.prompts]
    rows, top1 = compare(ours, hf, batches)
    out = args.out
    header = ["quantity", "max abs diff", "max abs HF", "rel diff", f"<= {args.tol:g}"]
    table = [[q, f"{a:.3e}", f"{s:.3e}", f"{r:.3e}", "yes" if r <= args.tol else "NO"] for q, a, s, r in rows]
    with open(out / "parity.csv", "w", newline="") as f:
        csv.writer(f).writerows([header[:4]] + [[q, a, s, r] for q, a, s, r in rows])
    agree = sum(a for a, _, _ in top1) / sum(n for _, n, _ in top1)
    nexts = [f"{args.prompts[i]!r} -> ours {o!r}, HF {h!r}" for i, (_, _, (o, h)) in enumerate(top1)]
    text = (f"# Parity: {args.model}\n\nsource: {source}; float32; {len(batches)} prompts; "
            f"rel diff = max |ours - HF| / max |HF|\n\n{markdown_table(header, table)}\n\n"
            f"top-1 agreement over all positions: {agree:.4f}\n\nnext token:\n" + "\n".join(f"- {s}" for s in nexts))
    (out / "parity.md").write_text(text + "\n")
    figure = plot_mixing(ours, batches[0], out)
    print(text)
    print(f"\nwrote {out / 'parity.csv'}, {out / 'parity.md'}, {figure}")
    ok = all(r <= args.tol for *_, r in rows) and all(o == h for _, _, (o, h) in top1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def load_hf(source: Path) -> Any:
    """The HF model from the same checkpoint, float32, eager attention (GGUF through `gguf_file=`)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    location = source
    if source.is_file():
        location, kwargs["gguf_file"] = source.parent, source.name
    try:
        model = AutoModelForCausalLM.from_pretrained(str(location), attn_implementation="eager", **kwargs)
    except (ValueError, TypeError):  # a model without attention may refuse the argument
        model = AutoModelForCausalLM.from_pretrained(str(location), **kwargs)
    return model.eval()


def compare(ours: Any, hf: Any, batches: list[Tensor]) -> tuple[list[tuple[str, float, float, float]], list]:
    """Rows (quantity, max abs diff, max abs HF, rel diff) maxed over batches, and per batch
    (top-1 agreements, positions, (our next token, HF's next token))."""
    n = ours.cfg.n_layers
    if getattr(hf.config, "model_type", None) in POST_BLOCK_HIDDEN_STATES:
        layers, names, labels = range(n), [], []
    else:
        layers, names, labels = range(n - 1), ["blocks.0.hook_resid_pre"], ["embed"]
    names += [ours.blocks[l].hook_resid_post.name for l in layers] + ["ln_final.hook_normalized"]
    labels += [f"resid_post {l}" for l in layers] + ["ln_final", "logits"]
    worst: dict[str, list[float]] = {label: [0.0, 0.0, 0.0] for label in labels}
    top1 = []
    for tokens in batches:
        with torch.no_grad():
            out = hf(tokens, output_hidden_states=True)
            logits, cache = ours.run_with_cache(tokens, names_filter=names)
        theirs = list(out.hidden_states) + [out.logits]
        mine = [cache[name] for name in names] + [logits]
        if len(theirs) != len(mine):
            raise ValueError(f"HF returned {len(theirs) - 1} hidden states, expected {n + 1}")
        for label, a, b in zip(labels, mine, theirs):
            diff, scale = (a - b).abs().max().item(), b.abs().max().item()
            w = worst[label]
            w[:] = [max(w[0], diff), max(w[1], scale), max(w[2], diff / scale if scale else diff)]
        ids, hf_ids = logits.argmax(-1), out.logits.argmax(-1)
        nxt = (_decode(ours, ids[0, -1]), _decode(ours, hf_ids[0, -1]))
        top1.append((int((ids == hf_ids).sum()), ids.numel(), nxt))
    return [(label, *worst[label]) for label in labels], top1


def _decode(model: Any, token: Tensor) -> str:
    return model.tokenizer.decode([int(token)]) if model.tokenizer is not None else str(int(token))


def plot_mixing(model: Any, tokens: Tensor, out: Path) -> Path:
    """Save the middle layer's head-0 attention pattern (SSMs: channel 0's kernel, min-max normalised)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixings = [s.mixing() for s in model_map(model).mixers() if s.mixing() is not None]
    chosen = [m for m in mixings if not m.signed] or mixings  # hybrids: the attention
    if not chosen:
        raise ValueError("the model has no attention pattern or SSM kernel hook to plot")
    mixing = chosen[len(chosen) // 2]
    unit = "channel" if mixing.signed else "head"
    name = mixing.matrix.name
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[name])
    m = cache[name][0, 0].float()  # [q_pos k_pos]
    if mixing.signed:
        causal = torch.ones_like(m, dtype=torch.bool).tril()
        lo, hi = m[causal].min(), m[causal].max()
        m = torch.where(causal, (m - lo) / (hi - lo).clamp(min=1e-12), torch.nan)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m.numpy(), cmap="viridis")
    if model.tokenizer is not None and tokens.shape[1] <= 40:
        labels = [model.tokenizer.decode([int(t)]) for t in tokens[0]]
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("source (key) position")
    ax.set_ylabel("target (query) position")
    ax.set_title(f"{name}, {unit} 0" + (" (min-max normalised)" if mixing.signed else ""), fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = out / ("kernel.png" if mixing.signed else "pattern.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------------- knockout
@command("knockout", "information flow to the last token (knockout sweep over windows): analysis.info_flow",
         MODEL_ARG,
         arg("--facts", default=None, rule=ExistingFile(none=True),
             help="known_1000.json-style file (default: the shipped copy)"),
         arg("--n", type=int, default=None, rule=Integer(ge=1, none=True),
             help="keep at most N facts (the first N the model gets right)"),
         arg("--screen", type=int, default=None, rule=Integer(ge=1, none=True),
             help="consider only the first M facts of the file"),
         arg("--window", type=int, default=9, rule=Integer(ge=1), help="layers per window (default 9)"),
         arg("--out", default="out/knockout", rule=WritableDir(), help="output directory (JSON, CSV, markdown, PNG)"),
         arg("--batch-size", type=int, default=16, rule=Integer(ge=1), help="facts per forward (default 16)"),
         arg("--attention", choices=("scores", "pattern"), default="scores"),
         arg("--cut-conv", action="store_true", help="also cut the SSM conv taps (SSM models)"),
         arg("--relation-excludes-last", action="store_true", help="relation set without the last token"),
         arg("--all-facts", action="store_true", help="keep facts the model gets wrong too"),
         arg("--no-progress", action="store_true"))
def knockout_command(args: Any) -> int:
    from analysis.info_flow import info_flow, markdown_table
    from analysis.tasks.known_facts import load_facts
    from loaders import from_pretrained

    out = args.out
    model = from_pretrained(args.model)
    result = info_flow(model, load_facts(args.facts, args.screen), window=args.window, batch_size=args.batch_size,
                       n=args.n, require_correct=not args.all_facts, attention=args.attention,
                       cut_conv=args.cut_conv, relation_includes_last=not args.relation_excludes_last,
                       progress=not args.no_progress)
    result.settings["model"] = str(args.model)
    result.to_json(out / "info_flow.json")
    result.to_csv(out / "info_flow.csv")
    result.to_csv(out / "info_flow_facts.csv", per_fact=True)
    table = markdown_table(result)
    (out / "info_flow.md").write_text(table + "\n")
    result.plot(out / "info_flow.png", title=f"{args.model}: knockout to the last token, {len(result.facts)} facts")
    s = result.settings
    print(f"{s['n_kept']} facts kept of {s['n_screened']} screened ({s['n_skipped']} skipped); window {args.window}")
    print(table)
    print(f"wrote {out}/info_flow.{{json,csv,md,png}} and info_flow_facts.csv")
    return 0


# -------------------------------------------------------------------------------------------- ga
@command("ga", "Gather-and-Aggregate: KV-retrieval accuracy and head ranking: analysis.ga.report", MODEL_ARG,
         arg("--pairs", default="10,20,30", rule=CommaInts(Integer(ge=1)),
             help="dictionary sizes, comma-separated; the first is ranked"),
         arg("--n", type=int, default=50, rule=Integer(ge=1), help="prompts per size (default 50)"),
         arg("--rank-n", type=int, default=None, rule=Integer(ge=1, none=True),
             help="prompts for the head ranking (default --n)"),
         arg("--seed", type=int, default=0, rule=Integer(ge=0), help="prompt and control seed (>= 0)"),
         arg("--batch-size", type=int, default=16, rule=Integer(ge=1)),
         arg("--top-k", type=int, default=4, rule=Integer(ge=1), help="top units ablated in pairs (default 4)"),
         arg("--channel-group", type=int, default=None, rule=Integer(ge=1, none=True),
             help="Mamba-1 channels per unit (default d_inner/16)"),
         arg("--random-draws", type=int, default=5, rule=Integer(ge=1), help="random head pairs in the control (default 5)"),
         arg("--exhaustive", action="store_true", help="ablate every unit exactly (default: screened)"),
         arg("--verify-top", type=int, default=40, rule=Integer(ge=1),
             help="screened: candidates verified exactly, by each estimate (default 40: with --stage-n 6 "
                  "--stage-keep 12, 9/10 of the exhaustive top 10 on SmolLM2-135M, in a replay of every "
                  "unit's exact per-prompt scores and in the report itself)"),
         arg("--refine", default="none", choices=["none", "scores", "qk"],
             help="screened: the estimate's refinement (analysis.ga.screening; default none)"),
         arg("--controls", type=int, default=10, rule=Integer(ge=0),
             help="screened: random units verified exactly (default 10)"),
         arg("--stage-n", type=int, default=6, rule=Integer(ge=1),
             help="screened: verify the candidates on this many prompts first (those answered right "
                  "first), then only the --stage-keep best of them on all (default 6)"),
         arg("--one-stage", action="store_true", help="screened: verify every candidate on every prompt"),
         arg("--stage-keep", type=int, default=12, rule=Integer(ge=1),
             help="screened, staged: candidates verified on all prompts (default 12: the top 10 and two "
                  "more; a control that ranks above the last of them at stage 1 goes on too)"),
         arg("--replicas", type=int, default=None, rule=Integer(ge=1, none=True),
             help="units ablated per forward (default: the batching rule)"),
         arg("--out", default="out/ga", rule=WritableDir(), help="output directory"),
         arg("--no-progress", action="store_true"))
def ga_command(args: Any) -> int:
    from analysis.ga.report import ga_report, task_for
    from analysis.ga.settings import RankSettings
    from loaders import from_pretrained

    settings = RankSettings(
        method="exhaustive" if args.exhaustive else "screened", batch_size=args.batch_size, pairs_top_k=args.top_k,
        channel_group=args.channel_group, progress=not args.no_progress, verify_top=args.verify_top,
        n_control=args.controls, seed=args.seed, replicas=args.replicas, refine=args.refine,
        stage_n=None if args.one_stage else args.stage_n, stage_keep=args.stage_keep)
    model = from_pretrained(args.model)
    summary = ga_report(model, args.out, args.pairs, args.n, args.rank_n, task=task_for(args.model),
                        n_random=args.random_draws, settings=settings)
    print_ga_summary(summary, args.out)
    return 0


def print_ga_summary(summary: dict[str, Any], out: Path) -> None:
    for row in summary["sizes"]:
        print(f"n={row['pairs']:>3}  accuracy {row['accuracy']:.3f}  (chance {row['chance']:.3f})")
    for row in summary["top"][:5]:
        print(f"{row['unit']:>10}  drop {row['drop']:+.3f} [{row['drop_lo']:+.3f}, {row['drop_hi']:+.3f}]  "
              f"logprob drop {row['logprob_drop']:+.3f} [{row['logprob_drop_lo']:+.3f}, {row['logprob_drop_hi']:+.3f}]  "
              f"gather {row['gather']:.2f}  aggregate {row['aggregate']:.2f}")
    print(summary["separability_statement"])
    if summary["screen"].get("exhaustive"):
        print(f"exhaustive instead of screened: {summary['screen']['exhaustive']}")
    elif summary["screen"]:
        sc = summary["screen"]
        staged = (f"; {sc['n_stage1']} candidates first on prompts {sc['stage_prompts']}" if sc.get("n_stage1") else "")
        print(f"screened: {sc['n_verified']} of {sc['n_units']} units ablated exactly on every prompt ({sc['n_control']} "
              f"random controls; beating the screen's 10th unit: {', '.join(sc['control_misses']) or 'none'}{staged})")
    t = summary["timing"]["total"]
    print(f"time: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU")
    rho = summary["agreement"]
    print("Spearman(score, drop): " + ", ".join(f"{k} {'n/a' if v is None else f'{v:+.2f}'}" for k, v in rho.items()))
    c = summary["control"]
    r = c["random2"]
    print(f"top-2 ablated {c['top2']['accuracy']:.3f} vs random-2 {r['mean_accuracy']:.3f} "
          f"[{r['min_accuracy']:.3f}, {r['max_accuracy']:.3f}] over {len(r['draws'])} draws "
          f"(baseline {c['baseline']:.3f}); files in {out}")


# ---------------------------------------------------------------------------------------- circuit
@command("circuit", "edge circuits: EAP / EAP-IG scores of every edge, the top ones verified exactly; a figure "
         "and JSON: analysis.circuits", MODEL_ARG,
         arg("--task", choices=("kv", "facts"), default=None,
             help="kv: the organisms' key-value task (default for organisms); facts: known facts with the "
                  "subject swapped (default otherwise)"),
         arg("--corrupt", choices=("swap", "query"), default="swap",
             help="kv: swap the queried key with another pair's, or query another key (default swap)"),
         arg("--pairs", type=int, default=8, rule=Integer(ge=2), help="kv: pairs per prompt (default 8)"),
         arg("--n", type=int, default=16, rule=Integer(ge=1), help="clean / corrupt prompt pairs (default 16)"),
         arg("--method", choices=("eap", "eap-ig"), default="eap-ig"),
         arg("--steps", type=int, default=8, rule=Integer(ge=1), help="EAP-IG steps (default 8)"),
         arg("--top", type=int, default=20, rule=Integer(ge=1), help="edges drawn and verified (default 20)"),
         arg("--seed", type=int, default=0),
         arg("--batch-size", type=int, default=None, rule=Integer(ge=1, none=True),
             help="prompts per forward (default: all)"),
         arg("--out", default="out/circuit", rule=WritableDir(), help="output directory"))
def circuit_command(args: Any) -> int:
    from analysis.circuits import edge_attribution, faithfulness_curve
    from analysis.circuits.plot import draw_circuit
    from analysis.circuits.tasks import fact_pairs, kv_pairs
    from loaders import from_pretrained
    from loaders.organisms import accuracy, is_organism

    model = from_pretrained(args.model)
    task = args.task or ("kv" if is_organism(args.model) else "facts")
    if task == "kv":
        if not is_organism(args.model):
            raise ValueError("--task kv is the organisms' token task; use --task facts for a text model")
        fmt = accuracy(args.model)["fmt"]
        clean, corrupt, metric = kv_pairs(args.pairs, args.n, args.seed, fmt, args.corrupt)
        described = f"kv, n = {args.pairs} pairs, query {fmt!r}, corrupt by {args.corrupt}"
    else:
        clean, corrupt, metric, facts = fact_pairs(model, n=args.n)
        described = f"known facts, subject swapped ({len(facts)} pairs, e.g. {facts[0]['prompt']!r})"
    with torch.enable_grad():
        scores = edge_attribution(model, clean, corrupt, metric, method=args.method, steps=args.steps,
                                  batch_size=args.batch_size)
    top = scores.top(args.top)
    sizes = sorted({k for k in (1, 2, 5, 10, args.top, int(0.05 * len(scores))) if 1 <= k <= len(scores)})
    curve = faithfulness_curve(model, scores, clean, corrupt, metric, sizes, batch_size=args.batch_size)
    out = args.out
    scores.to_json(out / "scores.json")
    summary = {"model": str(args.model), "task": described, "method": args.method, "n_edges": len(scores),
               "clean_metric": scores.clean_metric, "corrupt_metric": scores.corrupt_metric,
               "top": [{"sender": e.sender, "receiver": e.receiver, "score": e.score} for e in top],
               "faithfulness": curve}
    (out / "circuit.json").write_text(json.dumps(summary, indent=1) + "\n")
    figure = draw_circuit(top, model.cfg.n_layers, out / "circuit.png",
                          f"{args.model}: top {len(top)} of {len(scores)} edges by {args.method} ({described})")
    print(f"{args.model}: {described}; metric clean {scores.clean_metric:.3f}, corrupt {scores.corrupt_metric:.3f}")
    print(markdown_table(["edge", "score"], [[str(e), f"{e.score:+.4f}"] for e in top]))
    print(markdown_table(["edges", "fraction", "faithfulness"],
                         [[r["n_edges"], f"{r['fraction']:.4f}", f"{r['faithfulness']:.3f}"] for r in curve]))
    print(f"wrote {out / 'scores.json'}, {out / 'circuit.json'}, {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
