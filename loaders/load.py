"""Checkpoint -> hooked model: `from_pretrained` (directory, hub id, GGUF file, alias) and `from_hf`.

Glossary
    source       a TensorSource (loaders/safetensors_io.py): names, shapes, one tensor read at a time
    key map      `arch.key_map(cfg)`: {our parameter: Key(checkpoint names, transform)}; the first
                 name present in the checkpoint is read, then transformed, then shape-checked
    plan         our parameter -> the checkpoint name it reads; built and checked before any
                 memory is allocated, so every problem is reported at once in one CheckpointError
    missing      a parameter none of whose checkpoint names is present
    unexpected   a checkpoint tensor no parameter reads, except the ignored ones: buffers HF itself
                 recomputes (IGNORED_KEYS, `Architecture.ignore`), `lm_head.weight` when our model
                 ties it to the embedding (the key map leaves it out), and, in `from_hf`, a name that
                 is the very same tensor as one that is read (HF's tied weights)
    mis-shaped   a tensor whose shape after the Key's transform differs from the parameter's; the
                 transform is first run on a meta tensor of the checkpoint's shape, so this too is
                 known before reading data
    placement    dtype, device, device_map, max_memory, offload_folder, mmap: one checked
                 `Placement` (loaders/placement.py), made from from_pretrained's keywords
    meta build   the model is built with its parameters on the meta device (no memory, no init),
                 its buffers real (loaders/meta.py); `materialise` then allocates each parameter
                 once in the final dtype and device (like `to_empty`, keeping ties), and tensors are
                 read into them one at a time, straight from the file when no conversion is needed:
                 peak memory ~1x
    file-backed  with `mmap=True` (the default on CPU without a device_map), a parameter that needs no conversion (stored in the load's dtype,
                 no transform in its Key or one that only views the tensor contiguously, device cpu,
                 aligned in the file) is not allocated or read:
                 it is the checkpoint's bytes under a private memory map (loaders/safetensors_io.py,
                 "mapped"), paged in when first used. In-place edits stay in this process

A failed load raises before the model is returned; no half-loaded model ever escapes. Loading
changes no process-wide state (loaders/meta.py: no hook registered with torch, nothing patched).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from loaders.checks import (ConfigError, check_float_dtype, check_hf_config, check_model_config, config_dtype,
                            read_json, shard_path, weight_map)
from hooked.validate import Device, Flag, Text, check, checked
from loaders.dispatch import check_placement
from loaders.errors import CheckpointError, layer_hint, where
from loaders.hub import looks_like_repo_id, resolve_repo
from loaders.meta import build_on_meta, materialise
from loaders.placement import Placement
from loaders.registry import Architecture, find_architecture
from loaders.safetensors_io import INDEX_FILE, SINGLE_FILE, MappingSource, SafetensorsCheckpoint
from loaders.stored_head import follow_stored_head
from loaders.unsupported import check_supported
from loaders.tokenizer import load_gguf_tokenizer, load_tokenizer, prepare_tokenizer

IGNORED_KEYS = (  # checkpoint tensors HF models recompute instead of loading
    r"(^|\.)rotary_emb\.inv_freq$",
    r"(^|\.)attn\.(masked_)?bias$",  # old GPT-2 checkpoints store the causal mask
)
TIED_OUTPUT_KEYS = ("lm_head.weight",)
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _smollm2() -> Path:
    from loaders.smollm2 import smollm2_path

    return smollm2_path()


ALIASES: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2}


# ------------------------------------------------------------------------------------- entry points
@checked(allow_pickle=Flag(), revision=Text(none=True), mmap=Flag(none=True))
def from_pretrained(path_or_repo_id: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    allow_pickle: bool = False, revision: str | None = None, device_map: str | dict | None = None,
                    max_memory: dict | None = None, offload_folder: str | Path | None = None,
                    mmap: bool | None = None, **processing: bool) -> Any:
    """A hooked model from a checkpoint, with `model.tokenizer` set when the checkpoint has one.

    Args:
        path_or_repo_id: an alias ("smollm2-135m"), a `.gguf` file, a directory with config.json and
            model.safetensors (or a sharded model.safetensors.index.json), or a hub repo id
            (the hub cache is tried first, so a cached repo loads offline).
        dtype: parameter dtype; default the checkpoint's (config "dtype"/"torch_dtype", else its tensors').
        device: where the parameters live (default "cpu"); not with device_map.
        allow_pickle: read pytorch pickles (`*.bin`) when there are no safetensors, with
            `torch.load(weights_only=True)`. Refused by default.
        revision: hub branch, tag or commit.
        device_map: spread the model over devices with accelerate (loaders/dispatch.py): "auto",
            "balanced", "balanced_low_0", "sequential", or {module name: GPU index | "cpu" | "disk"};
            blocks are never split. Replaces `device`.
        max_memory: {device: bytes or "10GiB"} for the planners; what does not fit goes to disk.
        offload_folder: where disk-offloaded weights are written (needed when the map uses "disk").
        mmap: CPU loads of safetensors only: each parameter stored in the load's dtype and layout is
            a private (copy-on-write) memory map of the checkpoint file instead of a copy, so the
            load reads nothing and pages are read when first used (what HF's from_pretrained does);
            edits to the weights stay in this process. The files must then not be rewritten in place
            or truncated while the model lives (the weights would change, or the process die with
            SIGBUS); replacing them is safe (a new file renamed over them; safetensors' save_file and
            save_pretrained make a new file). Conversions (another dtype,
            transposed or fused layouts, experts stacked from per-expert tensors, GGUF, pickles)
            are still read into memory. Default (None): on for CPU loads without a device_map, as
            HF's from_pretrained maps its files; off otherwise. mmap=False always copies (a copy
            cannot change under the model).
        **processing: weight processing, off unless asked (hooked.processing): fold_ln,
            center_writing_weights, center_unembed, fold_value_biases (TransformerLens turns all four
            on by default; here each is an explicit opt-in).
    Raises:
        CheckpointError (a ValueError): missing, unexpected or mis-shaped tensors, all listed.
        CheckpointFileError (a ValueError): a truncated or corrupt file, named.
        ValueError: unknown architecture; pickled weights without allow_pickle; mmap=True with
            device_map= or a device other than cpu; max_memory= or offload_folder= without device_map=.
        FileNotFoundError: nothing at that path, or a repo id neither cached nor downloadable.
        TypeError: an unknown keyword (named).
    """
    _check_processing(processing)
    check_placement(device_map, max_memory, offload_folder)
    dtype = _load_dtype(dtype)
    if device is not None and device_map is not None:
        raise ValueError(f"from_pretrained: device={str(device)!r} and device_map={device_map!r}: a device map places "
                         "every module, so device would be ignored; give one of them")
    device = check("cpu" if device is None else device, "from_pretrained: device", Device(meta=True))  # meta: refused below
    placement = Placement(dtype=dtype, device=device, device_map=device_map, max_memory=max_memory,
                          offload_folder=offload_folder, mmap=mmap)
    if device.type == "meta":
        raise ValueError("from_pretrained: device='meta': the meta device holds no data; load onto 'cpu' or a GPU")
    path = resolve_checkpoint(path_or_repo_id, revision=revision, allow_pickle=allow_pickle)
    if path.is_file():  # GGUF: every tensor is converted, so nothing can be file-backed; mmap= decides nothing
        return _processed(load_gguf(path, dataclasses.replace(placement, mmap=None)), processing)
    return _processed(load_dir(path, placement, allow_pickle=allow_pickle), processing)


PROCESSING = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")


def from_pretrained_no_processing(path_or_repo_id: str | Path, **kwargs: Any) -> Any:
    """TL's name for loading without weight processing: here the same as `from_pretrained`."""
    return from_pretrained(path_or_repo_id, **kwargs)


def _check_processing(processing: dict[str, bool]) -> None:
    """Refuse unknown processing keywords, and values other than True / False, before anything is read."""
    unknown = sorted(set(processing) - set(PROCESSING))
    if unknown:
        raise TypeError(f"unknown keyword(s) {unknown}; weight processing takes {list(PROCESSING)}")
    for name, value in processing.items():
        check(value, f"from_pretrained: {name}", Flag())


def _load_dtype(dtype: Any) -> torch.dtype | None:
    """None or a floating torch.dtype (a name such as "float32" is refused: pass torch.float32)."""
    return None if dtype is None else check_float_dtype(dtype, "from_pretrained: dtype")


def _processed(model: Any, processing: dict[str, bool]) -> Any:
    """Apply the weight processing asked for by keyword (all off by default; checked by `_check_processing`)."""
    if not any(processing.values()):
        return model
    if getattr(model, "hf_device_map", None) is not None:
        raise ValueError("weight processing needs the weights in memory: load without device_map to process them")
    from hooked.processing import process_weights

    return process_weights(model, **{k: bool(processing.get(k, False)) for k in PROCESSING})


def resolve_checkpoint(path_or_repo_id: str | Path, *, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local `.gguf` file or checkpoint directory that `from_pretrained` would read."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id).strip():
        raise ValueError(f"a model name must be a non-empty path, hub repo id or alias "
                         f"({', '.join(ALIASES)}), got {path_or_repo_id!r}")
    name = str(path_or_repo_id)
    if name.lower() in ALIASES:
        return ALIASES[name.lower()]()
    if name.lower().startswith("organism/"):  # shipped model organisms: loaders/organisms.py
        from loaders.organisms import organism_path

        return organism_path(name)
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path}: expected a checkpoint directory (config.json + model.safetensors) or a .gguf file")
    if looks_like_repo_id(name):
        try:
            return resolve_repo(name, revision, allow_pickle)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{name!r} is no local path; as a hub repo id: {e}") from e
    raise FileNotFoundError(f"{name!r} is not an alias ({', '.join(ALIASES)}), a .gguf file, a directory or a hub repo id")


def from_hf(hf_model: Any, tokenizer: Any = None, share_weights: bool = False, **processing: bool) -> Any:
    """A hooked model with the same weights, dtype and device as an in-memory HF model.

    share_weights=True: every parameter of ours is a view of the HF model's tensor (no copy), so
    training ours updates the HF model in place (`save_pretrained` then writes what we trained);
    raises ValueError naming the parameter when a key map's transform has to copy (fused layouts).
    **processing: fold_ln, center_writing_weights, center_unembed, fold_value_biases, as in
    from_pretrained (off unless asked; not with share_weights, which would change the HF model).
    """
    _check_processing(processing)
    if not all(hasattr(hf_model, a) for a in ("config", "state_dict", "parameters")) or \
            not hasattr(hf_model.config, "to_dict"):  # a transformers model, or anything shaped like one
        raise TypeError(f"from_hf takes an in-memory Hugging Face model (a transformers PreTrainedModel), got "
                        f"{type(hf_model).__name__}; for a name, path or hub id use from_pretrained")
    if getattr(getattr(hf_model, "base_model", None), "layers_are_rescaled", False):  # HF RWKV after an eval forward
        raise ValueError("from_hf: this RWKV model's output weights are divided by 2^(l // rescale_every) in memory "
                         "(HF does so at its first eval-mode forward: layers_are_rescaled); call from_hf before running "
                         "it in eval mode, after hf_model.train() and one forward, or load the checkpoint from disk")
    hf_config = hf_model.config.to_dict()
    p = next(hf_model.parameters())
    source = MappingSource(hf_model.state_dict(), origin=type(hf_model).__name__)
    try:
        model = build_from_source(hf_config, source, Placement(dtype=p.dtype, device=p.device, mmap=False))
    except CheckpointError as e:
        if _has_head(hf_model):
            raise
        name = type(hf_model).__name__
        raise ValueError(f"from_hf: {name} is a base model without a language-model head (its "
                         f"get_output_embeddings() is None): load its causal LM, e.g. "
                         f"transformers.{name.removesuffix('Model') + 'ForCausalLM'}, and pass that") from e
    model.tokenizer = prepare_tokenizer(tokenizer)
    if share_weights:
        if any(processing.values()):
            raise ValueError("weight processing with share_weights=True would rewrite the HF model's weights")
        _share(model, hf_config, source, type(hf_model).__name__)
    return _processed(model, processing)


def _has_head(hf_model: Any) -> bool:
    get = getattr(hf_model, "get_output_embeddings", None)
    return get is None or get() is not None


def _share(model: nn.Module, hf_config: dict[str, Any], source: Any, origin: str) -> None:
    """Point each of our parameters at (a view of) its HF tensor."""
    arch = find_architecture(hf_config)
    plan = plan_load(arch, arch.config_from_hf(hf_config), model, source)
    params = dict(model.named_parameters())
    for name, (src, key) in plan.items():
        if name not in params:
            continue
        hf_tensor = source.tensors[src]
        t = key.transform(hf_tensor) if key.transform is not None else hf_tensor
        if t.untyped_storage().data_ptr() != hf_tensor.untyped_storage().data_ptr():
            raise ValueError(f"cannot share {name} with {origin}'s {src}: its key map copies the tensor")
        params[name].data = t


def load_dir(directory: str | Path, placement: Placement = Placement(), *, allow_pickle: bool = False) -> Any:
    """Load a checkpoint directory: config.json plus safetensors (or, opted in, pickles), and its tokenizer."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json (is this a Hugging Face checkpoint directory?)")
    hf_config = read_config(d)
    if (d / INDEX_FILE).is_file() or (d / SINGLE_FILE).is_file():
        source = SafetensorsCheckpoint.from_dir(d)
    else:
        source = _pickle_source(d, allow_pickle)
    try:
        model = build_from_source(hf_config, source, placement)
    except CheckpointError as e:
        hint = _defaulted_text_config(d, hf_config)
        if hint is None:
            raise
        raise CheckpointError(e.origin, e.arch, e.missing, e.unexpected, e.mismatched, e.unmapped,
                              [hint, *e.hints], e.expected, e.found) from None
    model.tokenizer = load_tokenizer(d)
    return model


def _defaulted_text_config(d: Path, hf_config: dict[str, Any]) -> str | None:
    """A line naming the cause when config.json has no text_config and HF's config class filled in its own."""
    raw = read_json(d / "config.json", "config")
    text = hf_config.get("text_config")
    if "text_config" in raw or not isinstance(text, dict):
        return None
    sizes = ", ".join(f"{k}={text[k]}" for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k in text)
    return (f"{d / 'config.json'} has no text_config: the {raw.get('model_type')!r} config class filled in its "
            f"defaults ({sizes}), not this checkpoint's text model; add the text model's text_config")


def load_gguf(path: str | Path, placement: Placement = Placement()) -> Any:
    """Load a GGUF file (dequantized to float32 unless `placement.dtype` says otherwise) with its tokenizer.
    Every GGUF tensor is converted, so read into memory: `placement.mmap=True` is refused."""
    from loaders.gguf import read_gguf

    path = Path(path)
    if placement.mmap:
        raise ValueError(f"{path}: mmap=True cannot apply to a GGUF file: its tensors are dequantized, so they are "
                         f"always read into memory (load with mmap=None or False)")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    ckpt = read_gguf(path)
    source = MappingSource(ckpt.tensors, origin=str(path), shapes=ckpt.tensors.shapes)
    placement = dataclasses.replace(placement, dtype=placement.dtype or torch.float32, mmap=False)
    model = build_from_source(normalise_config(ckpt.config), source, placement)
    model.tokenizer = load_gguf_tokenizer(path)
    return model


def read_config(directory: Path) -> dict[str, Any]:
    """config.json as the HF config class reads it (`AutoConfig(...).to_dict()`, the dict `from_hf`
    sees: legacy fields renamed, JSON-encoded infinities decoded); raw JSON for a model type
    transformers does not know (the registry then names it). Checked first: a ConfigError names the
    file and the field."""
    path = directory / "config.json"
    raw = check_hf_config(read_json(path, "config"), str(path))
    if not _known_to_transformers(raw):
        return raw
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=False).to_dict()
    except _hf_config_errors() as e:  # transformers' own field validation
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None


def normalise_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An HF-style config dict (e.g. GGUF metadata) passed through its HF config class, like `read_config`."""
    check_hf_config(raw, "config")
    if not _known_to_transformers(raw):
        return raw
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[raw["model_type"]].from_dict(dict(raw)).to_dict()
    except _hf_config_errors() as e:
        raise ConfigError(f"config: {' '.join(str(e).split())}") from None


def _hf_config_errors() -> tuple[type[Exception], ...]:
    """What an HF config class raises for a value it refuses (its strict dataclass validation included)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub
        return (TypeError, ValueError, KeyError)
    return (TypeError, ValueError, KeyError, StrictDataclassError)


def _known_to_transformers(raw: dict[str, Any]) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(raw.get("model_type"), str) and raw["model_type"] in CONFIG_MAPPING


def _pickle_source(d: Path, allow_pickle: bool) -> MappingSource:
    found = [n for n in PICKLE_FILES if (d / n).is_file()]
    if not found:
        have = sorted(p.name for p in d.iterdir())
        raise FileNotFoundError(f"{d}: no {SINGLE_FILE}, {INDEX_FILE} or pickled weights; found {have}")
    if not allow_pickle:
        raise ValueError(
            f"{d} has only pickled PyTorch weights ({', '.join(found)}). Pickles can run code when loaded, so they "
            f"are refused: convert them to safetensors, or pass allow_pickle=True if you trust them "
            f"(they are then read with torch.load(weights_only=True)).")
    if "pytorch_model.bin.index.json" in found:
        index = d / "pytorch_model.bin.index.json"
        files = [shard_path(d, f, index) for f in sorted(set(weight_map(read_json(index, "index"), index).values()))]
    else:
        files = [d / "pytorch_model.bin"]
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except RuntimeError:  # legacy (non-zip) pickles cannot be memory-mapped
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    return MappingSource(state, origin=str(d))


# ------------------------------------------------------------------------------------------- core
def build_from_source(hf_config: dict[str, Any], source: Any, placement: Placement | None = None,
                      **fields: Any) -> Any:
    """Build the architecture's model on meta, check the whole plan, then materialise and fill it
    (or, given a device_map, place it over devices: loaders/dispatch.py). `placement.maps`: parameters
    that need no conversion are file-backed (`map_weights`), the others read.

    placement: a Placement, or its fields as keywords (`dtype=torch.float32, device="cpu"`; an unknown
    keyword is a TypeError naming it). Without `mmap`, keywords mean mmap=False here.
    """
    if placement is None:
        placement = Placement(**{"mmap": False, **fields})
    elif fields:
        raise TypeError(f"pass a Placement or its fields as keywords, not both (got {sorted(fields)} too)")
    origin = getattr(source, "origin", "checkpoint")
    check_hf_config(hf_config, origin)
    arch = find_architecture(hf_config)
    check_supported(arch.name, hf_config, origin)
    try:
        cfg = arch.config_from_hf(hf_config)
    except KeyError as e:
        raise ConfigError(f"{origin}: the {arch.name} config has no field {e.args[0]!r}") from None
    except (TypeError, ArithmeticError) as e:
        raise ConfigError(f"{origin}: the {arch.name} config has values the model cannot use ({e})") from None
    except ValueError as e:  # the config's own checks (heads dividing d_model, unsupported options)
        raise e if isinstance(e, ConfigError) else ConfigError(f"{origin}: {e}") from None
    check_model_config(cfg, origin, arch.name)
    if getattr(arch, "adapt", None) is not None:  # e.g. per-expert tensors stacked (loaders/checkpoint_view.py)
        try:
            source = arch.adapt(source)
        except CheckpointError as e:  # raised before the architecture was known to it
            raise CheckpointError(origin, arch.name, e.missing, e.unexpected, e.mismatched, e.unmapped,
                                  e.hints, e.expected, e.found) from None
    cfg = follow_stored_head(cfg, arch, source)  # a stored lm_head.weight is loaded, untied, as HF does
    dtype = placement.dtype or checkpoint_dtype(hf_config, source)
    try:
        model = build_on_meta(arch.build, cfg)
    except ValueError as e:  # the model's own consistency checks (e.g. heads dividing d_model)
        raise ConfigError(f"{origin}: {e}") from None
    plan = plan_load(arch, cfg, model, source)
    if placement.device_map is not None:
        from loaders.dispatch import dispatch_from_source

        return dispatch_from_source(model, plan, source, arch, fill=copy_weights, dtype=dtype,
                                    device_map=placement.device_map, max_memory=placement.max_memory,
                                    offload_folder=placement.offload_folder)
    device = placement.device
    mapped = map_weights(model, plan, source, dtype) if placement.maps and device.type == "cpu" else {}
    materialise(model, dtype=dtype, device=device, given=mapped)
    copy_weights(model, {n: v for n, v in plan.items() if n not in mapped}, source, arch)
    return model.eval()


def checkpoint_dtype(hf_config: dict[str, Any], source: Any) -> torch.dtype:
    """The checkpoint's dtype: config "dtype" / "torch_dtype", else its first floating tensor's, else float32."""
    for field in ("dtype", "torch_dtype"):
        value = hf_config.get(field)
        if isinstance(value, (str, torch.dtype)) and str(value).removeprefix("torch.") != "auto":
            return config_dtype(value, f"config field {field}")
    for name in source.keys():
        dtype = source.dtype(name)
        if dtype is not None and dtype.is_floating_point:
            return dtype
    return torch.float32


def plan_load(arch: Architecture, cfg: Any, model: nn.Module, source: Any) -> dict[str, tuple[str, Any]]:
    """{our parameter: (checkpoint name, Key)} for every parameter; raises CheckpointError listing all problems."""
    key_map = arch.key_map(cfg)
    params = dict(model.named_parameters())  # one name per tensor: tied aliases are not listed twice
    present = set(source.keys())
    plan: dict[str, tuple[str, Any]] = {}
    missing, mismatched, expected = [], [], {}
    unmapped = [n for n in params if n not in key_map]
    unmapped += [f"{n} (not a parameter)" for n in key_map if n not in params]
    for name, key in key_map.items():
        src = next((n for n in key.names if n in present), None)
        if src is None:
            missing.append(key.names[0] if len(key.names) == 1 else f"{key.names[0]} (or {', '.join(key.names[1:])})")
            if name in params:
                expected[missing[-1]] = tuple(params[name].shape)
            continue
        plan[name] = (src, key)
        if name in params:
            got = _shape_after(key, source.shape(src))
            if isinstance(got, Exception) or tuple(got) != tuple(params[name].shape):
                mismatched.append(mis_shaped(source, src, name, key, tuple(params[name].shape), got))
    used = {src for src, _ in plan.values()}
    referenced = {n for key in key_map.values() for n in key.names}
    patterns = [re.compile(p) for p in IGNORED_KEYS + tuple(getattr(arch, "ignore", ()))]
    identity = getattr(source, "identity", lambda n: None)
    used_ids = {identity(n) for n in used} - {None}
    unexpected = [n for n in source.keys() if n not in used and not any(p.search(n) for p in patterns)
                  and not (n in TIED_OUTPUT_KEYS and n not in referenced) and identity(n) not in used_ids]
    if missing or unexpected or mismatched or unmapped:
        hints = layer_hint(source.keys(), getattr(cfg, "n_layers", None)) if missing else []
        found = {n: f"{list(source.shape(n))} in {where(source, n)}" for n in unexpected}
        raise CheckpointError(getattr(source, "origin", "checkpoint"), arch.name, missing, unexpected, mismatched,
                              unmapped, hints, expected, found)
    return plan


def mis_shaped(source: Any, src: str, name: str, key: Any, want: tuple[int, ...], got: Any) -> str:
    """One mis-shaped entry: the tensor, its shape in the file, what the Key made of it (or why it could
    not), the shape expected, the parameter, the file."""
    found = list(source.shape(src))
    made = (f"which {_transform_name(key)} cannot convert ({' '.join(str(got).split())})"
            if isinstance(got, Exception) else f"-> {list(got)}" if key.transform is not None else "")
    return f"{src}: {found}{' ' + made if made else ''}, expected {list(want)} for {name} (in {where(source, src)})"


def _transform_name(key: Any) -> str:
    return f"its transform ({getattr(key.transform, '__qualname__', '?').replace('<locals>.', '')})"


def _shape_after(key: Any, shape: tuple[int, ...]) -> torch.Size | Exception:
    """The shape `key.transform` gives a tensor of `shape`, found on a meta tensor, or the error it raised
    (a fused layout that does not split into the parts the config asks for)."""
    if key.transform is None:
        return torch.Size(shape)
    try:
        return key.transform(torch.empty(shape, device="meta")).shape
    except Exception as e:  # noqa: BLE001 (any failure of the transform is the tensor's, reported by name)
        return e


def map_weights(model: nn.Module, plan: dict[str, tuple[str, Any]], source: Any,
                dtype: torch.dtype) -> dict[str, Tensor]:
    """{our parameter: its file-backed tensor} for every planned parameter that needs no conversion:
    stored in the parameter's dtype, mappable by the source (`source.map`: aligned), and either no
    transform or one that gives a contiguous view (a squeeze, a slice of whole rows: `_views`)."""
    if not hasattr(source, "map"):
        return {}
    params = dict(model.named_parameters())
    mapped = {}
    for name, (src, key) in plan.items():
        p_dtype = dtype if params[name].is_floating_point() else params[name].dtype
        if key.transform is not None and not _views(key.transform, source.shape(src)):
            continue
        t = source.map(src, p_dtype)
        if t is not None and key.transform is not None:
            t = key.transform(t)
        if t is not None and t.shape == params[name].shape:
            mapped[name] = t
    return mapped


def _views(transform: Callable[[Tensor], Tensor], shape: tuple[int, ...]) -> bool:
    """Whether `transform` gives a contiguous view of its input (no copy), found on a meta tensor."""
    probe = torch.empty(shape, device="meta")
    try:
        out = transform(probe)
    except Exception:  # data-dependent: not a view we can tell apart
        return False
    return (out is probe or out._base is probe) and out.is_contiguous()


def copy_weights(model: nn.Module, plan: dict[str, tuple[str, Any]], source: Any, arch: Architecture) -> None:
    """Read each planned tensor into its parameter, one at a time.

    A tensor that needs no conversion is read straight into the parameter. The others (transformed,
    or in another dtype) are read into one scratch buffer, allocated once at the size of the largest
    of them and reused, so the allocator is not left holding a freed temporary per tensor; a tensor
    read by several parameters (GPT-2's fused c_attn) is read once.
    """
    params = dict(model.named_parameters())
    order = sorted(plan.items(), key=lambda item: item[1][0])
    scratch = _scratch(order, params, source)
    last: tuple[str, Tensor] | None = None
    with torch.no_grad():
        for name, (src, key) in order:
            param = params[name]
            if key.transform is None and source.read_into(src, param.data):
                continue
            if last is None or last[0] != src:
                last = None
                last = (src, _read(source, src, scratch))
            try:
                t = key.transform(last[1]) if key.transform is not None else last[1]
            except Exception as e:  # noqa: BLE001 (a data-dependent transform failing on this tensor)
                t = e
            if isinstance(t, Exception) or t.shape != param.shape:
                raise CheckpointError(getattr(source, "origin", "checkpoint"), arch.name, [], [],
                                      [mis_shaped(source, src, name, key, tuple(param.shape),
                                                  t if isinstance(t, Exception) else t.shape)])
            param.copy_(t)


def _scratch(order: list, params: dict[str, Tensor], source: Any) -> Tensor | None:
    """A byte buffer for the reads that cannot go straight into their parameter (None if no source streams)."""
    if not getattr(source, "streams", False):
        return None
    sizes = [math.prod(source.shape(src)) * source.dtype(src).itemsize for name, (src, key) in order
             if key.transform is not None or source.dtype(src) != params[name].dtype or params[name].device.type != "cpu"]
    return torch.empty(max(sizes), dtype=torch.uint8) if sizes else None


def _read(source: Any, name: str, scratch: Tensor | None) -> Tensor:
    if scratch is None:
        return source.read(name)
    dtype, shape = source.dtype(name), source.shape(name)
    out = scratch[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    if not source.read_into(name, out):
        return source.read(name)
    return out
