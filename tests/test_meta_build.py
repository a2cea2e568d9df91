"""Loading leaves no process-wide state; the meta build keeps computed buffers (and refills the
uninitialised ones with reset_buffers); placement keywords are one checked value; the loaders'
shape: a static registry, and family loaders that import no other family."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from loaders import from_pretrained
from loaders.architecture import Architecture
from loaders.load import load_gguf
from loaders.meta import build_on_meta, on_meta
from loaders.placement import Placement
from loaders.registry import ARCHITECTURES, find_architecture

ROOT = Path(__file__).resolve().parents[1]

TINY = {  # name -> (HF config class, HF model class, config fields)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=24, vocab_size=40)),
    "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM,  # a computed buffer (muP in_scale)
                  dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                       mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, mamba_d_ssm=32,
                       intermediate_size=24, vocab_size=40, ssm_multipliers=[0.5, 1.2, 0.8, 1.5, 0.7])),
}

CHILD = r"""
import json, sys
import torch
from torch.nn.modules import module as torch_module
import torch.utils._device

def state():
    hooks = {k: [repr(v) for v in getattr(torch_module, k).values()] for k in sorted(vars(torch_module))
             if k.startswith("_global_") and isinstance(getattr(torch_module, k), dict)}
    return {"hooks": hooks, "modes": torch._C._len_torch_function_stack(),
            "default_device": repr(torch.utils._device.CURRENT_DEVICE),
            "get_default_device": str(torch.get_default_device()),
            "register_parameter": repr(torch.nn.Module.register_parameter),
            "init": sorted(map(repr, vars(torch.nn.init).values()))}

before = state()
import loaders
imported = state()
dynamo_before = "torch._dynamo" in sys.modules
model = loaders.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
print(json.dumps({"before": before, "imported": imported, "loaded": state(), "hook_dicts": len(before["hooks"]),
                  "dynamo_imported_by_load": not dynamo_before and "torch._dynamo" in sys.modules}))
"""


@pytest.mark.parametrize("family", list(TINY))
def test_importing_and_loading_leave_torch_global_state_unchanged(family, tmp_path):
    """In a fresh process: torch's global module / parameter / buffer registration hooks (every
    `_global_*` dict of torch.nn.modules.module), its function-mode stack, default device, nn.init
    and Module.register_parameter are the same before `import loaders`, after it, and after a load
    and a forward; and the load did not import torch._dynamo (meta arithmetic would)."""
    config_cls, model_cls, fields = TINY[family]
    torch.manual_seed(0)
    model_cls(config_cls(**fields)).save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hook_dicts"] >= 3  # parameter, buffer and module registration hooks at least
    assert got["before"] == got["imported"] == got["loaded"]
    assert not got["dynamo_imported_by_load"]


# ------------------------------------------------------------------------------------- meta build
class Computed(nn.Module):
    """Buffers made from values (kept as computed) and one made empty and filled by reset_buffers."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.gain = nn.Parameter(torch.ones(n))  # a parameter made from values
        self.lin.extra = self.gain  # the same parameter under a second name
        self.register_buffer("ramp", torch.arange(n, dtype=torch.float32) * 0.5, persistent=False)
        self.register_buffer("table", torch.empty(n, 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.table.copy_(torch.linspace(-1, 1, 2 * self.table.shape[0]).view(-1, 2))


class FilledInPlace(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(n).fill_(3.0), persistent=False)


class AttributeFilledInPlace(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.cache = torch.empty(n).fill_(3.0)


def test_meta_build_keeps_computed_buffers_and_refills_uninitialised_ones():
    model = build_on_meta(Computed, 6)
    assert all(p.is_meta for p in model.parameters())
    assert model.lin.extra is model.gain  # ties survive
    torch.testing.assert_close(model.ramp, torch.arange(6, dtype=torch.float32) * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(model.table, torch.linspace(-1, 1, 12).view(6, 2), rtol=0, atol=0)
    assert not model.ramp.is_meta and not model.table.is_meta


@pytest.mark.parametrize("cls, name", [(FilledInPlace, "table"), (AttributeFilledInPlace, "cache")])
def test_meta_build_refuses_an_uninitialised_tensor_nothing_refills(cls, name):
    with pytest.raises(TypeError, match=rf"{name} .*reset_buffers"):
        build_on_meta(cls, 4)


def test_meta_mode_is_per_thread():
    """While one thread is inside on_meta(), another builds real, initialised modules."""
    inside, release, built = threading.Event(), threading.Event(), {}

    def hold():
        with on_meta():
            built["meta"] = nn.Linear(8, 8)
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    try:
        layer = nn.Linear(8, 8)
    finally:
        release.set()
        t.join()
    assert built["meta"].weight.is_meta
    assert not layer.weight.is_meta and layer.weight.abs().sum() > 0


# -------------------------------------------------------------------------------------- placement
def test_placement_keywords_are_checked():
    with pytest.raises(TypeError, match="bogus"):
        Placement(bogus=1)
    with pytest.raises(ValueError, match="max_memory= only apply to a load with a device_map"):
        Placement(max_memory={"cpu": 10})
    with pytest.raises(ValueError, match="offload_folder= only apply"):
        Placement(offload_folder="x")
    with pytest.raises(ValueError, match="mmap=True .*device='meta'"):
        Placement(device="meta", mmap=True)
    assert Placement().maps and not Placement(mmap=False).maps
    assert not Placement(device="meta").maps and not Placement(device_map="auto").maps
    assert Placement(device="cpu") == Placement()
    assert Placement(offload_folder="x", device_map="auto").offload_folder == Path("x")


def test_from_pretrained_names_an_unknown_keyword(tmp_path):
    with pytest.raises(TypeError, match="devise"):
        from_pretrained(tmp_path, devise="cpu")


def test_load_gguf_refuses_mmap(tmp_path):
    from test_gguf import write_tiny

    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    with pytest.raises(ValueError, match="mmap=True cannot apply to a GGUF file"):
        load_gguf(path, Placement(mmap=True))
    with pytest.raises(TypeError, match="mmap"):
        load_gguf(path, mmap=True)


# ------------------------------------------------------------------------------ loaders' shape
SHARED = {"loaders.architecture", "loaders.keymaps", "loaders.checkpoint_view"}


def family_modules() -> dict[str, Path]:
    """loaders/*.py files that define an Architecture at module level."""
    out = {}
    for path in sorted((ROOT / "loaders").glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and getattr(node.value.func, "id", None) == "Architecture" for node in tree.body):
            out[f"loaders.{path.stem}"] = path
    return out


def loaders_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "loaders":
                found |= {f"loaders.{a.name}" for a in node.names}
            elif node.module.startswith("loaders."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("loaders")}
    return found


def test_family_loaders_import_no_other_family():
    families = family_modules()
    assert len(families) >= 15
    for module, path in families.items():
        assert loaders_imports(path) <= SHARED, (module, loaders_imports(path) - SHARED)


def test_registry_lists_every_architecture_and_finds_each():
    import importlib

    defined = {id(v) for module in family_modules() for v in vars(importlib.import_module(module)).values()
               if isinstance(v, Architecture)}
    assert defined == {id(a) for a in ARCHITECTURES}
    for arch in ARCHITECTURES:
        for cls in arch.hf_classes:
            assert find_architecture({"architectures": [cls]}) is arch
        for model_type in arch.model_types:
            assert find_architecture({"model_type": model_type}) is arch
