"""Memory available for a cache (hooked/device_memory.py) and which device's memory the budget reads.

CUDA is faked by monkeypatching torch.cuda's memory functions (no GPU here): available = free +
(reserved - allocated); a model "on cuda" caching to the CPU is checked against host memory, to
its own device against the GPU's (a fake that says the GPU is full refuses; the host accepts).
"""

from __future__ import annotations

import pytest
import torch

import hooked.device_memory as dm
from hooked.cache_budget import CACHE_BUDGET_FRACTION, CacheBudgetError, default_budget
from hooked.models.families import build
from hooked.models.language_model import LanguageModel
from hooked.models.mamba import MambaConfig

GiB = 2**30


def fake_cuda(monkeypatch, free: int, reserved: int, allocated: int) -> list:
    asked = []

    def mem_get_info(device=None):
        asked.append(torch.device(device))
        return free, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    return asked


@pytest.mark.parametrize("free, reserved, allocated, want", [
    (10 * GiB, 0, 0, 10 * GiB),
    (10 * GiB, 6 * GiB, 2 * GiB, 14 * GiB),  # 4 GiB freed by tensors, still held by torch: reusable
    (1 * GiB, 5 * GiB, 5 * GiB, 1 * GiB),  # everything torch holds is in use
    (1 * GiB, 2 * GiB, 3 * GiB, 1 * GiB),  # never less than the driver's free memory
])
def test_cuda_counts_free_and_reserved_but_unused(monkeypatch, free, reserved, allocated, want):
    asked = fake_cuda(monkeypatch, free, reserved, allocated)
    assert dm.available_device_bytes("cuda:1") == want
    assert asked == [torch.device("cuda", 1)]


def test_host_memory_is_meminfo_available(monkeypatch):
    fake_cuda(monkeypatch, 1, 0, 0)  # never read for the CPU
    got = dm.available_device_bytes("cpu")
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(got - kib * 1024) <= 256 * 2**20  # other processes move it a little
    assert dm.available_device_bytes(torch.device("cpu")) > 0


def _model() -> LanguageModel:
    return build(MambaConfig(n_layers=2, d_model=8, d_vocab=16, d_state=4)).eval()


def test_budget_follows_the_device_the_cache_goes_to(monkeypatch):
    model = _model()
    model.hook_dict  # the recording run (hook order) happens on the real device first
    monkeypatch.setattr(model, "_device", lambda: torch.device("cuda", 0))  # as if the model were on a GPU
    fake_cuda(monkeypatch, free=1000, reserved=0, allocated=0)  # the GPU is (nearly) full
    monkeypatch.setattr(dm, "host_available_bytes", lambda: 64 * GiB)
    assert default_budget(model) == int(CACHE_BUDGET_FRACTION * 1000)
    assert default_budget(model, "cpu") == int(CACHE_BUDGET_FRACTION * 64 * GiB)
    tokens = torch.randint(0, 16, (1, 12))
    with torch.no_grad():
        with pytest.raises(CacheBudgetError, match="over the budget"):
            model.run_with_cache(tokens, incl_lazy=True)  # to the model's device: the GPU's memory
        _, cache = model.run_with_cache(tokens, incl_lazy=True, device="cpu")  # to the host: fits
    assert "blocks.0.mixer.hook_h" in cache.keys()


def test_a_full_host_refuses_a_cache_sent_there(monkeypatch):
    model = _model()
    fake_cuda(monkeypatch, free=64 * GiB, reserved=0, allocated=0)
    monkeypatch.setattr(dm, "host_available_bytes", lambda: 1000)
    with torch.no_grad(), pytest.raises(CacheBudgetError, match="over the budget"):
        model.run_with_cache(torch.randint(0, 16, (1, 12)), incl_lazy=True, device="cpu")
