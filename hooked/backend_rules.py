"""Which backend a mixer or attention layer takes for one forward: pure rules, no state.

Glossary
    scan backend       "loop" (selective_scan / ssd_chunked: every state hook available),
                       "chunked" (ops/scan_chunked.py: few launches, for GPUs without mamba-ssm;
                       every state hook available too, equal to "loop" but for rounding),
                       "fused" (ops/fused.py: mamba-ssm's kernels, or their stand-ins when forced;
                       y and the last state only)
    attention backend  "eager" (scores and pattern built, hookable) or "sdpa" (ops/sdpa.py)
    exact hooks        hooks whose quantity only the exact path builds: an SSM's per-position states
                       and kernel, attention's scores and pattern, the soft-cap's input and output.
                       Knockout and every analysis that edits those attach such hooks, so they get
                       the exact path too
    forced             what `backends.use(scan=..., attention=...)` demands (None: the default rule)

An active exact hook always wins over a forced fast backend ("fused", "sdpa"): its hook must fire
with the quantity it names. The fast paths feed the same hooked tensors into the kernels (hook_in, hook_conv, hook_dt,
hook_B, hook_C, hook_ssm_in, hook_y, ... still fire and edits to them propagate).
"""

from __future__ import annotations

from collections.abc import Iterable

SCANS = ("loop", "chunked", "fused")
ATTENTIONS = ("eager", "sdpa")
EXACT_SCAN_HOOKS = ("hook_A_bar", "hook_B_bar", "hook_h", "hook_kernel")
EXACT_ATTENTION_HOOKS = ("hook_attn_scores", "hook_pattern", "softcap.hook_in", "softcap.hook_out")


def needs_exact(active_hooks: Iterable[str]) -> bool:
    """Whether any of these active hook names (full or relative) is one only the exact path builds."""
    suffixes = EXACT_SCAN_HOOKS + EXACT_ATTENTION_HOOKS
    return any(name == s or name.endswith("." + s) for name in active_hooks for s in suffixes)


def choose_scan(*, exact: bool, forced: str | None = None, on_cuda: bool = False, fused_importable: bool = False,
                has_initial_state: bool = False, kernel_dtype: bool = True) -> str:
    """The scan backend. The forced one, else the device's: "loop" on CPU (where it is the fastest:
    one chunk stays in cache), on CUDA "fused" with mamba-ssm importable, else "chunked". "fused"
    is replaced by the device's exact algorithm ("loop" on CPU, "chunked" on CUDA) when an exact
    hook is active (the kernel builds no state), with an initial state (Mamba-1's kernel takes none)
    or a dtype the kernels do not take (kernel_dtype=False: float64). "loop" and "chunked" both
    build every state: an exact hook keeps them, on CUDA too (the chunked one in few launches)."""
    if forced is not None and forced not in SCANS:
        raise ValueError(f"scan backend must be one of {SCANS}, got {forced!r}")
    exact_default = "chunked" if on_cuda else "loop"
    choice = forced or ("fused" if on_cuda and fused_importable else exact_default)
    if choice == "fused" and (exact or has_initial_state or not kernel_dtype):
        return exact_default
    return choice


def choose_attention(*, exact: bool, forced: str | None = None, softcap: bool = False,
                     shared_past: bool = False, on_cuda: bool = True, windowed: bool = False) -> str:
    """The attention backend: "eager" when an exact hook is active, for a soft-capped layer (SDPA
    cannot cap its scores) and for a selected state's shared past (its keys are read in place through
    a row map, shared_kv.py); else the forced one, else "sdpa", except a sliding window on CPU:
    there SDPA takes the window as an explicit mask on its math path, slower than eager (measured
    1.1-1.2x on Mistral and Gemma 3, benchmarks/bench_checkouts.py)."""
    if forced is not None and forced not in ATTENTIONS:
        raise ValueError(f"attention backend must be one of {ATTENTIONS}, got {forced!r}")
    if exact or softcap or shared_past:
        return "eager"
    return forced or ("eager" if windowed and not on_cuda else "sdpa")
