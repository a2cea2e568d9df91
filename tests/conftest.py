"""Shared test fixtures. Keep this generic: architecture-specific helpers live in their test files.

Fixtures
    tiny_hf          build a small random HF model from a config: seeded, eval mode, eager attention,
                     optionally every parameter perturbed (HF's init leaves norms at 1, biases at 0
                     and attention nearly uniform, which hides bugs), in a chosen dtype
    assert_rel_close compare two tensors within `rel` times the reference's max magnitude (two-sided)
    cuda             the CUDA device, or the test is skipped

Markers
    gpu              tests marked `@pytest.mark.gpu` are skipped when CUDA is not available
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def build_tiny_hf(config: Any, model_cls: Any = None, *, seed: int = 0, perturb: float = 0.0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    """A random HF causal LM for `config` (model class from the config unless given), eager attention.

    perturb: add `perturb * N(0, 1)` to every parameter after HF's initialisation.
    """
    import transformers

    torch.manual_seed(seed)
    if model_cls is None:
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    else:
        config._attn_implementation = "eager"
        hf = model_cls(config)
    hf = hf.eval()
    if perturb:
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(perturb * torch.randn_like(p))
    return hf.to(device=device, dtype=dtype)


@pytest.fixture(scope="session")
def organism() -> Callable[[str], Any]:
    """organism(name): the shipped organism loaded through our loader, once per test session."""
    from loaders import from_pretrained

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = from_pretrained(f"organism/{name}")
        return cache[name]

    return get


@pytest.fixture
def tiny_hf() -> Callable[..., Any]:
    return build_tiny_hf


def rel_close(actual: Tensor, expected: Tensor, rel: float, what: str = "") -> None:
    """|actual - expected| <= rel * max|expected| elementwise, compared in float64."""
    scale = expected.detach().abs().max().item()
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(), rtol=0,
                               atol=rel * scale, msg=lambda m: f"{what}: {m}" if what else m)


@pytest.fixture
def assert_rel_close() -> Callable[..., None]:
    return rel_close
