"""A large zero-filled CPU output tensor on transparent huge pages, where the OS offers them.

Glossary
    page fault   the OS's work on the first write to each fresh page of memory (find a free
                 page, zero it, map it); on a VM, a 4 KiB page fault costs about as much as
                 writing the page ten times
    THP          transparent huge pages: Linux backs memory with 2 MiB pages, 512x fewer faults.
                 In its "madvise" mode (/sys/kernel/mm/transparent_hugepage/enabled, the default
                 of many distributions) only memory advised MADV_HUGEPAGE gets them
    threshold    MIN_BYTES: below it, torch.zeros (faults are cheap next to the work)

Why: the whole SSM kernel (hook_kernel) is d_inner x pos^2 floats, 400 MB for one mamba-130m
layer at 256 tokens. Measured on a 2-core VM (THP in madvise mode): first-touching 400 MB from
torch.empty costs 0.20 s, the same memory advised for huge pages 0.024 s, reused memory 0.018 s.
torch's own allocator advises huge pages only when THP_MEM_ALLOC_ENABLE=1 is in the environment
when it first allocates (it then advises every CPU allocation of 2 MiB or more, not only ours).

big_zeros maps anonymous memory (zero-filled by the OS: the caller need not write zeros), rounded
up to whole 2 MiB pages (so Linux can align it to huge pages), advises it MADV_HUGEPAGE and wraps
it with torch.frombuffer. The tensor's storage holds the only reference to the mapping: the memory
is unmapped when the tensor (and every view of it) is gone. The tensor is not resizable
(resize_ raises). Anywhere else (not CPU, below MIN_BYTES, no MADV_HUGEPAGE, THP "never") it is
torch.zeros. Caveat: with THP defrag in madvise mode, a fault may first compact memory to find
a free huge page (seen once: 1.2 s for the very first 400 MB on a fragmented VM).
"""

import functools
import math
import mmap
import weakref
from pathlib import Path

import torch
from torch import Tensor

MIN_BYTES = 64 * 2**20  # below: torch.zeros
HUGE_PAGE = 2 * 2**20  # the mapping is rounded up to whole 2 MiB pages
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_mapped = [0]  # bytes of big_zeros mappings alive now


def mapped_bytes() -> int:
    """Bytes of big_zeros mappings alive now (peak-memory probes that read glibc's counters miss them)."""
    return _mapped[0]


def _unmapped(nbytes: int) -> None:
    _mapped[0] -= nbytes


@functools.cache
def thp_offered() -> bool:
    """True when this OS can give advised memory huge pages: Linux with THP in "always" or "madvise" mode."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def big_zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """torch.zeros(shape, dtype=dtype, device=device), on huge pages for a large CPU tensor (module docstring).

    Args:
        shape: the tensor's shape. dtype, device: as torch.zeros.
    Returns:
        a contiguous zero tensor of that shape; for a large CPU tensor, the only holder of its
        memory mapping (unmapped when the tensor and its views die), not resizable.
    """
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_BYTES or not thp_offered():
        return torch.zeros(shape, dtype=dtype, device=device)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapped = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapped.madvise(mmap.MADV_HUGEPAGE)
    _mapped[0] += length
    weakref.finalize(mapped, _unmapped, length)
    return torch.frombuffer(mapped, dtype=dtype, count=numel).view(shape)
