"""RwkvForCausalLM checkpoints (model_type "rwkv", RWKV-4) -> hooked.models.rwkv.

Glossary of HF config fields and ours: hooked/models/rwkv.py's glossary.

Key layout (as on disk, e.g. RWKV/rwkv-4-169m-pile): `rwkv.embeddings.weight`, `rwkv.blocks.0.pre_ln` (the
embedding's LayerNorm, ours `ln_embed`), `rwkv.blocks.{l}.{ln1,ln2}`, `rwkv.blocks.{l}.attention.{time_decay,
time_first, time_mix_key, time_mix_value, time_mix_receptance, key, value, receptance, output}`,
`rwkv.blocks.{l}.feed_forward.{time_mix_key, time_mix_receptance, key, receptance, value}`, `rwkv.ln_out`, `head`
(absent when tied). The weights are read as stored: HF divides the output weights by 2^(l // rescale_every) in
memory at its first eval-mode forward, which from_hf refuses (loaders/load.py).
"""

from __future__ import annotations

from typing import Any

from hooked.models.rwkv import RWKVConfig, build
from loaders.architecture import Architecture, Key


def config_from_hf(hf: dict[str, Any]) -> RWKVConfig:
    d_model, every = int(hf["hidden_size"]), int(hf.get("rescale_every", 6))
    return RWKVConfig(
        n_layers=int(hf["num_hidden_layers"]), d_model=d_model, d_vocab=int(hf["vocab_size"]),
        att_width=int(hf.get("attention_hidden_size") or d_model), d_mlp=int(hf.get("intermediate_size") or 4 * d_model),
        eps=float(hf.get("layer_norm_epsilon", 1e-5)), rescale_every=every if every > 0 else None,
        tied=bool(hf.get("tie_word_embeddings", False)), n_ctx=int(hf.get("context_length", 1024)),
    )


def _norm(ours: str, theirs: str) -> dict[str, Key]:
    return {f"{ours}.{p}": Key.of(f"{theirs}.{p}") for p in ("weight", "bias")}


def key_map(cfg: RWKVConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("rwkv.embeddings.weight"), **_norm("ln_embed", "rwkv.blocks.0.pre_ln"),
            **_norm("ln_final", "rwkv.ln_out")}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"rwkv.blocks.{layer}."
        keys |= _norm(ours + "ln1", theirs + "ln1") | _norm(ours + "ln2", theirs + "ln2")
        att, ffn = theirs + "attention.", theirs + "feed_forward."
        for p in ("time_decay", "time_first", "time_mix_key", "time_mix_value", "time_mix_receptance"):
            keys[f"{ours}mixer.{p}"] = Key.of(att + p)
        for p in ("key", "value", "receptance", "output"):
            keys[f"{ours}mixer.{p}.weight"] = Key.of(f"{att}{p}.weight")
        for p in ("time_mix_key", "time_mix_receptance"):
            keys[f"{ours}mlp.{p}"] = Key.of(ffn + p)
        for mine, p in (("up_proj", "key"), ("receptance", "receptance"), ("down_proj", "value")):
            keys[f"{ours}mlp.{mine}.weight"] = Key.of(f"{ffn}{p}.weight")
    return keys if cfg.tied else keys | {"unembed.weight": Key.of("head.weight")}


ARCHITECTURE = Architecture(
    name="rwkv",
    hf_classes=("RwkvForCausalLM",),
    model_types=("rwkv",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
