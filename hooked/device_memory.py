"""Memory a new tensor can take on a device now: what the cache budget (cache_budget.py) is a fraction of.

Glossary
    free          CUDA: what the driver reports free on the device (torch.cuda.mem_get_info), which
                  leaves out memory torch's caching allocator holds
    reserved      CUDA: memory torch's allocator holds (torch.cuda.memory_reserved); of it,
                  `allocated` is in live tensors, and the rest (freed tensors' blocks) is reused by
                  the next allocation without asking the driver: available too
    host          CPU (and any device that is not CUDA): MemAvailable of /proc/meminfo, else the
                  free physical pages
    cache device  where run_with_cache puts the activations (its `device=`, else the model's): the
                  budget is that device's memory, so a cache sent to the CPU is checked against host
                  memory, not the GPU's
"""

from __future__ import annotations

import os

import torch


def host_available_bytes() -> int:
    """Host memory free for new allocations (MemAvailable, else free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def available_device_bytes(device: torch.device | str) -> int:
    """Bytes new tensors can take on `device` now: CUDA free + reserved-but-unused; host memory otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return host_available_bytes()
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(unused, 0))


def cache_device(model_device: torch.device, device: str | torch.device | None) -> torch.device:
    """Where a cache goes: run_with_cache's `device=` when given, else the model's device."""
    return torch.device(device) if device is not None else torch.device(model_device)
