"""Models bigger than one device: plan a device map with accelerate, read each tensor once onto its device, dispatch.

Glossary
    device map    {module name: device}, the accelerate / transformers format: a GPU index (0, 1, ...) or
                  "cuda:i", "cpu", or "disk". "auto" / "balanced" / "balanced_low_0" / "sequential" ask
                  accelerate's `infer_auto_device_map` for one, on our meta-built model, with `max_memory`
    unit          a module the plan never splits across devices: every block class (`model.blocks`),
                  so a block's hooks, weights and activations share one device
    main device   where the input enters, and where offloaded modules run: the first GPU of the map, else cpu
    resident      a module whose weights stay on its device
    offloaded     "disk", and "cpu" when the main device is a GPU: the weights live elsewhere (our offload
                  file, the checkpoint itself, or a CPU state dict), accelerate's hook brings a whole
                  block to the main device for its forward and drops it (to meta) after
    tie group     modules that hold one tensor: tied embeddings (one Parameter, or an Unembed that borrows
                  the embedding's `weight`) and Zamba2's shared blocks (one nn.Linear in every
                  invocation). A group gets one device, the first of its members' in the map. A module
                  that lends its weight to another's forward (a tied Unembed reads the embedding's) may be
                  offloaded with it: the borrower's forward then onloads the lender's weight first and
                  drops it after (`_lend`), as accelerate's tied offload reads one stored tensor for both
    offload index accelerate's {parameter name (every alias of a shared one): where to read it}: the
                  checkpoint's own safetensors file when the tensor needs no conversion (no copy at
                  all), else `offload.safetensors` in `offload_folder`, written here tensor by tensor

Each checkpoint tensor is read once: into its resident parameter (`load.copy_weights`, passed in as
`fill`, straight from the file on CPU), or into the offload file; peak memory is the resident part
plus one tensor. Reading a parameter outside a forward (decay norms, weight properties) on an offloaded module needs
`hooked.devices.onloaded`, which runs accelerate's hook around the read.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

DeviceMap = dict[str, Any]
Fill = Callable[[Any, dict, Any, Any], None]  # loaders.load.copy_weights
PLANNERS = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOAD_FILE = "offload.safetensors"


# ------------------------------------------------------------------------------------------- plan
def unit_classes(model: nn.Module) -> list[str]:
    """Class names the plan never splits: the model's block classes."""
    return sorted({type(b).__name__ for b in model.blocks})


def plan_device_map(model: nn.Module, device_map: str | DeviceMap, *, max_memory: dict | None = None,
                    dtype: torch.dtype | None = None) -> DeviceMap:
    """A device map for `model` (built on meta): a planner's name, or a dict checked and completed.

    Tie groups get one device (a planner's map: the first member's; a dict: it must agree already).
    Raises ValueError for an unknown planner, or a dict that leaves parameters out or splits a tie group.
    """
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    units = unit_classes(model)
    if isinstance(device_map, str):
        if device_map not in PLANNERS:
            raise ValueError(f"device_map={device_map!r}: expected one of {', '.join(PLANNERS)} or a dict")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory, no_split_module_classes=units, dtype=dtype,
                                             low_zero=device_map == "balanced_low_0")
        with _untied(model):  # accelerate's tie handling matches names by substring ("embed." in "unembed.")
            planned = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=units, dtype=dtype)
        return _tie(model, {k: _normalise(v) for k, v in planned.items()}, strict=False)
    if not isinstance(device_map, dict):
        raise TypeError(f"device_map must be a str or a dict, got {type(device_map).__name__}")
    devices = {k: _normalise(v, f"device_map[{k!r}]") for k, v in device_map.items()}
    _check_known(model, devices)
    _check_covers(model, devices)
    return _tie(model, devices, strict=True)


@contextlib.contextmanager
def _untied(model: nn.Module) -> Iterator[None]:
    """Inside, every module but the first holding a shared Parameter holds a meta stand-in of its own
    (the planner then counts each holder's size; `_tie` joins the holders afterwards)."""
    seen: set[int] = set()
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for m in model.modules():  # each module once: a module shared whole (Zamba2's projections) is left alone
        for n, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:
                swapped.append((m, n, p))
                m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
            seen.add(id(p))
    try:
        yield
    finally:
        for m, n, p in reversed(swapped):
            m._parameters[n] = p


def _normalise(device: Any, what: str = "device_map") -> Any:
    """0 / "cuda:0" / torch.device("cuda", 0) -> 0; "cpu", "disk" kept; anything else refused by name
    (mps, meta, a GPU this machine does not have, a negative index, a bool)."""
    if isinstance(device, str) and device in ("cpu", "disk"):
        return device
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise ValueError(f"{what}={device!r}: expected a GPU index, 'cuda:i', 'cpu' or 'disk'")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what}={device!r}: unknown device (use a GPU index, 'cuda:i', 'cpu' or 'disk')") from None
    if d.type == "cpu":
        return "cpu"
    if d.type != "cuda":
        raise ValueError(f"{what}={device!r}: device maps place modules on CUDA GPUs, 'cpu' or 'disk' "
                         f"(accelerate's dispatch), not on {d.type!r}")
    index = d.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"{what}={device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return index


def check_placement(device_map: Any, max_memory: Any, offload_folder: Any) -> None:
    """from_pretrained's placement arguments, checked before anything is read: max_memory and
    offload_folder only with a device_map (without one they would be ignored), max_memory only with a
    planner's name (a dict places every module itself), each max_memory entry a device and bytes >= 0."""
    if device_map is None:
        given = [n for n, v in (("max_memory", max_memory), ("offload_folder", offload_folder)) if v is not None]
        if given:
            names = " and ".join(f"{n}={v!r}" for n, v in (("max_memory", max_memory),
                                                              ("offload_folder", offload_folder)) if v is not None)
            raise ValueError(f"from_pretrained: {names}: only used with device_map=, and ignored without one "
                             f"(pass device_map='auto', or drop {' and '.join(given)})")
        return
    if isinstance(device_map, str):
        if device_map not in PLANNERS:
            raise ValueError(f"device_map={device_map!r}: expected one of {', '.join(PLANNERS)} or a dict")
    elif isinstance(device_map, dict):
        for key, value in device_map.items():
            if not isinstance(key, str):
                raise ValueError(f"device_map key {key!r}: expected a module name (a str; '' for the whole model)")
            _normalise(value, f"device_map[{key!r}]")
        if max_memory is not None:
            raise ValueError("max_memory is read by the planners (device_map='auto', 'balanced', ...); a dict "
                             "device_map places every module itself: drop max_memory")
    else:
        raise TypeError(f"device_map must be a str or a dict, got {type(device_map).__name__}")
    if max_memory is not None:
        if not isinstance(max_memory, dict) or not max_memory:
            raise ValueError(f"max_memory={max_memory!r}: expected a dict {{device: bytes or '10GiB'}}")
        for key, value in max_memory.items():
            _normalise(key, f"max_memory key {key!r}")
            memory_bytes(value, f"max_memory[{key!r}]")
    if offload_folder is not None and not isinstance(offload_folder, (str, Path)):
        raise TypeError(f"offload_folder must be a path, got {type(offload_folder).__name__}")


def memory_bytes(value: Any, what: str) -> int:
    """Bytes from an int >= 0 or a size string ("10GiB", "500MB"), refused by name otherwise."""
    if isinstance(value, str):
        from accelerate.utils import convert_file_size_to_int

        try:
            n = convert_file_size_to_int(value)
        except ValueError:
            n = None
        if n is None or n < 0:
            raise ValueError(f"{what}={value!r}: expected bytes >= 0 or a size like '10GiB'")
        return int(n)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}={value!r}: expected bytes >= 0 (an int) or a size like '10GiB'")
    return value


def _check_known(model: nn.Module, devices: DeviceMap) -> None:
    """Every key of a dict map names the model, one of its modules or one of its parameters."""
    import difflib

    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    unknown = [k for k in devices if k not in names]
    if unknown:
        hints = {k: difflib.get_close_matches(k, names, n=2) for k in unknown}
        listed = "; ".join(f"{k!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "")
                           for k, h in hints.items())
        raise ValueError(f"device_map names no module of the model: {listed}")


def entry_of(name: str, devices: DeviceMap) -> str | None:
    """The device-map entry that holds module or parameter `name` (its longest prefix in the map)."""
    best = None
    for key in devices:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return best


def _check_covers(model: nn.Module, devices: DeviceMap) -> None:
    bad = [n for n, _ in model.named_parameters() if entry_of(n, devices) is None]
    if bad:
        raise ValueError(f"device_map places no device for {len(bad)} parameter(s): {', '.join(bad[:8])}"
                         f"{' ...' if len(bad) > 8 else ''}")


def tie_groups(model: nn.Module) -> list[tuple[list[str], bool]]:
    """[(module names holding one tensor, lent)] ; lent: a module reads another's `weight` in its forward."""
    owner: dict[int, list[str]] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p_name, p in m._parameters.items():
            if p is not None:
                owner.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    groups = [(names, False) for names in owner.values() if len(names) > 1]
    for mod_name, m in model.named_modules():
        w = getattr(m, "weight", None) if "weight" not in m._parameters else None
        if isinstance(w, nn.Parameter) and id(w) in owner:  # a borrowed weight (tied Unembed)
            groups.append((owner[id(w)] + [f"{mod_name}.weight"], True))
    return groups


def _tie(model: nn.Module, devices: DeviceMap, strict: bool) -> DeviceMap:
    main = main_device(devices)
    for names, lent in tie_groups(model):
        entries = list(dict.fromkeys(e for e in (entry_of(n, devices) for n in names) if e is not None))
        chosen = {devices[e] for e in entries}
        if len(chosen) > 1:
            if strict:
                raise ValueError(f"device_map splits tensors shared by {', '.join(entries)} over "
                                 f"{sorted(map(str, chosen))}: give them one device")
            first = min(entries, key=list(devices).index)
            for e in entries:
                devices[e] = devices[first]
    return devices


def main_device(devices: DeviceMap) -> Any:
    gpus = [d for d in devices.values() if d not in ("cpu", "disk")]
    return gpus[0] if gpus else "cpu"


def offloaded(device: Any, main: Any) -> bool:
    return device == "disk" or (device == "cpu" and main != "cpu")


def torch_device(device: Any) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


# --------------------------------------------------------------------------------------- dispatch
def dispatch_from_source(model: nn.Module, plan: dict[str, tuple[str, Any]], source: Any, arch: Any, *,
                         fill: Fill, dtype: torch.dtype, device_map: str | DeviceMap, max_memory: dict | None = None,
                         offload_folder: str | Path | None = None) -> nn.Module:
    """Place `model` (built on meta, plan checked) by `device_map`, read its weights once, dispatch it.

    `fill(module, plan, source, arch)` reads each planned tensor into `module.named_parameters()`'s
    tensor of that name (the loader's `copy_weights`: conversion, shape check, one read per tensor).
    """
    from accelerate import dispatch_model

    devices = plan_device_map(model, device_map, max_memory=max_memory, dtype=dtype)
    main = main_device(devices)
    names = {n: entry_of(n, devices) for n, _ in model.named_parameters()}
    on_disk = {n for n, e in names.items() if devices[e] == "disk"}
    if on_disk and offload_folder is None:
        disk = sorted({e for n, e in names.items() if n in on_disk})
        raise ValueError(f"device_map puts {', '.join(disk)} on disk: pass offload_folder=")
    _place(model, dtype, {n: torch_device(devices[e] if devices[e] != "disk" else "cpu") for n, e in names.items()
                          if n not in on_disk}, torch_device(main))
    fill(model, {n: v for n, v in plan.items() if n not in on_disk}, source, arch)
    index = _offload(model, {n: v for n, v in plan.items() if n in on_disk}, source, arch, fill,
                     offload_folder) if on_disk else None
    cpu_state = _aliases(model, {n for n, e in names.items() if devices[e] == "cpu" and offloaded("cpu", main)})
    dispatch_model(model, device_map=devices, main_device=main, state_dict=cpu_state or None,
                   offload_dir=str(offload_folder) if on_disk else None, offload_index=index,
                   preload_module_classes=unit_classes(model), force_hooks=True)
    _lend(model, devices, main)
    model.hf_device_map = devices
    return model.eval()


def _lend(model: nn.Module, devices: DeviceMap, main: Any) -> None:
    """A lent weight on an offloaded device: the borrower's forward onloads the lender first and drops it
    after (`hooked.devices.onloaded`), unless the lender's offload hook already spans the borrower's
    forward (one holder above both, e.g. device_map={"": "disk"})."""
    from hooked.devices import offload_holders, onloaded

    for names, lent in tie_groups(model):
        if not (lent and offloaded(devices[entry_of(names[0], devices)], main)):
            continue
        lender = model.get_submodule(names[0].rsplit(".", 1)[0])
        borrower = model.get_submodule(names[-1].rsplit(".", 1)[0])
        holders = offload_holders(model, lender)
        if any(any(m is borrower for m in h.modules()) for h in holders):
            continue
        stack: list[contextlib.AbstractContextManager] = []

        def enter(module: nn.Module, args: Any, lender: nn.Module = lender, stack: list = stack) -> None:
            stack.append(onloaded(model, lender))
            stack[-1].__enter__()

        def leave(module: nn.Module, args: Any, output: Any, stack: list = stack) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        borrower.register_forward_pre_hook(enter)
        borrower.register_forward_hook(leave, always_call=True)


def _place(model: nn.Module, dtype: torch.dtype, where: dict[str, torch.device], main: torch.device) -> None:
    """Allocate each meta parameter (uninitialised) on its device; disk parameters stay meta; buffers cast."""
    params = dict(model.named_parameters())
    new: dict[int, nn.Parameter] = {}
    for name, p in params.items():
        if name in where:
            p_dtype = dtype if p.is_floating_point() else p.dtype
            new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p_dtype, device=where[name]), p.requires_grad)
        elif p.is_floating_point() and p.dtype != dtype:
            new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), p.requires_grad)
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None and id(p) in new:
                m._parameters[n] = new[id(p)]
        for n, b in m._buffers.items():
            if b is not None:
                m._buffers[n] = b.to(dtype=dtype if b.is_floating_point() else b.dtype)


def _aliases(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """{every name of each listed parameter: its tensor}: accelerate looks tensors up under the module's own path."""
    ids = {id(p) for n, p in model.named_parameters() if n in names}
    return {n: p.data for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def _offload(model: nn.Module, plan: dict[str, tuple[str, Any]], source: Any, arch: Any, fill: Fill,
             folder: str | Path) -> dict[str, dict[str, str]]:
    """The offload index of the disk parameters: the checkpoint's file where a tensor is stored as we need
    it, else `offload.safetensors`, written here (header first, then the parameters of one checkpoint
    tensor at a time, filled into CPU staging tensors by `fill`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    index: dict[str, dict[str, str]] = {}
    by_source: dict[str, list[str]] = {}  # checkpoint tensor -> the parameters it fills (GPT-2's c_attn: 3)
    file_of = getattr(source, "file_of", None)
    for name, (src, key) in sorted(plan.items(), key=lambda item: item[1][0]):
        if key.transform is None and file_of is not None and source.dtype(src) == params[name].dtype:
            index[name] = {"safetensors_file": str(file_of(src)), "weight_name": src}
        else:
            by_source.setdefault(src, []).append(name)
    if by_source:
        path = folder / OFFLOAD_FILE
        specs = {n: (params[n].shape, params[n].dtype) for names in by_source.values() for n in names}
        with SafetensorsWriter(path, specs) as out:
            for names in by_source.values():
                staging = _Staging({n: torch.empty(params[n].shape, dtype=params[n].dtype) for n in names})
                fill(staging, {n: plan[n] for n in names}, source, arch)
                for n in names:
                    out.write(n, staging.tensors[n])
                    index[n] = {"safetensors_file": str(path), "weight_name": n}
    ids = {id(params[n]): index[n] for n in index}
    return {n: ids[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


class _Staging:
    """What `fill` reads into for disk parameters: named CPU tensors, freed once written."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time: shapes and dtypes known up front, data streamed."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        from loaders.safetensors_io import SAFETENSORS_DTYPES

        names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
        header, offset = {}, 0
        for name, (shape, dtype) in specs.items():
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.header, self.pending = Path(path), header, list(specs)
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        if not self.pending or self.pending[0] != name:
            raise RuntimeError(f"{self.path}: expected {self.pending[:1]}, got {name!r}")
        self.pending.pop(0)
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()
        if exc[0] is None and self.pending:
            raise RuntimeError(f"{self.path}: {len(self.pending)} tensors never written")
