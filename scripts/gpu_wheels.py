"""The wheels a GPU box needs besides torch: list them, fetch them here, install them there (offline).

    python scripts/gpu_wheels.py freeze              # here: write scripts/gpu_requirements.txt from this env
    python scripts/gpu_wheels.py fetch [3.12 ...]    # here, with PyPI: download them into .whl/ per Python
    python scripts/gpu_wheels.py install             # there: install what is missing or older, from .whl/

Glossary
    roots         what the GPU tests and benchmarks import besides torch (ROOTS below); `freeze` walks
                  their dependencies in this environment, evaluating markers for each Python in
                  PYTHONS, and leaves out torch and torch's own dependencies (there wherever torch is)
    requirement   a line `name==version [exact] [3.10 ...]`: the version tested here; `exact`: this
                  version and no other (pyproject pins it); Python versions: needed only there (a
                  backport); a name without a version is one this environment lacks (a backport for
                  another Python), fetched at its newest
    install       for the running Python, each requirement that is missing, older than its pin, or (exact)
                  another version, is installed from the wheels with pip --no-index --no-deps into a
                  target folder put first on PYTHONPATH. What the box has already and is as new is kept
                  (the fewest wheels to carry and install)
Runs on Python 3.10-3.13 with nothing but the standard library and pip (its vendored `packaging`).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a box with pip only
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "gpu_requirements.txt"
ROOTS = ["transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "einops", "jaxtyping",
         "beartype", "pytest", "numpy", "tqdm", "gguf"]
EXACT = {"transformers"}  # pyproject pins it: the parity oracle's version
# fla's Triton kernels (the delta rules' and short convs' fast paths, hooked/ops/fla_kernels.py): pure-Python
# wheels, tested under Triton's interpreter in .venv-triton (scripts/setup_triton.sh), so not installed here:
# freeze writes these versions for them
ROOTS += ["flash-linear-attention", "fla-core"]
TESTED = {"flash-linear-attention": "0.6.0", "fla-core": "0.6.0"}
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def _env(python: str) -> dict:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", extra="")
    return env


def _closure(roots: list[str], python: str) -> dict[str, str | None]:
    """{name: version here or None} of `roots` and their dependencies, markers evaluated for `python`."""
    seen: dict[str, str | None] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            seen[name] = None
            continue
        seen[name] = dist.version
        for spec in dist.requires or []:
            dep = Requirement(spec)
            if dep.marker is None or dep.marker.evaluate(_env(python)):
                todo.append(dep)
    return seen


def freeze() -> None:
    torch_side = set(_closure(["torch"], f"{sys.version_info[0]}.{sys.version_info[1]}"))
    need: dict[str, tuple[str | None, list[str]]] = {}
    for python in PYTHONS:
        for name, version in _closure(ROOTS, python).items():
            version = version or TESTED.get(name)
            if name not in torch_side:
                need.setdefault(name, (version, []))[1].append(python)
    lines = ["# Wheels scripts/gpu_check.sh installs on a GPU box besides torch (scripts/gpu_wheels.py; do not edit:",
             "# run `python scripts/gpu_wheels.py freeze` in the tested environment). Format: the module docstring."]
    for name, (version, pythons) in sorted(need.items()):
        words = [f"{name}=={version}" if version else name]
        if name in EXACT:
            words.append("exact")
        if pythons != PYTHONS:
            words += pythons
        lines.append(" ".join(words))
    REQUIREMENTS.write_text("\n".join(lines) + "\n")
    print(f"{REQUIREMENTS}: {len(need)} requirements")


def requirements(python: str) -> list[tuple[str, str | None, bool]]:
    """[(name, pinned version or None, exact)] that `python` needs."""
    out = []
    for line in REQUIREMENTS.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, _, version = words[0].partition("==")
        pythons = [w for w in words[1:] if w != "exact"]
        if not pythons or python in pythons:
            out.append((name, version or None, "exact" in words[1:]))
    return out


def fetch(pythons: list[str], wheels: Path) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    for python in pythons:
        specs = [f"{name}=={version}" if version else name for name, version, _ in requirements(python)]
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python, "--implementation", "cp", *platforms, "-d", str(wheels), *specs],
                       check=True)
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    print(f"{wheels}: {len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB, for Python {' '.join(pythons)}")


def to_install(python: str) -> list[str]:
    """The requirements this interpreter lacks, has older, or (exact) has in another version."""
    todo = []
    for name, version, exact in requirements(python):
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None or version and (Version(have) < Version(version) or exact and Version(have) != Version(version)):
            todo.append(f"{name}=={version}" if version else name)
    return todo


def install(wheels: Path, target: Path) -> None:
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    todo = to_install(python)
    print(f"Python {python}: installing {len(todo)} of {len(requirements(python))} requirements into {target}: "
          f"{' '.join(todo) or 'nothing'}")
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--find-links", str(wheels), "--target", str(target), *todo],
                       check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("freeze")
    f = sub.add_parser("fetch")
    f.add_argument("pythons", nargs="*", default=["3.12"])
    f.add_argument("--wheels", type=Path, default=Path(".whl"))
    i = sub.add_parser("install")
    i.add_argument("--wheels", type=Path, default=Path(".whl"))
    i.add_argument("--target", type=Path, default=Path("/tmp/site"))
    args = ap.parse_args()
    if args.verb == "freeze":
        freeze()
    elif args.verb == "fetch":
        fetch(args.pythons, args.wheels)
    else:
        install(args.wheels, args.target)


if __name__ == "__main__":
    main()
