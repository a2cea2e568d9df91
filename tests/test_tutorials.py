"""Every tutorial (percent-format .py notebook) runs start to finish."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parents[1] / "tutorials").glob("[0-9]*.py"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "HOOKED_TUTORIAL_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
