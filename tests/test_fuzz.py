"""Seeded fuzz suite: careless and hostile input over loaders, inputs, hooks, analyses and the CLI.

Each generated case ends in exactly one outcome:
    clear error     an exception of an expected kind whose message names the problem (the argument,
                    field, file or hook), checked against the case's own list of words
    verified        a result equal to an independent oracle: the same call with canonical explicit
                    arguments, a hook written by hand, the safetensors library's own reading, ...
    silent-wrong    a result where the oracle says the input is invalid, or a result that differs
    refused-valid   an error where the oracle says the input is valid
    unnamed crash   any other exception, or one whose message does not name the problem
After every case the models' logits must be bit-identical to before and no hook may be left.
The suite asserts zero silent-wrong, zero refused-valid and zero unnamed crashes; `test_counts` prints
the totals (run with -s to see them). Everything is seeded: a failure names its case and reproduces.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from analysis.info_flow import info_flow
from analysis.interventions import ablate_heads, act_patch, decay_split, knockout, patch
from analysis.interventions.ablation import replace_block
from hooked.hook_points import scoped_hooks
from loaders import from_pretrained
from loaders.load import from_hf
from loaders.safetensors_io import SafetensorsFile

SEED = 13
TOKENS = torch.tensor([[1, 5, 9, 13, 17, 21]])
POS = TOKENS.shape[1]
CLEAR = (ValueError, TypeError, IndexError, KeyError, FileNotFoundError)
COUNTS: Counter = Counter()
FAILURES: list[str] = []


@dataclass
class Case:
    label: str
    run: Callable[[], Any]
    names: tuple[str, ...]  # a clear error's message contains one of these (case-insensitive)
    oracle: Callable[[], Any] | None = None  # None: the input is invalid, an error is expected
    same: Callable[[Any, Any], bool] = lambda a, b: torch.equal(a, b)


def judge(case: Case) -> str:
    try:
        result = case.run()
    except CLEAR as e:
        if case.oracle is not None:
            return f"refused-valid: {type(e).__name__}: {str(e)[:300]}"
        msg = str(e).lower()
        if any(n.lower() in msg for n in case.names):
            return "clear error"
        return f"unnamed crash: {type(e).__name__}: {str(e)[:300]} (expected one of {case.names})"
    except Exception as e:  # noqa: BLE001 - exactly what the suite is looking for
        return f"unnamed crash: {type(e).__name__}: {str(e)[:300]}"
    if case.oracle is None:
        return "silent-wrong: accepted an invalid input"
    return "verified" if case.same(result, case.oracle()) else "silent-wrong: differs from the oracle"


def run_cases(category: str, cases: list[Case], models: list[Any]) -> None:
    before = [m(TOKENS) for m in models]
    bad = []
    for case in cases:
        outcome = judge(case)
        kind = outcome.split(":")[0]
        COUNTS[kind] += 1
        COUNTS["cases"] += 1
        if kind not in ("clear error", "verified"):
            bad.append(f"[{category}] {case.label}: {outcome}")
        for m, ref in zip(models, before):
            if not torch.equal(m(TOKENS), ref) or any(p.has_hooks for p in m.hook_dict.values()):
                bad.append(f"[{category}] {case.label}: the model changed or kept a hook")
                COUNTS["model changed"] += 1
    FAILURES.extend(bad)
    assert not bad, "\n".join(bad[:20])


# ----------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def llama():
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return from_hf(hf)


@pytest.fixture(scope="module")
def mamba():
    import transformers

    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2)).eval()
    return from_hf(hf)


# ------------------------------------------------------------------------- reference rules
def ref_indices(spec: Any, n: int) -> list[int] | None:
    """The reference rule, written independently: integers (not bools) in [-n, n), alone, in a
    list / tuple / range, or as a 0-d / 1-d integer array. Canonical non-negative indices, or None."""
    def one(v):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            return None
        return int(v) if -n <= int(v) < n else None

    if isinstance(spec, (torch.Tensor, np.ndarray)):
        if spec.dtype in (torch.bool, np.bool_) or spec.ndim > 1 or str(spec.dtype).split(".")[-1] not in (
                "int64", "int32", "int16", "uint8", "int8"):
            return None
        items = [int(v) for v in spec.reshape(-1).tolist()]
    elif isinstance(spec, (list, tuple, range)):
        items = list(spec)
    else:
        items = [spec]
    out = [one(v) for v in items]
    return None if any(v is None for v in out) else [v % n for v in out]


def index_pool(rng: random.Random, n: int) -> Any:
    """One index argument, valid or not, drawn from everything a careless caller passes."""
    k = rng.randrange(19)
    i = rng.randrange(-n - 2, n + 2)
    return [
        lambda: i, lambda: [i, rng.randrange(n)], lambda: [rng.randrange(-n, n) for _ in range(rng.randrange(4))],
        lambda: i + 0.5, lambda: [float(rng.randrange(n))], lambda: str(abs(i)), lambda: [str(rng.randrange(n))],
        lambda: bool(rng.randrange(2)), lambda: None, lambda: [[rng.randrange(n)]],
        lambda: torch.tensor([rng.randrange(n)]), lambda: torch.tensor([rng.random()]),
        lambda: np.array([rng.randrange(-n, n)]), lambda: np.int64(i), lambda: range(rng.randrange(n + 1)),
        lambda: torch.tensor(rng.randrange(-n, n)), lambda: np.array(rng.randrange(-n, n)),
        lambda: np.array([str(rng.randrange(n))]), lambda: np.array(float(rng.randrange(n))),
    ][k]()


def mask_pool(rng: random.Random, n: int) -> torch.Tensor:
    size = n if rng.random() < 0.6 else rng.choice([n - 1, n + 1, 0])
    return torch.tensor([rng.random() < 0.4 for _ in range(size)], dtype=torch.bool)


# ------------------------------------------------------------------------------ categories
def knockout_cases(rng: random.Random, llama, mamba, count: int) -> list[Case]:
    cases = []
    for c in range(count):
        model, is_ssm = (mamba, True) if rng.random() < 0.4 else (llama, False)
        arg = rng.choice(["layers", "sources", "targets"] + (["channels"] * 2 if is_ssm else []))
        n = {"layers": model.cfg.n_layers, "sources": POS, "targets": POS, "channels": 32}[arg]
        base = {"layers": [0], "sources": [0, 1], "targets": [-1], "channels": None}
        masked = arg != "layers" and rng.random() < 0.25
        spec = mask_pool(rng, n) if masked else index_pool(rng, n)
        if masked:
            canon = spec.nonzero()[:, 0].tolist() if spec.shape == (n,) else None
        elif arg == "channels" and spec is None:
            canon = "all"  # None means every channel
        else:
            canon = ref_indices(spec, n)
        if canon is not None and arg == "layers" and not canon:
            canon = None  # an empty layer list is accepted (nothing cut); keep the oracle simple
            spec = [0]
            canon = [0]

        def run(model=model, arg=arg, spec=spec):
            with knockout(model, **(base | {arg: spec})):
                return model(TOKENS)

        def oracle(model=model, arg=arg, canon=canon):
            with knockout(model, **(base | {arg: None if canon == "all" else canon})):
                return model(TOKENS)

        cases.append(Case(f"knockout {type(model).__name__} {arg}={spec!r}", run, (arg,),
                          oracle if canon is not None else None))
    return cases


def ablation_cases(rng: random.Random, llama, count: int) -> list[Case]:
    cases = []
    for _ in range(count):
        layer, head = index_pool(rng, 2), index_pool(rng, 4)
        spec = (layer, head)
        cl, ch = ref_indices(layer, 2), ref_indices(head, 4)
        valid = cl is not None and ch is not None and len(cl) == 1 and len(ch) == 1 and \
            not isinstance(layer, (list, tuple, range, np.ndarray)) and not isinstance(head, (list, tuple, range, np.ndarray)) \
            and not (torch.is_tensor(layer) and layer.ndim) and not (torch.is_tensor(head) and head.ndim)

        def run(spec=spec):
            with ablate_heads(llama, [spec]):
                return llama(TOKENS)

        def oracle(l=cl, h=ch):
            def zero(z, hook):
                z = z.clone()
                z[:, :, h[0]] = 0
                return z
            return llama.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{l[0]}.attn.hook_z", zero)])

        cases.append(Case(f"ablate_heads {spec!r}", run, ("head", "layer"), oracle if valid else None))
    return cases


HOOK_AXES = {  # hook -> {axis: (dim, length)}
    "blocks.0.hook_resid_pre": {"pos": (1, POS)},
    "blocks.1.attn.hook_z": {"pos": (1, POS), "head": (2, 4)},
    "blocks.0.attn.hook_pattern": {"pos": (2, POS), "head": (1, 4)},
}


def patch_cases(rng: random.Random, llama, clean, count: int) -> list[Case]:
    corrupted = TOKENS.flip(-1)
    cases = []
    for _ in range(count):
        name = rng.choice(list(HOOK_AXES))
        axes = rng.sample(["pos", "head", "channel", "layer", "bogus"], rng.randrange(1, 3))
        index = {a: (rng.randrange(-6, 6) if rng.random() < 0.7 else index_pool(rng, 4)) for a in axes}
        valid = all(("head" if a == "channel" else a) in HOOK_AXES[name] for a in axes) and \
            not {"head", "channel"} <= set(axes)  # two names for one axis
        canon = {}
        for a, v in index.items():
            if not valid:
                break
            dim, length = HOOK_AXES[name]["head" if a == "channel" else a]
            c = ref_indices(v, length)
            if c is None or len(c) != 1 or isinstance(v, (list, tuple, range, np.ndarray)) or \
                    (torch.is_tensor(v) and v.ndim):
                valid = False
            else:
                canon[dim] = c[0]
        if len(canon) != len(index):
            valid = False

        def run(name=name, index=index):
            return patch(llama, corrupted, clean, name, index=index)

        def oracle(name=name, canon=canon):
            def by_hand(act, hook):
                act = act.clone()
                where = [slice(None)] * act.ndim
                for d, i in canon.items():
                    where[d] = i
                act[tuple(where)] = clean[name][tuple(where)]
                return act
            return llama.run_with_hooks(corrupted, fwd_hooks=[(name, by_hand)])

        cases.append(Case(f"patch {name} index={index!r}", run, ("axis", "index", "axes"), oracle if valid else None))
    return cases


def token_cases(rng: random.Random, llama, count: int) -> list[Case]:
    cases = []
    for _ in range(count):
        kind = rng.randrange(9)
        ids = torch.tensor([rng.randrange(64) for _ in range(4)])
        spec, canon, names = {
            0: (ids, ids[None], ()), 1: (ids[None].to(torch.int32), ids[None], ()),
            2: (ids.float(), None, ("integer tensor",)), 3: (ids.bool(), None, ("integer tensor",)),
            4: (ids[None, None], None, ("[batch pos]",)), 5: (ids[:0][None], None, ("pos >= 1",)),
            6: (torch.tensor([[1, 64]]), None, ("outside the vocabulary",)),
            7: (torch.tensor([[-1, 3]]), None, ("outside the vocabulary",)),
            8: (ids.tolist(), None, ("tokens must be a tensor",)),
        }[kind]

        def run(spec=spec):
            return llama(spec)

        cases.append(Case(f"tokens kind {kind}", run, names, (lambda c=canon: llama(c)) if canon is not None else None))
    for _ in range(count // 2):
        kind = rng.randrange(6)
        ones = torch.ones(1, POS, dtype=torch.long)
        mask, valid, names = {
            0: (ones, True, ()), 1: (ones.bool(), True, ()), 2: (ones * 2, False, ("only 0 and 1",)),
            3: (torch.ones(1, POS - 1, dtype=torch.long), False, ("attention_mask has shape",)),
            4: (torch.ones(2, POS, dtype=torch.long), False, ("attention_mask has shape",)),
            5: (ones[0], True, ()),
        }[kind]
        cases.append(Case(f"attention_mask kind {kind}", lambda m=mask: llama(TOKENS, m), names,
                          (lambda: llama(TOKENS)) if valid else None))
    return cases


def hook_cases(rng: random.Random, llama, count: int) -> list[Case]:
    fns = {  # name -> (fn, valid, words of the expected error)
        "none": (lambda x, h: None, True, ()), "same": (lambda x, h: x, True, ()),
        "times one": (lambda x, h: x * 1.0, True, ()),
        "shape": (lambda x, h: x[..., :-1], False, ("returned shape",)),
        "dtype": (lambda x, h: x.double(), False, ("dtype",)),
        "int": (lambda x, h: 3, False, ("returned int",)),
        "raises": (lambda x, h: (_ for _ in ()).throw(ValueError("user boom")), False, ("user boom",)),
        "not callable": (5, False, ("callable",)),
    }
    names = {"blocks.0.hook_resid_pre": True, "blocks.1.attn.hook_z": True, "hook_embed": True,
             "blocks.0.hook_resid_pr": False, "blocks.9.hook_resid_pre": False, "": False}
    cases = []
    for _ in range(count):
        fn_name = rng.choice(list(fns))
        fn, fn_ok, words = fns[fn_name]
        name = rng.choice(list(names) + [3, lambda n: n.endswith("resid_pre")])
        name_ok = callable(name) or names.get(name, False)
        how = rng.choice(["run_with_hooks", "hooks", "bwd"])
        expected_words = (words if name_ok else ("unknown hook name", "hook name")) + ("fwd_hooks", "bwd_hooks")
        if how == "bwd":  # a backward hook runs on the gradient; the forward itself is untouched
            fn_ok = fn_ok or fn_name != "not callable"
            expected_words = ("callable",) if name_ok else expected_words

        def run(fn=fn, name=name, how=how):
            if how == "run_with_hooks":
                return llama.run_with_hooks(TOKENS, fwd_hooks=[(name, fn)])
            if how == "bwd":
                with llama.hooks(bwd_hooks=[(name, fn)]):
                    return llama(TOKENS)
            with llama.hooks(fwd_hooks=[(name, fn)]):
                return llama(TOKENS)

        valid = fn_ok and name_ok
        cases.append(Case(f"hook {fn_name} on {name!r} via {how}", run, expected_words,
                          (lambda: llama(TOKENS)) if valid else None))
    return cases


def nested_scope_cases(rng: random.Random, llama, count: int) -> list[Case]:
    """Random enter / exit orders of scoped hooks and model hooks, each scaling resid_pre by a power of
    two; the oracle is one hook scaling by the product (exact in floating point)."""
    point = llama.hook_dict["blocks.0.hook_resid_pre"]
    cases = []
    for c in range(count):
        ops = [rng.choice(["enter", "enter", "exit", "model", "unmodel"]) for _ in range(rng.randrange(2, 9))]

        def run(ops=ops, c=c):
            local = random.Random(c)
            open_scopes, model_hooks, results = [], [], []
            try:
                for op in ops:
                    scale = local.choice([0.5, 2.0, 4.0])
                    if op == "enter":
                        scope = scoped_hooks([(point, lambda x, h, s=scale: x * s, local.random() < 0.3)])
                        scope.__enter__()
                        open_scopes.append((scope, scale))
                    elif op == "exit" and open_scopes:
                        scope, _ = open_scopes.pop(local.randrange(len(open_scopes)))  # any order
                        scope.__exit__(None, None, None)
                    elif op == "model":
                        model_hooks.append((point.add_hook(lambda x, h, s=scale: x * s), scale))
                    elif op == "unmodel" and model_hooks:
                        remove, _ = model_hooks.pop(local.randrange(len(model_hooks)))
                        remove()
                    total = float(np.prod([s for _, s in open_scopes + model_hooks]))
                    results.append((llama(TOKENS), total))
            finally:
                for scope, _ in open_scopes:
                    scope.__exit__(None, None, None)
                for remove, _ in model_hooks:
                    remove()
            return results

        def same(results, _):
            return all(torch.equal(out, llama.run_with_hooks(
                TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, h, t=total: x * t)])) for out, total in results)

        cases.append(Case(f"nested scopes {ops}", run, (), lambda: None, same))
    return cases


def analysis_cases(rng: random.Random, llama, mamba, clean, count: int) -> list[Case]:
    cases = []
    metric = lambda logits: logits[0, -1, 3]  # noqa: E731
    for _ in range(count):
        what = rng.choice(["decay_split", "act_patch", "info_flow", "replace_block"])
        spec = index_pool(rng, 2)
        canon = ref_indices(spec, 2)
        single = canon is not None and len(canon) == 1 and not isinstance(spec, (list, tuple, range, np.ndarray)) \
            and not (torch.is_tensor(spec) and spec.ndim)
        if what == "decay_split":
            cases.append(Case(f"decay_split layer={spec!r}", lambda s=spec: decay_split(mamba, s).slowest, ("layer",),
                              (lambda c=canon: decay_split(mamba, c[0]).slowest) if single else None))
        elif what == "act_patch":
            valid = canon is not None and len(canon) > 0
            cases.append(Case(f"act_patch layers={spec!r}", lambda s=spec: act_patch(
                llama, TOKENS.flip(-1), clean, metric, "blocks.{layer}.hook_resid_pre", over=("layer",), layers=s),
                ("layers",), (lambda c=canon: act_patch(llama, TOKENS.flip(-1), clean, metric,
                                                       "blocks.{layer}.hook_resid_pre", over=("layer",), layers=c))
                if valid else None, lambda a, b: torch.equal(a.nan_to_num(-9), b.nan_to_num(-9))))
        elif what == "info_flow":  # arguments are checked before the tokenizer is needed
            window = rng.choice([0, -1, 2.5, "3", 2])
            words = ("starts",) if window == 2 else ("window",)
            cases.append(Case(f"info_flow starts={spec!r} window={window!r}",
                              lambda s=spec, w=window: info_flow(llama, [], starts=s, window=w),
                              words + ("tokenizer",) if canon is not None and window == 2 else words))
        else:
            cases.append(Case(f"replace_block layer={spec!r}", lambda s=spec: _swap(llama, s), ("layer",),
                              (lambda: llama(TOKENS)) if single else None))
    return cases


def _swap(model, layer):
    with replace_block(model, layer, model):
        return model(TOKENS)


# ----------------------------------------------------------------------------- checkpoints
SIZE_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "max_position_embeddings", "head_dim"]


def config_cases(rng: random.Random, saved, tmp, count: int) -> list[Case]:
    reference = from_pretrained(saved)(TOKENS)
    cases = []
    for c in range(count):
        field = rng.choice(SIZE_FIELDS + ["dtype", "rms_norm_eps", "WHOLE"])
        value = rng.choice([-3, 0, 2.5, "8", True, None, [4], 1e9, 64, 2048, "int8", "float16"])
        d = tmp / f"config{c}"

        def run(field=field, value=value, d=d):
            shutil.copytree(saved, d)
            cfg = json.loads((d / "config.json").read_text())
            if field == "WHOLE":
                cfg = [cfg] if value is None else value
            else:
                cfg[field] = value
            (d / "config.json").write_text(json.dumps(cfg))
            return from_pretrained(d)(TOKENS)

        # valid: the value the checkpoint already has, or one that changes no tensor shape
        original = json.loads((saved / "config.json").read_text()).get(field)
        valid = (field != "WHOLE" and value == original and type(value) is type(original)) or \
            (field == "max_position_embeddings" and isinstance(value, int) and not isinstance(value, bool)
             and value >= 64) or (field in ("num_key_value_heads", "head_dim") and value is None and field == "head_dim")
        words = (str(field), "checkpoint does not fit", "config") if field != "WHOLE" else ("config",)
        cases.append(Case(f"config {field}={value!r}", run, words, (lambda: reference) if valid else None))
    return cases


def _tile(shapes: list[list[int]]) -> dict:
    at, header = 0, {}
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape)) * 4
        header[f"t{i}"] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    return header


def header_cases(rng: random.Random, tmp, count: int) -> list[Case]:
    """Random headers, judged by the safetensors library itself: what it reads, we read equally;
    what it refuses, we refuse naming the file."""
    import safetensors

    cases = []
    for c in range(count):
        header = _tile([[rng.randrange(0, 4) for _ in range(rng.randrange(1, 3))] for _ in range(rng.randrange(1, 4))])
        data_len = max([e["data_offsets"][1] for e in header.values()] + [0])
        name = rng.choice(list(header))
        mutation = rng.choice(["none", "shift", "shape", "dtype", "overlap", "offsets", "extra", "truncate", "neg"])
        e = header[name]
        if mutation == "shift":
            e["data_offsets"] = [o + rng.choice([-4, 4]) for o in e["data_offsets"]]
        elif mutation == "shape":
            e["shape"] = e["shape"] + [2]
        elif mutation == "dtype":
            e["dtype"] = rng.choice(["F16", "I64", "X9", "BOOL"])
        elif mutation == "overlap" and len(header) > 1:
            other = rng.choice([k for k in header if k != name])
            header[other]["data_offsets"] = list(e["data_offsets"])
            header[other]["shape"] = list(e["shape"])
        elif mutation == "offsets":
            e["data_offsets"] = rng.choice([[0], [0, 1, 2], "0,4", [-4, 0], [0.0, 4.0]])
        elif mutation == "neg":
            e["shape"] = [-1] + e["shape"][1:]
        extra = {"extra": 4, "truncate": -4}.get(mutation, 0)
        path = tmp / f"h{c}.safetensors"
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(rng.randrange(256) for _ in range(max(data_len + extra, 0))))
        try:
            with safetensors.safe_open(str(path), "pt") as f:
                library = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
        except Exception:  # noqa: BLE001 - the library refused the file
            library = None

        def run(path=path):
            f = SafetensorsFile(path)
            return {k: f.read(k) for k in f.tensors}

        def same(ours, theirs):
            return ours.keys() == theirs.keys() and all(  # bitwise: random bytes make NaNs
                ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape and torch.equal(
                    ours[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8)) for k in ours)

        cases.append(Case(f"safetensors {mutation} {header}", run, (str(path),),
                          (lambda lib=library: lib) if library is not None else None, same))
    return cases


def shard_cases(rng: random.Random, saved, tmp, count: int) -> list[Case]:
    """Index files naming random shard paths: inside the checkpoint they load (logits equal the
    single-file load), anywhere else they are refused naming the index."""
    reference = from_pretrained(saved)(TOKENS)
    names = list(SafetensorsFile(saved / "model.safetensors").tensors)
    cases = []
    for c in range(count):
        d = tmp / f"ckpt{c}" / "model"
        kind = rng.choice(["same dir", "subdir", "dotted inside", "parent", "absolute", "backslash", "deep parent",
                           "empty", "number", "missing"])
        target = {"same dir": "w.safetensors", "subdir": "s/w.safetensors", "dotted inside": "s/./w.safetensors",
                  "parent": "../w.safetensors", "absolute": str(tmp / f"ckpt{c}" / "w.safetensors"),
                  "backslash": "..\\w.safetensors", "deep parent": "s/../../w.safetensors", "empty": "",
                  "number": 7, "missing": "nope.safetensors"}[kind]
        inside = kind in ("same dir", "subdir", "dotted inside")

        def run(d=d, target=target, kind=kind):
            d.mkdir(parents=True)
            (d / "config.json").write_text((saved / "config.json").read_text())
            where = {"same dir": d, "subdir": d / "s", "dotted inside": d / "s"}.get(kind, d.parent)
            where.mkdir(parents=True, exist_ok=True)
            shutil.copy(saved / "model.safetensors", where / "w.safetensors")
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: target for n in names}}))
            return from_pretrained(d)(TOKENS)

        cases.append(Case(f"shard {kind} {target!r}", run, ("model.safetensors.index.json",),
                          (lambda: reference) if inside else None))
    return cases


def cli_cases(rng: random.Random, tmp, count: int) -> list[Case]:
    from analysis.cli import main

    blocker = tmp / "blocker"
    blocker.write_text("")
    cases = []
    for c in range(count):
        command = rng.choice(["knockout", "ga"])
        option = rng.choice(["--n", "--batch-size"] + (["--window"] if command == "knockout" else
                                                       ["--pairs", "--top-k"]))
        value = rng.choice(["0", "-1", "-5"] + (["3,x", "", "0,3"] if option == "--pairs" else []))
        out = str(blocker / "out") if rng.random() < 0.3 else str(tmp / f"out{c}")
        argv = [command, str(tmp / "no_model"), option, value, "--out", out]
        words = (option, "--out")
        cases.append(Case(f"cli {argv}", _cli(main, argv), words))
    return cases


def _cli(main, argv):
    """Run the CLI; exit 2 with a message on stderr is judged like an exception carrying that message."""
    import contextlib
    import io

    def run():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        if code == 2 and err.getvalue():
            raise ValueError(err.getvalue())
        raise RuntimeError(f"exit {code}, stderr {err.getvalue()!r}")

    return run


# ------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def clean(llama):
    return llama.run_with_cache(TOKENS)[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64))
    d = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(d)
    return d


def test_knockout_arguments(llama, mamba):
    run_cases("knockout", knockout_cases(random.Random(SEED), llama, mamba, 90), [llama, mamba])


def test_ablation_arguments(llama):
    run_cases("ablation", ablation_cases(random.Random(SEED + 1), llama, 40), [llama])


def test_patch_indices(llama, clean):
    run_cases("patch", patch_cases(random.Random(SEED + 2), llama, clean, 50), [llama])


def test_inputs(llama):
    run_cases("inputs", token_cases(random.Random(SEED + 3), llama, 30), [llama])


def test_hooks(llama):
    run_cases("hooks", hook_cases(random.Random(SEED + 4), llama, 80), [llama])


def test_nested_scopes(llama):
    run_cases("scopes", nested_scope_cases(random.Random(SEED + 5), llama, 25), [llama])


def test_analysis_arguments(llama, mamba, clean):
    run_cases("analysis", analysis_cases(random.Random(SEED + 6), llama, mamba, clean, 40), [llama, mamba])


def test_config_values(saved, tmp_path, llama):
    run_cases("config", config_cases(random.Random(SEED + 7), saved, tmp_path, 40), [llama])


def test_safetensors_headers(tmp_path, llama):
    run_cases("safetensors", header_cases(random.Random(SEED + 8), tmp_path, 100), [llama])


def test_shard_paths(saved, tmp_path, llama):
    run_cases("shards", shard_cases(random.Random(SEED + 10), saved, tmp_path, 20), [llama])


def test_cli(tmp_path, llama):
    run_cases("cli", cli_cases(random.Random(SEED + 9), tmp_path, 20), [llama])


def test_counts():
    """Print the totals (pytest -s); zero silent-wrong, refused-valid and unnamed crashes."""
    print(f"\nfuzz: {COUNTS['cases']} cases, {COUNTS['clear error']} clear errors, {COUNTS['verified']} verified, "
          f"{COUNTS['silent-wrong']} silent-wrong, {COUNTS['refused-valid']} refused-valid, "
          f"{COUNTS['unnamed crash']} unnamed crashes, {COUNTS['model changed']} model changes")
    assert COUNTS["silent-wrong"] == COUNTS["refused-valid"] == COUNTS["unnamed crash"] == 0
    assert not FAILURES
