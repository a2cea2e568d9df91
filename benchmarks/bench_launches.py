"""Tensor ops per layer per forward under each backend: on a GPU each op is a kernel launch.

    python benchmarks/bench_launches.py [--lengths 256 1024 2048] [--families mamba llama ...]

A dispatch counter counts every aten op a block runs (views excluded: they launch nothing), batch 1,
tiny widths (the count does not depend on the width), no hooks, no autograd. One row per family,
layer kind ("mamba" for a Mamba-1 mixer layer, "attn", "mamba2", "hybrid" for a Zamba2 layer with the
shared transformer, "+moe" with experts) and backend setting:
    exact     scan "loop", attention "eager" (what every forward ran before the backends existed)
    chunked   the two-level scan (ops/scan_chunked.py), SDPA: a GPU without mamba-ssm
    fused     mamba-ssm's kernels, SDPA: each kernel call counted as one launch (its CPU stand-in's ops
              are not counted)
    +hook_h   chunked with an identity hook on every mixer's hook_h: the states built in few launches
    kernels   (--kernels) the installed kernels themselves (mamba-ssm's Triton SSD, state update and gated
              norm, fla's conv and delta rules), each call counted as one launch and its own ops not:
              run in .venv-triton, where tests/triton_shims.py lets them run on the CPU under Triton's
              interpreter (slow: use short --lengths); the count is what a GPU launches outside them
The target for the GPU algorithms: Mamba-1 at most 300 ops per layer at 2,048 tokens, growing at most
as L / 64. The two-level scan's chunk is about sqrt(L), so its scan costs about 2 sqrt(L) ops, which
is at most 64 + L / 64 at every L (equal at L = 4,096): below the line of a fixed 64-token chunk,
though between two short lengths it grows faster than that line. Run it against another checkout
(PYTHONPATH=that checkout) for "today": where hooked has no backends module, only the exact row is
printed. Measured (this CPU; the counts do not depend on the machine), ops per layer at 256 / 1,024 /
2,048 tokens:
    Mamba-1  exact 479 / 1,823 / 3,615   chunked 71 / 103 / 135   fused 30   chunked + hook_h 113 / 177 / 241
    Mamba-2  exact 77 / 91 / 91          fused 36 / 34 / 34       chunked + hook_h 121 / 167 / 199
    Llama    eager 64                    SDPA 45 (66 before: the rotary table read the positions' max)
    Jamba    Mamba + MoE layer: exact 527 / 1,871 / 3,663 (555 / 1,899 / 3,691 before), chunked 119 / 151 / 183
On the kernel path (--kernels, .venv-triton, issue 44), ops per layer at 64 / 256 tokens, flat in L:
    Mamba-2 layer      kernels 25 (fla conv, mamba_chunk_scan_combined, rmsnorm_fn)   fused stand-ins 36   exact 77
    Zamba2 hybrid      kernels 65                                                     fused stand-ins 76   exact 129
    Qwen3-Next delta   kernels 68 (fla conv, chunk_gated_delta_rule)   exact 119 / 263
    Kimi KDA           kernels 75 (fla conv, chunk_kda)                exact 126 / 270
    LFM2 conv          kernels 31 (fla conv)                           exact 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hooked.models import jamba, kimi_linear, lfm2, llama, mamba, mamba2, qwen3_next, zamba2

try:
    from hooked import backends
    from hooked.ops.fused import REFERENCE, Kernels
except ImportError:  # a checkout from before the backends
    backends = None

D_MODEL, VOCAB = 64, 256


def configs() -> dict:
    return {
        "mamba": mamba.MambaConfig(n_layers=2, d_model=D_MODEL, d_vocab=VOCAB),
        "falcon_mamba": mamba.MambaConfig(n_layers=2, d_model=D_MODEL, d_vocab=VOCAB, mixer_rms_eps=1e-6),
        "mamba2": mamba2.Mamba2Config(n_layers=2, d_model=D_MODEL, n_heads=4, d_head=32, d_state=16, d_vocab=VOCAB),
        "zamba2": zamba2.Zamba2Config(n_layers=2, d_model=D_MODEL, d_vocab=VOCAB, layer_types=["mamba", "hybrid"],
                                      n_heads=4, d_state=16, n_attn_heads=4),
        "qwen3_next": qwen3_next.Qwen3NextConfig(d_model=D_MODEL, d_vocab=VOCAB, layer_types=["delta", "attention"],
                                                 n_heads=4, n_k_heads=2, d_k=16, d_v=16, n_attn_heads=4,
                                                 n_attn_kv_heads=2, d_attn_head=16, d_mlp=128),
        "kimi_linear": kimi_linear.KimiLinearConfig(d_model=D_MODEL, d_vocab=VOCAB, layer_types=["delta", "attention"],
                                                    mlp_types=["dense", "dense"], n_heads=4, d_k=16, d_mlp=128,
                                                    n_attn_heads=4, d_nope=16, d_rope=8, d_attn_head=16, kv_rank=32),
        "lfm2": lfm2.Lfm2Config(d_model=D_MODEL, d_vocab=VOCAB, layer_types=["conv", "attention"], n_heads=4,
                                d_mlp=128),
        "llama": llama.LlamaConfig(n_layers=2, d_model=D_MODEL, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=128,
                                   d_vocab=VOCAB),
        "jamba": jamba.JambaConfig(n_layers=2, d_model=D_MODEL, d_vocab=VOCAB, d_mlp=128,
                                   layer_types=["mamba", "attention"], mlp_types=["moe", "mlp"], n_attn_heads=4,
                                   n_experts=4),
    }


class OpCount(TorchDispatchMode):
    """Non-view aten ops, attributed to the block running (None outside blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None
        self.paused = False
        self.ops: dict[int, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.block is not None and not self.paused and not func.is_view:
            self.ops[self.block] += 1
        return func(*args, **(kwargs or {}))


def one_launch_kernels(counter: OpCount, base: "Kernels | None" = None) -> "Kernels":
    """The stand-ins (or `base`'s kernels, taking any device), each call counted as one launch (the real
    kernel's), their own ops not counted."""
    def wrap(fn):
        def kernel(*args, **kwargs):
            counter.ops[counter.block] += 1
            counter.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused = False
        return kernel
    if base is not None:
        fields = {f.name: wrap(getattr(base, f.name)) for f in dataclasses.fields(base)
                  if callable(getattr(base, f.name))}
        return dataclasses.replace(base, **fields, real=False)
    return Kernels(*(wrap(getattr(REFERENCE, n)) for n in ("selective_scan_fn", "causal_conv1d_fn",
                                                            "mamba_chunk_scan_combined")), real=False)


def kind(block: torch.nn.Module) -> str:
    names = {type(m).__name__ for m in block.modules()}
    base = ("hybrid" if "SharedTransformer" in names else
            "mamba2" if "Mamba2Mixer" in names else "mamba" if "MambaMixer" in names else
            "kda" if "KimiDeltaMixer" in names else "delta" if any("DeltaMixer" in n for n in names) else
            "conv" if "GatedShortConv" in names else "attn")
    return base + ("+moe" if "MoE" in names else "")


def count(model, tokens: torch.Tensor, setting: str, installed: "Kernels | None" = None) -> dict[str, float]:
    counter = OpCount()
    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "block", i)))
        handles.append(block.register_forward_hook(lambda m, a, o: setattr(counter, "block", None)))
    scan, attention = {"exact": ("loop", "eager"), "chunked": ("chunked", "sdpa"), "fused": ("fused", "sdpa"),
                       "+hook_h": ("chunked", "sdpa"), "kernels": ("fused", "sdpa")}[setting]
    with contextlib.ExitStack() as stack:
        if backends is not None:
            stack.enter_context(backends.use(scan=scan, attention=attention))
            if setting in ("fused", "kernels"):
                old = backends.fused_kernels
                counted = one_launch_kernels(counter, installed if setting == "kernels" else None)
                backends.fused_kernels = lambda device: counted
                stack.callback(setattr, backends, "fused_kernels", old)
        if setting == "+hook_h":
            stack.enter_context(model.hooks(fwd_hooks=[(lambda n: n.endswith("mixer.hook_h"), lambda x, h: None)]))
        stack.enter_context(torch.no_grad())
        stack.enter_context(counter)
        model(tokens)
    for h in handles:
        h.remove()
    per_kind: dict[str, list[int]] = defaultdict(list)
    for i, block in enumerate(model.blocks):
        per_kind[kind(block)].append(counter.ops[i])
    return {k: sum(v) / len(v) for k, v in per_kind.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--families", nargs="+", default=list(configs()))
    parser.add_argument("--kernels", action="store_true", help="also count the installed kernels (.venv-triton)")
    args = parser.parse_args(argv)
    installed = None
    if args.kernels:  # the tier's shims first: TRITON_INTERPRET=1 before anything imports triton
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import triton_shims

        if triton_shims.missing():
            raise SystemExit(f"--kernels needs {', '.join(triton_shims.missing())}: {triton_shims.SETUP}")
        triton_shims.install()
        from hooked.ops.fused import mamba_ssm_kernels

        installed = dataclasses.replace(mamba_ssm_kernels(), selective_scan_fn=None, causal_conv1d_fn=None)
    from hooked.models.families import build

    settings = ["exact"] if backends is None else ["exact", "chunked", "fused", "+hook_h"]
    settings += ["kernels"] if installed is not None else []
    print(f"{'family':<13} {'layer':<10} {'setting':<8} " + " ".join(f"{f'L={L}':>8}" for L in args.lengths)
          + "   growth per L/64")
    for family in args.families:
        torch.manual_seed(0)
        model = build(configs()[family]).eval()
        ssm = any(name.endswith("mixer.hook_h") for name in model.hook_dict)
        rows: dict[tuple[str, str], list[float]] = defaultdict(list)
        for L in args.lengths:
            tokens = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(L))
            for setting in settings:
                if setting == "+hook_h" and not ssm:
                    continue
                for k, n in count(model, tokens, setting, installed).items():
                    rows[(k, setting)].append(n)
        for (k, setting), ns in sorted(rows.items(), key=lambda r: (r[0][0], settings.index(r[0][1]))):
            growth = (ns[-1] - ns[0]) / ((args.lengths[-1] - args.lengths[0]) / 64) if len(ns) > 1 else math.nan
            print(f"{family:<13} {k:<10} {setting:<8} " + " ".join(f"{n:>8.0f}" for n in ns) + f"   {growth:>8.2f}")


if __name__ == "__main__":
    main()
