"""GPT-2 checkpoints (HF `GPT2LMHeadModel`) -> `hooked.models.gpt2.GPT2`.

Glossary
    Conv1D     HF GPT-2's linear layer, weight stored [in out] (transposed from nn.Linear's [out in])
    c_attn     fused q, k, v projection: weight [d_model 3*d_model], bias [3*d_model], in that order
    prefix     checkpoints of GPT2LMHeadModel name tensors `transformer.h.0...`; those of the bare
               GPT2Model (the original "gpt2" hub files) `h.0...`: both are accepted
    tied       with tie_word_embeddings (GPT-2's default) `lm_head.weight` is `wte.weight`: our
               `unembed.weight` is then not in the key map

Old checkpoints also hold `*.attn.bias` and `*.attn.masked_bias` (causal-mask buffers, which HF
ignores too); loaders/load.py does not count them as unexpected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from hooked.models.gpt2 import GPT2Config, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import lm_head_keys

def config_from_hf(hf: dict[str, Any]) -> GPT2Config:
    d_model = hf.get("n_embd", hf.get("hidden_size"))
    return GPT2Config(
        n_layers=hf.get("n_layer", hf.get("num_hidden_layers")),
        d_model=d_model,
        n_heads=hf.get("n_head", hf.get("num_attention_heads")),
        d_mlp=hf.get("n_inner") or 4 * d_model,
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("n_positions", hf.get("max_position_embeddings", 1024)),
        eps=hf.get("layer_norm_epsilon", 1e-5),
        act_fn=hf.get("activation_function", "gelu_new"),
        tied=hf.get("tie_word_embeddings", True),
        scale_attn_weights=hf.get("scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False),
    )


def _conv1d(rows: slice | None = None) -> Callable[[Tensor], Tensor]:
    """Conv1D weight [in out] -> nn.Linear weight [out in], optionally one slice of the outputs."""

    def transform(t: Tensor) -> Tensor:
        t = t if rows is None else t[:, rows]
        return t.t().contiguous()

    return transform


def _take(rows: slice) -> Callable[[Tensor], Tensor]:
    return lambda t: t[rows].contiguous()


def _key(name: str, transform: Callable[[Tensor], Tensor] | None = None) -> Key:
    return Key.of(f"transformer.{name}", name, transform=transform)


def key_map(cfg: GPT2Config) -> dict[str, Key]:
    d = cfg.d_model
    qkv = {"q": slice(0, d), "k": slice(d, 2 * d), "v": slice(2 * d, 3 * d)}
    keys = {
        "embed.weight": _key("wte.weight"),
        "pos_embed.weight": _key("wpe.weight"),
        "ln_final.weight": _key("ln_f.weight"),
        "ln_final.bias": _key("ln_f.bias"),
    }
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}", f"h.{l}"
        for ln_ours, ln_theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            keys[f"{ours}.{ln_ours}.weight"] = _key(f"{theirs}.{ln_theirs}.weight")
            keys[f"{ours}.{ln_ours}.bias"] = _key(f"{theirs}.{ln_theirs}.bias")
        for proj, rows in qkv.items():
            keys[f"{ours}.attn.{proj}_proj.weight"] = _key(f"{theirs}.attn.c_attn.weight", _conv1d(rows))
            keys[f"{ours}.attn.{proj}_proj.bias"] = _key(f"{theirs}.attn.c_attn.bias", _take(rows))
        keys[f"{ours}.attn.o_proj.weight"] = _key(f"{theirs}.attn.c_proj.weight", _conv1d())
        keys[f"{ours}.attn.o_proj.bias"] = _key(f"{theirs}.attn.c_proj.bias")
        keys[f"{ours}.mlp.up_proj.weight"] = _key(f"{theirs}.mlp.c_fc.weight", _conv1d())
        keys[f"{ours}.mlp.up_proj.bias"] = _key(f"{theirs}.mlp.c_fc.bias")
        keys[f"{ours}.mlp.down_proj.weight"] = _key(f"{theirs}.mlp.c_proj.weight", _conv1d())
        keys[f"{ours}.mlp.down_proj.bias"] = _key(f"{theirs}.mlp.c_proj.bias")
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="gpt2",
    hf_classes=("GPT2LMHeadModel", "GPT2Model"),
    model_types=("gpt2",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
