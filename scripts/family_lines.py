"""Model file lines per family, as a markdown table (issue 41's note: at most 150 where the math is not new).

Glossary
    family        one family loader of loaders/registry.py's ARCHITECTURES (the one list of families), with
                  the architectures it serves (loaders/mamba.py: Mamba and FalconMamba)
    family file   hooked/models/<x>.py that the loader imports and that is no other family's family file
                  (loaders/mistral.py imports llama.py, Llama's, and mistral.py, Mistral's own)
    own modules   modules of hooked/ that the family files reach by imports (transitively, lazy imports
                  included) and that no other family reaches: the new math only this family uses (a new
                  mixer and its pure ops: recurrent_gemma reaches rg_lru.py and ops/rg_lru.py)
    lines         physical lines (`wc -l`); code: lines holding code, blank lines, comments and docstrings
                  left out
    loader        loaders/<x>.py (config mapping and key map), shown beside, not counted in the model

    python scripts/family_lines.py            # prints the table
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 150


def module_path(name: str) -> Path | None:
    """hooked/a/b.py (or its package's __init__.py) of a dotted module name under ROOT; None if not there."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imports_of(name: str) -> set[str]:
    """The hooked.* modules that module `name` imports anywhere in its body (functions' lazy imports too)."""
    tree = ast.parse(module_path(name).read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("hooked"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hooked"):
            for a in node.names:  # `from hooked.models import mamba2`: a submodule; else the module itself
                out.add(f"{node.module}.{a.name}" if module_path(f"{node.module}.{a.name}") else node.module)
    return {m for m in out if module_path(m) is not None}


def reach(starts: set[str]) -> set[str]:
    """Every hooked.* module imported, transitively, from `starts` (themselves included)."""
    seen, todo = set(), list(starts)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports_of(m) - seen)
    return seen


def lines(name: str) -> tuple[int, int]:
    """(physical lines, code lines) of a module: code lines leave out blank lines, comments and docstrings."""
    text = module_path(name).read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code.update(r for r in range(tok.start[0], tok.end[0] + 1) if r not in docstrings)
    return len(text.splitlines()), len(code)


def families() -> dict[str, list[str]]:
    """{loader module: names of the architectures it serves}, in the registry's order."""
    from loaders.registry import ARCHITECTURES

    out: dict[str, list[str]] = {}
    for arch in ARCHITECTURES:
        out.setdefault(arch.config_from_hf.__module__, []).append(arch.name)
    return out


def table() -> str:
    fams = families()
    imported = {loader: {m for m in imports_of(loader) if m.startswith("hooked.models.")} for loader in fams}
    own_file = {loader: f"hooked.models.{loader.split('.')[-1]}" for loader in fams}
    taken = {f for loader, f in own_file.items() if f in imported[loader]}
    files = {loader: sorted(m for m in imported[loader] if m == own_file[loader] or m not in taken) for loader in fams}
    reached = {loader: reach(set(fs)) for loader, fs in files.items()}
    users: dict[str, int] = defaultdict(int)
    for mods in reached.values():
        for m in mods:
            users[m] += 1
    rows = ["| family (architectures) | family file(s) | lines (code) | own modules: lines (code) | model total "
            "(code) | loader lines |", "|---|---|---|---|---|---|"]
    under = 0
    for loader, archs in fams.items():
        fam_lines = [lines(m) for m in files[loader]]
        own = sorted(m for m in reached[loader] if users[m] == 1 and m not in files[loader])
        own_lines = [lines(m) for m in own]
        phys = sum(p for p, _ in fam_lines)
        under += phys <= TARGET
        shown = ", ".join(f"{m.removeprefix('hooked.').replace('.', '/')}.py: {p} ({c})"
                          for m, (p, c) in zip(own, own_lines)) or "none"
        total = [sum(x) for x in zip(*fam_lines, *own_lines)]
        names = ", ".join(m.split(".")[-1] + ".py" for m in files[loader])
        mark = "" if phys <= TARGET else " *"
        code = sum(c for _, c in fam_lines)
        rows.append(f"| {loader.split('.')[-1]} ({', '.join(archs)}) | {names} | {phys} ({code}){mark} | {shown} | "
                    f"{total[0]} ({total[1]}) | {lines(loader)[0]} |")
    rows.append("")
    rows.append(f"{under} of {len(fams)} families' own files are at most {TARGET} lines (* marks the others); "
                "own modules are the hooked/ modules no other family reaches.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
