"""Build the API reference (pdoc) of hooked, loaders and analysis into site/, offline, with the
tutorials beside it; exit 1 on any warning pdoc raises (a module that fails to import, a broken
reference, ...). Run by scripts/docs.sh and by tests/test_docs.py."""

from __future__ import annotations

import re
import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["hooked", "loaders", "analysis"]


def build(out: Path) -> list[str]:
    """Write the site into `out`; return the warnings (empty when the build is clean)."""
    import pdoc
    import pdoc.render

    sys.path.insert(0, str(ROOT))
    out.mkdir(parents=True, exist_ok=True)
    pdoc.render.configure(docformat="google", show_source=True, search=True,
                          footer_text="hooked: tutorials in tutorials/ (copied beside this reference)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*PACKAGES, output_directory=out)
    tutorials = out / "tutorials"
    tutorials.mkdir(exist_ok=True)
    for path in sorted((ROOT / "tutorials").glob("[0-9]*.py")):
        shutil.copy(path, tutorials / path.name)
    links = "\n".join(f'<li><a href="tutorials/{p.name}">{p.stem}</a></li>' for p in sorted(tutorials.glob("*.py")))
    packages = "\n".join(f'<li><a href="{p}.html">{p}</a></li>' for p in PACKAGES)
    (out / "start.html").write_text(f"<!doctype html><title>hooked</title><h1>hooked: API reference</h1>"
                                    f"<ul>{packages}</ul><h2>Tutorials</h2><ul>{links}</ul>\n")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if ("pdoc" in w.filename or "pdoc" in str(w.message)) and not GENERATED_INIT.search(str(w.message))]


# pdoc reads the annotations of a dataclass's or NamedTuple's generated __init__ in the namespace of
# the module that generated it (dataclasses / collections), where the class's own module's names
# (Any, Tensor) are unknown: a limit of pdoc on generated code, not a reference of ours. The fields
# themselves are documented with their annotations resolved.
GENERATED_INIT = re.compile(r"Error parsing type annotation .* for [\w.]+\.__init__\. Import of \w+ failed")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "site"
    problems = build(target)
    for p in problems:
        print("warning:", p, file=sys.stderr)
    print(f"API reference in {target}/ ({'clean' if not problems else f'{len(problems)} warnings'})")
    sys.exit(1 if problems else 0)
