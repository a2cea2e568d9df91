"""Where a loaded model's weights go, and in what dtype: `from_pretrained`'s placement keywords as one value.

    Placement(dtype=torch.bfloat16)                                   # one device, the CPU
    Placement(device="cuda")
    Placement(device_map="auto", max_memory={0: "10GiB", "cpu": "40GiB"}, offload_folder="offload")
    Placement(**keywords)     # an unknown keyword is a TypeError naming it

Fields (from_pretrained's docstring has the details):
    dtype           parameter dtype; None: the checkpoint's
    device          the one device of every weight (ignored with a device_map, which replaces it)
    device_map      spread the model over devices with accelerate (loaders/dispatch.py): a planner's
                    name or {module name: device}
    max_memory      {device: bytes or "10GiB"} for the planners
    offload_folder  where disk-offloaded weights are written
    mmap            file-backed parameters (safetensors on the CPU); None: on exactly when the load
                    is on the CPU without a device_map (`maps`)
Contradictions are refused when the Placement is made, before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loaders.checks import check_float_dtype


@dataclass(frozen=True)
class Placement:
    dtype: torch.dtype | None = None
    device: torch.device = torch.device("cpu")  # a str or an index is accepted and converted
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: Path | None = None
    mmap: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            check_float_dtype(self.dtype, "dtype")
        object.__setattr__(self, "device", torch.device(self.device))
        if self.offload_folder is not None:
            object.__setattr__(self, "offload_folder", Path(self.offload_folder))
        if self.device_map is None:
            given = [k for k in ("max_memory", "offload_folder") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{' and '.join(f'{k}=' for k in given)} only apply to a load with a device_map: "
                                 f"pass device_map= too")
        if self.mmap and (self.device_map is not None or self.device.type != "cpu"):
            where = f"device_map={self.device_map!r}" if self.device_map is not None else f"device={str(self.device)!r}"
            raise ValueError(f"mmap=True maps checkpoint files into CPU memory; it cannot be combined with {where} "
                             f"(load with mmap=False, or on device='cpu' without a device_map)")

    @property
    def maps(self) -> bool:
        """Whether parameters that need no conversion are file-backed (mmap, or its default)."""
        return self.mmap if self.mmap is not None else self.device_map is None and self.device.type == "cpu"
