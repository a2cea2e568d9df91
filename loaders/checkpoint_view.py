"""Original checkpoint layouts seen as transformers 5.x's in-memory layout, so one key map serves both.

Glossary
    in-memory layout   what `hf_model.state_dict()` holds in transformers 5.x (what `from_hf` reads):
                       experts stacked into 3-D tensors (`experts.gate_up_proj` [E 2F m], `experts.down_proj`)
    original layout    what checkpoints on disk hold (and `save_pretrained` writes back): per-expert
                       tensors (`experts.{i}.gate_proj.weight`, ...) or older names (`backbone.`,
                       Granite's `block_sparse_moe.input_linear.weight`)
    renames            (regex, replacement) applied to every checkpoint name, in order
    stacks             {target suffix: parts}: `<prefix>.experts.{i}.<part>.weight` of every expert i,
                       the parts concatenated on dim 0 per expert, then stacked over experts, become
                       `<prefix>.experts.<target suffix>` (HF's MergeModulelist + Concatenate)

`expert_view(renames, stacks)` is an Architecture's `adapt`: a source without any such name passes
through unchanged; otherwise a lazy view is returned (tensors read and stacked when the loader asks).
`mxfp4_view()` presents MXFP4-quantised tensors (gpt-oss's `<name>_blocks` + `<name>_scales`) as `<name>`,
dequantised as HF's `convert_moe_packed_tensors` does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from loaders.errors import CheckpointError, where
from loaders.safetensors_io import MappingSource

EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<i>\d+)\.(?P<part>\w+)\.weight$")


class _View(Mapping):
    def __init__(self, source: Any, plain: dict[str, str], stacked: dict[str, list[list[str]]]) -> None:
        self.source, self.plain, self.stacked = source, plain, stacked
        self.dtype = next((source.dtype(n) for n in source.keys() if (source.dtype(n) or torch.int64).is_floating_point),
                          None)

    def __getitem__(self, name: str) -> Tensor:
        if name in self.plain:
            return self.source.read(self.plain[name])
        return torch.stack([torch.cat([self.source.read(p) for p in parts]) for parts in self.stacked[name]])

    def __iter__(self) -> Iterator[str]:
        yield from self.plain
        yield from self.stacked

    def __len__(self) -> int:
        return len(self.plain) + len(self.stacked)

    def map(self, name: str, dtype: torch.dtype) -> Tensor | None:
        """A renamed tensor file-backed (the source's `map`, for `mmap=True`); stacked ones are read: None."""
        if name not in self.plain or not hasattr(self.source, "map"):
            return None
        return self.source.map(self.plain[name], dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.plain:
            return tuple(self.source.shape(self.plain[name]))
        per = self.stacked[name]
        first = [tuple(self.source.shape(p)) for p in per[0]]
        return (len(per), sum(s[0] for s in first), *first[0][1:])


def expert_view(renames: Sequence[tuple[str, str]] = (),
                stacks: Mapping[str, Sequence[str]] | None = None) -> Callable[[Any], Any]:
    """The `adapt` function of an Architecture (module docstring)."""
    stacks = dict(stacks or {})
    patterns = [(re.compile(p), r) for p, r in renames]

    def rename(name: str) -> str:
        for pattern, repl in patterns:
            name = pattern.sub(repl, name)
        return name

    def adapt(source: Any) -> Any:
        names = list(source.keys())
        experts = {n: m for n in names if stacks and (m := EXPERT.match(rename(n)))}
        if not experts and all(rename(n) == n for n in names):
            return source
        plain = {rename(n): n for n in names if n not in experts}
        by_prefix: dict[str, dict[int, dict[str, str]]] = {}
        for n, m in experts.items():
            by_prefix.setdefault(m["prefix"], {}).setdefault(int(m["i"]), {})[m["part"]] = n
        stacked: dict[str, list[list[str]]] = {}
        for prefix, per_expert in by_prefix.items():
            ids = sorted(per_expert)
            if ids != list(range(len(ids))):
                raise ValueError(f"{prefix}: experts {ids} are not numbered 0..{len(ids) - 1}")
            for target, parts in stacks.items():
                complete = [i for i in ids if all(p in per_expert[i] for p in parts)]
                if not complete:
                    continue
                if len(complete) < len(ids):
                    _missing_parts(source, prefix, per_expert, parts, complete[0])
                stacked[f"{prefix}.{target}"] = [[per_expert[i][p] for p in parts] for i in ids]
            used = {p for target, parts in stacks.items() for p in parts if f"{prefix}.{target}" in stacked}
            for i in ids:  # parts no target took stay visible (and are reported as unexpected)
                plain.update({f"{prefix}.{i}.{p}.weight": n for p, n in per_expert[i].items() if p not in used})
        view = _View(source, plain, stacked)
        return _with_files(MappingSource(view, origin=getattr(source, "origin", "checkpoint"),
                                         shapes={n: view.shape(n) for n in view}), view)

    return adapt


def _with_files(adapted: MappingSource, view: _View) -> MappingSource:
    """`adapted.file_named(name)`: the file of the original tensor (a stacked one's first part), for error
    messages only (not `file_of`: disk offload reads `file_of`'s file under the name asked, which a view renames)."""
    def file_named(name: str) -> str:
        return where(view.source, view.plain[name] if name in view.plain else view.stacked[name][0][0])
    adapted.file_named = file_named
    return adapted


def _missing_parts(source: Any, prefix: str, per_expert: dict[int, dict[str, str]], parts: Sequence[str],
                   ref: int) -> None:
    """Raise a CheckpointError naming each expert tensor that is absent while expert `ref` stores it."""
    missing = [f"{prefix}.{i}.{p}.weight" for i, have in per_expert.items() for p in parts if p not in have]
    expected = {n: tuple(source.shape(per_expert[ref][n.split(".")[-2]])) for n in missing}
    raise CheckpointError(getattr(source, "origin", "checkpoint"), "its experts", missing, [], [],
                          hints=[f"expert {ref} stores every part, in {where(source, per_expert[ref][parts[0]])}: "
                                 f"each expert needs {', '.join(parts)}"], expected=expected)


class _Concat(_View):
    """_View whose `stacked` entries are concatenations on dim 0 (one list of parts each, no expert axis)."""

    def __getitem__(self, name: str) -> Tensor:
        if name in self.plain:
            return self.source.read(self.plain[name])
        return torch.cat([self.source.read(p) for p in self.stacked[name][0]])

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.plain:
            return tuple(self.source.shape(self.plain[name]))
        shapes = [tuple(self.source.shape(p)) for p in self.stacked[name][0]]
        return (sum(s[0] for s in shapes), *shapes[0][1:])


def concat_view(parts: Sequence[str], target: str) -> Callable[[Any], Any]:
    """An `adapt` function: tensors `<prefix><part>` for every part in `parts` (all present for one prefix)
    are seen as one tensor `<prefix><target>`, their concatenation on dim 0 in the order of `parts`
    (OLMo-hybrid's and Kimi Linear's q/k/v conv weights saved apart, loaded as one conv). Each part's own
    size is not checked: HF's save splits the concatenation into equal chunks, not at the q/k/v borders."""

    def adapt(source: Any) -> Any:
        names = list(source.keys())
        groups: dict[str, list[str]] = {}
        for n in names:
            for part in parts:
                if n.endswith(part):
                    groups.setdefault(n[: len(n) - len(part)], []).append(n)
        groups = {prefix: [prefix + p for p in parts] for prefix, found in groups.items() if len(found) == len(parts)}
        if not groups:
            return source
        used = {n for members in groups.values() for n in members}
        view = _Concat(source, {n: n for n in names if n not in used},
                       {prefix + target: [members] for prefix, members in groups.items()})
        return _with_files(MappingSource(view, origin=getattr(source, "origin", "checkpoint"),
                                         shapes={n: view.shape(n) for n in view}), view)

    return adapt


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


def mxfp4_dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 -> dense, as HF's convert_moe_packed_tensors: blocks [.. R G 16] (uint8, two e2m1 codes a byte, low
    nibble first), scales [.. R G] (uint8, exponent + 127 per group of 32) -> [.. G*32 R] (the last two axes
    swapped: gpt-oss's in-memory layout). Exact in bf16 and wider (an e2m1 value times a power of two)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)  # [.. R G 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None]).to(dtype)
    return values.flatten(-2).transpose(-1, -2).contiguous()


class _Dequantized(_View):
    """_View whose `stacked` entries are one (blocks, scales) pair each, read dequantised (mxfp4_dequantize)."""

    def __getitem__(self, name: str) -> Tensor:
        if name in self.plain:
            return self.source.read(self.plain[name])
        blocks, scales = self.stacked[name][0]
        return mxfp4_dequantize(self.source.read(blocks), self.source.read(scales), self.dtype or torch.float32)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.plain:
            return tuple(self.source.shape(self.plain[name]))
        *lead, rows, groups, width = self.source.shape(self.stacked[name][0][0])
        return (*lead, groups * width * 2, rows)


def mxfp4_view() -> Callable[[Any], Any]:
    """An `adapt` function: each `<name>_blocks` with its `<name>_scales` is seen as `<name>`, dequantised in the
    checkpoint's floating dtype (gpt-oss: bf16, exact). A source without them passes through unchanged."""

    def adapt(source: Any) -> Any:
        names = list(source.keys())
        pairs = {n.removesuffix("_blocks"): [n, n.removesuffix("_blocks") + "_scales"] for n in names
                 if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in names}
        if not pairs:
            return source
        used = {n for pair in pairs.values() for n in pair}
        view = _Dequantized(source, {n: n for n in names if n not in used}, {t: [pair] for t, pair in pairs.items()})
        return _with_files(MappingSource(view, origin=getattr(source, "origin", "checkpoint"),
                                         shapes={n: view.shape(n) for n in view}), view)

    return adapt


def chained(*adapts: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One `adapt` applying several in order."""

    def adapt(source: Any) -> Any:
        for fn in adapts:
            source = fn(source)
        return source

    return adapt


def shard_view(pattern: re.Pattern, suffix: str) -> Callable[[Any], Any]:
    """An `adapt` function: tensors whose names match `pattern` (groups `target` and `i`, the shard number) are
    seen as one tensor `<target>.<suffix>`, the shards concatenated on dim 0 in the order of i (which must run
    0..n-1): Qwen4-Exp's n-gram tables saved in `split_ngram_parts` shards, as HF's Concatenate loads them."""

    def adapt(source: Any) -> Any:
        names = list(source.keys())
        groups: dict[str, dict[int, str]] = {}
        for n in names:
            if m := pattern.match(n):
                groups.setdefault(m["target"], {})[int(m["i"])] = n
        if not groups:
            return source
        for target, shards in groups.items():
            if sorted(shards) != list(range(len(shards))):
                raise ValueError(f"{target}: shards {sorted(shards)} are not numbered 0..{len(shards) - 1}")
        used = {n for shards in groups.values() for n in shards.values()}
        view = _Concat(source, {n: n for n in names if n not in used},
                       {f"{t}.{suffix}": [[s[i] for i in sorted(s)]] for t, s in groups.items()})
        return _with_files(MappingSource(view, origin=getattr(source, "origin", "checkpoint"),
                                         shapes={n: view.shape(n) for n in view}), view)

    return adapt
