"""The import graph: no cycles anywhere, and the arrows of DESIGN.md section 1.

Every `import` / `from ... import` in hooked/, loaders/ and analysis/ counts, also those inside
functions (a lazy import still makes a cycle: it only hides it until run time). Importing
`a.b.c` runs `a/__init__` and `a/b/__init__` first, so those packages count as imported too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hooked", "loaders", "analysis")
# Where analysis may load a model by name (README, Layout): the CLI, and the G&A report's organism tasks.
MAY_IMPORT_LOADERS = {"analysis.cli", "analysis.ga.report"}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a module or a module.attribute) refers to."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules `module` imports (with the packages that importing them runs), itself excluded."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" for alias in node.names)
            targets.add(base)
    out = set()
    for target in targets:
        found = resolve(target, known)
        while found:
            if not module.startswith(found + ".") and found != module:  # our own packages run first anyway
                out.add(found)
            found = found.rpartition(".")[0]
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(edges, 0)
    for root in sorted(edges):
        if colour[root]:
            continue
        stack, path = [(root, iter(sorted(edges[root])))], [root]
        colour[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop(), path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif colour.get(child) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(edges[child])))), path.append(child)
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("edges, cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a.x"}, "a.x": {"b"}, "b": {"a.x"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
])
def test_the_cycle_finder_finds_cycles(edges, cyclic):
    assert (find_cycle(edges) is not None) == cyclic


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    edges = {m: imports(m, p, known) for m, p in known.items()}
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert find_cycle(edges) is not None


def test_design_arrows():
    """analysis -> hooked <- loaders: hooked imports neither; loaders never imports analysis;
    analysis imports loaders only where a model is loaded by name."""
    edges = graph()
    for module, targets in edges.items():
        top = {t.split(".")[0] for t in targets}
        if module.startswith("hooked"):
            assert not top & {"loaders", "analysis"}, f"{module} imports {sorted(top & {'loaders', 'analysis'})}"
        if module.startswith("loaders"):
            assert "analysis" not in top, f"{module} imports analysis"
        if module.startswith("analysis") and module not in MAY_IMPORT_LOADERS:
            assert "loaders" not in top, f"{module} imports loaders (only {sorted(MAY_IMPORT_LOADERS)} may)"
