"""run_with_cache fits in memory: lazy hooks are opt-in, sizes are estimated before
the forward, and a request past the budget is refused at once with the sizes and a filter that fits.

The real-size case (a 24-layer Mamba-1 of mamba-130m's width at 1,024 tokens) runs in a subprocess
under RLIMIT_AS, so that a regression fails with a MemoryError instead of taking the machine down.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hooked.cache_budget import CacheBudgetError, estimate_cache_bytes
from hooked.models.gpt2 import GPT2Config
from hooked.models.llama import LlamaConfig
from hooked.models.mamba import MambaConfig
from hooked.models.mamba2 import Mamba2Config
from hooked.models.zamba2 import Zamba2Config
from hooked.models.families import build

LAZY = ("hook_result", "hook_A_bar", "hook_B_bar", "hook_h", "hook_kernel", "hook_head_out")
MODELS = {
    "gpt2": lambda: build(GPT2Config(n_layers=2, d_model=16, n_heads=4, d_mlp=32, d_vocab=50, n_ctx=32)),
    "llama_gqa": lambda: build(LlamaConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=24, d_vocab=50)),
    "mamba": lambda: build(MambaConfig(n_layers=2, d_model=16, d_vocab=50)),
    "mamba2": lambda: build(Mamba2Config(n_layers=2, d_model=16, n_heads=4, d_head=8, d_state=8,
                                                n_groups=2, chunk_size=8, d_vocab=50)),
    "zamba2": lambda: build(Zamba2Config(n_layers=3, layer_types=("mamba", "hybrid", "mamba"), d_model=16,
                                                d_vocab=50, n_heads=4, d_state=8, n_groups=2, chunk_size=8,
                                                n_attn_heads=4, d_mlp=24)),
}


def _tokens(batch: int, pos: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, pos), generator=torch.Generator().manual_seed(pos))


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("batch,pos", [(1, 5), (3, 17)])
def test_estimate_equals_the_cached_bytes_of_every_hook(arch, batch, pos) -> None:
    model = MODELS[arch]().eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(_tokens(batch, pos), incl_lazy=True)
    assert len(cache) == len(model.hook_dict)
    estimate = estimate_cache_bytes(model, list(cache.keys()), batch, pos)
    assert estimate == {name: t.nbytes for name, t in cache.items()}


@pytest.mark.parametrize("arch", list(MODELS))
def test_bare_cache_leaves_out_exactly_the_lazy_hooks(arch) -> None:
    model = MODELS[arch]().eval()
    tokens = _tokens(2, 6)
    with torch.no_grad():
        _, bare = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(LAZY))
    lazy = [n for n in model.hook_dict if n.endswith(LAZY)]
    assert lazy and [n for n, p in model.hook_dict.items() if p.lazy] == lazy
    assert list(bare.keys()) == [n for n in model.hook_dict if n not in lazy]
    assert list(named.keys()) == lazy  # a filter that selects lazy hooks takes them


def test_refusal_lists_sizes_and_its_filter_fits() -> None:
    model = MODELS["mamba"]().eval()
    tokens = _tokens(2, 40)
    everything = estimate_cache_bytes(model, list(model.hook_dict), 2, 40)
    budget = sum(b for n, b in everything.items() if not n.endswith(("hook_kernel", "hook_head_out", "hook_h")))
    with pytest.raises(CacheBudgetError) as err:
        model.run_with_cache(tokens, incl_lazy=True, max_cache_bytes=budget)
    msg = str(err.value)
    head_out = everything["blocks.0.mixer.hook_head_out"]
    assert re.search(rf"blocks\.\*\.mixer\.hook_head_out +2 x +{head_out / 2**20:.1f} MiB = +{2 * head_out / 2**20:.1f} MiB", msg)
    assert "kernel rows" in msg and "max_cache_bytes" in msg
    suggested = msg.split("names_filter=")[1].split(" when you asked")[0]
    names_filter = eval(suggested)  # the message's own filter
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names_filter, max_cache_bytes=budget)
    assert 0 < sum(t.nbytes for t in cache.values()) <= budget


def test_refusal_happens_before_any_hook_fires() -> None:
    model = MODELS["mamba2"]().eval()
    model.hook_dict
    fired: list[str] = []
    model.add_hook("blocks.0.hook_resid_pre", lambda x, hook: fired.append(hook.name))
    with pytest.raises(CacheBudgetError, match="over the budget"):
        model.run_with_cache(_tokens(1, 30), max_cache_bytes=1000)
    assert fired == []
    model.reset_hooks()


REAL_SIZE = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    from hooked.cache_budget import CacheBudgetError
    from hooked.models.families import build
    from hooked.models.mamba import MambaConfig
    torch.manual_seed(0)
    model = build(MambaConfig(n_layers=24, d_model=768, d_vocab=50280)).eval()  # mamba-130m's sizes
    tokens = torch.randint(0, 50280, (1, 1024))
    out = {}
    for attempt in ("refusal_first_s", "refusal_again_s"):  # the first also records the hooks (two tiny runs)
        start = time.perf_counter()
        try:
            model.run_with_cache(tokens, incl_lazy=True, max_cache_bytes=2 * 2**30)
        except CacheBudgetError as e:
            out["refusal"] = str(e)
        out[attempt] = time.perf_counter() - start
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, max_cache_bytes=2 * 2**30)
    out["bare_bytes"] = sum(t.nbytes for t in cache.values())
    out["bare_hooks"] = len(cache)
    print(json.dumps(out))
""")


def test_real_size_mamba_bare_cache_fits_and_everything_is_refused() -> None:
    limit = 6 * 2**30  # address space: torch, the 130M parameters, the forward and a bare cache
    script = REAL_SIZE.replace("AS_LIMIT", str(limit))
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"bare cache {out['bare_bytes'] / 2**30:.2f} GiB in {out['bare_hooks']} hooks; "
          f"refusal after {out['refusal_first_s']:.2f} s (first call), {out['refusal_again_s']:.3f} s (again)")
    assert 0.5 * 2**30 < out["bare_bytes"] <= 2 * 2**30
    refusal = out.get("refusal", "")
    assert "blocks.*.mixer.hook_head_out" in refusal and "hook_kernel" in refusal and "A filter that fits" in refusal
    head_out = 1024 * 1536 * 768 * 4  # [batch pos d_inner d_model] float32
    assert re.search(rf"hook_head_out +24 x +{head_out / 2**30:.2f} GiB = +{24 * head_out / 2**30:.2f} GiB", refusal)


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("remove_batch_dim", [False, True])
def test_bare_cache_computes_head_results_equal_to_the_lazy_hooks(arch, remove_batch_dim) -> None:
    model = MODELS[arch]().eval()
    tokens = _tokens(1, 7)
    with torch.no_grad():
        _, bare = model.run_with_cache(tokens, remove_batch_dim=remove_batch_dim)
        _, full = model.run_with_cache(tokens, incl_lazy=True, remove_batch_dim=remove_batch_dim)
    a, labels_a = bare.stack_head_results(return_labels=True, apply_ln=True)
    b, labels_b = full.stack_head_results(return_labels=True, apply_ln=True)
    assert labels_a == labels_b and a.shape[0] == len(labels_a) > 0
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_budget_on_gpu_follows_the_device_memory(cuda) -> None:
    from hooked.cache_budget import CACHE_BUDGET_FRACTION, available_bytes, default_budget

    model = MODELS["mamba"]().to(cuda).eval()
    free = available_bytes(torch.device(cuda))
    assert 0 < free <= torch.cuda.get_device_properties(cuda).total_memory
    assert abs(default_budget(model) - CACHE_BUDGET_FRACTION * free) <= 0.05 * free  # free memory moves a little
    with pytest.raises(CacheBudgetError, match="over the budget"):
        model.run_with_cache(_tokens(1, 8).to(cuda), incl_lazy=True, max_cache_bytes=1000)
