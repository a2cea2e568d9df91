"""The API reference builds offline from the docstrings with no warning (scripts/build_docs.py, as
scripts/docs.sh and CI run it), with the modules a user looks for and the tutorials beside it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("pdoc")
ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_builds_without_warnings(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    build_docs = importlib.util.module_from_spec(spec)
    sys.modules["build_docs"] = build_docs
    spec.loader.exec_module(build_docs)
    assert build_docs.build(tmp_path) == []
    knockout = (tmp_path / "analysis" / "interventions" / "knockout.html").read_text()
    assert 'id="knockout"' in knockout and "decay_split" in knockout  # the function, documented
    assert (tmp_path / "hooked" / "sae" / "splice.html").exists()
    start = (tmp_path / "start.html").read_text()
    assert "tutorials/01_hooks.py" in start and (tmp_path / "tutorials" / "01_hooks.py").exists()
