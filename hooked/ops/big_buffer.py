"""A large zero-filled CPU output tensor on transparent huge pages, where they pay.

Glossary
    page fault   the OS's work on the first write to each fresh page of memory (find a free
                 page, zero it, map it); on a VM, a 4 KiB page fault costs about as much as
                 writing the page ten times
    THP          transparent huge pages: Linux backs memory with 2 MiB pages, 512x fewer faults.
                 In its "madvise" mode (/sys/kernel/mm/transparent_hugepage/enabled, the default
                 of many distributions) only memory advised MADV_HUGEPAGE gets them
    reporting    free page reporting (a virtio balloon with feature bit 5): the VM hands free
                 2 MiB blocks back to its host about 2 s after they are freed; the next touch of
                 such a block makes the host fault it in again, 4 KiB at a time
    HUGE_PAGES   True: advise; False: torch.zeros; None (default): advise unless free pages
                 are reported to a host
    threshold    MIN_BYTES: below it, torch.zeros (faults are cheap next to the work)

Why: the whole SSM kernel (hook_kernel) is d_inner x pos^2 floats, 400 MB for one mamba-130m
layer at 256 tokens. Measured on a 2-core Firecracker VM (THP in madvise mode, free page
reporting on), first touch of 400 MB: torch.empty 0.25-0.34 s whatever came before; advised
for huge pages 0.02-0.13 s when a mapping of that size was freed less than ~1 s before, but
2-7 s otherwise (the host faults the reported blocks back in); reused heap memory 0.018 s.
Without reporting (bare metal, most VMs) a huge-page fault costs a 2 MiB memset, and advising
is the faster choice every time; with it, only back-to-back kernels gain, and a lone one can
lose seconds, so the default leaves such VMs on 4 KiB pages. torch's own allocator advises huge
pages for every CPU allocation of 2 MiB or more when THP_MEM_ALLOC_ENABLE=1 is in the
environment when it first allocates.

big_zeros maps anonymous memory (zero-filled by the OS: the caller need not write zeros), rounded
up to whole 2 MiB pages (so Linux can align it to huge pages), advises it MADV_HUGEPAGE and wraps
it with torch.frombuffer. The tensor's storage holds the only reference to the mapping: the memory
is unmapped when the tensor (and every view of it) is gone. The tensor is not resizable
(resize_ raises). Anywhere else (not CPU, below MIN_BYTES, huge pages not offered or not paying)
it is torch.zeros.
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
HUGE_PAGES: bool | None = None  # None: advise where huge pages are offered and free pages are not reported
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_BALLOONS = Path("/sys/bus/virtio/drivers/virtio_balloon")
_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING
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


@functools.cache
def free_pages_reported() -> bool:
    """True when a virtio balloon of this VM reports free pages to its host (module glossary)."""
    try:
        features = [(d / "features").read_text().strip() for d in _BALLOONS.glob("virtio*")]
    except OSError:
        return False
    return any(len(f) > _REPORTING_BIT and f[_REPORTING_BIT] == "1" for f in features)


def huge_pages_pay() -> bool:
    """Whether big_zeros advises huge pages: HUGE_PAGES, or by default where offered and not reported."""
    if HUGE_PAGES is not None:
        return HUGE_PAGES and thp_offered()
    return thp_offered() and not free_pages_reported()


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
    if device.type != "cpu" or nbytes < MIN_BYTES or not huge_pages_pay():
        return torch.zeros(shape, dtype=dtype, device=device)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapped = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapped.madvise(mmap.MADV_HUGEPAGE)
    _mapped[0] += length
    weakref.finalize(mapped, _unmapped, length)
    return torch.frombuffer(mapped, dtype=dtype, count=numel).view(shape)
