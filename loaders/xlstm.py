"""xLSTMForCausalLM checkpoints (model_type "xlstm") -> hooked.models.xlstm.

Glossary of HF config fields and ours: hooked/models/xlstm.py's glossary. The head widths are the ones HF's
layer builds, int(hidden_size * factor) / num_heads (its config's qk_dim / v_dim properties round up to 64,
which only its cache reads: every released size is a multiple of 64, so the two agree).

Key layout: `backbone.embeddings`, `backbone.blocks.{l}.{norm_mlstm,norm_ffn}`, `mlstm_layer.{q,k,v,
ogate_preact,igate_preact,fgate_preact,out_proj}` and `mlstm_layer.multihead_norm.weight` (weight_mode
"single"), `ffn.{proj_up_gate,proj_up,proj_down}`, `backbone.out_norm`, `lm_head` (absent when tied).
weight_mode "fused" stores `mlstm_layer.qkv_opreact` ([q | k | v | o] rows), `mlstm_layer.ifgate_preact`
([i | f] rows, weight and bias) and `ffn.proj_up_gate_z` ([gate | up] rows): sliced into the same parameters.

Refused by name: use_bias (biases on the projections and on every norm, which no released xLSTM has and our
RMSNorm does not take), an embedding_dim other than hidden_size and num_blocks other than
num_hidden_layers (HF builds its modules from one and its cache from the other), head widths that do not
divide by num_heads.
"""

from __future__ import annotations

from typing import Any

from hooked.models.xlstm import XLSTMConfig, build
from loaders.architecture import Architecture, Key
from loaders.keymaps import lm_head_keys


def _round_up(x: float, multiple: int) -> int:
    return int(((x + multiple - 1) // multiple) * multiple)


def config_from_hf(hf: dict[str, Any]) -> XLSTMConfig:
    d_model = int(hf.get("hidden_size") or hf["embedding_dim"])
    n_layers = int(hf.get("num_hidden_layers") or hf["num_blocks"])
    for ours, theirs, value in (("hidden_size", "embedding_dim", d_model), ("num_hidden_layers", "num_blocks", n_layers)):
        if hf.get(theirs) is not None and int(hf[theirs]) != value:
            raise ValueError(f"xLSTM config: {theirs}={hf[theirs]} differs from {ours}={value}; HF builds its modules "
                             f"from one and its cache from the other, so such a checkpoint has no one meaning")
    if hf.get("use_bias", False):
        raise ValueError("xLSTM config: use_bias=True (biases on the projections and every norm) is not supported; "
                         "no released xLSTM uses it")
    if hf.get("weight_mode", "single") not in ("single", "fused"):
        raise ValueError(f"xLSTM config: weight_mode must be 'single' or 'fused', got {hf['weight_mode']!r}")
    if hf.get("inference_state_dtype", "float32") != "float32":
        raise ValueError(f"xLSTM config: inference_state_dtype={hf['inference_state_dtype']!r} (HF's recurrent state "
                         "in half precision) is not supported; the recurrence runs in float32 (float64 in float64)")
    n_heads = int(hf.get("num_heads", 8))
    qk_dim = int(d_model * float(hf.get("qk_dim_factor", 0.5)))
    v_dim = int(d_model * float(hf.get("v_dim_factor", 1.0)))
    for name, dim in (("qk_dim", qk_dim), ("v_dim", v_dim)):
        if dim % n_heads or dim == 0:
            raise ValueError(f"xLSTM config: {name} = {dim} (hidden_size times its factor) does not split into "
                             f"num_heads={n_heads} heads")
    d_mlp = _round_up(d_model * float(hf.get("ffn_proj_factor", 2.667)), int(hf.get("ffn_round_up_to_multiple_of", 64)))
    cap = hf.get("gate_soft_cap", 15.0)
    out_cap = hf.get("output_logit_soft_cap", 30.0)
    return XLSTMConfig(
        n_layers=n_layers, d_model=d_model, d_vocab=int(hf["vocab_size"]), n_heads=n_heads, d_qk=qk_dim // n_heads,
        d_v=v_dim // n_heads, d_mlp=d_mlp, gate_soft_cap=None if cap is None else float(cap),
        final_softcap=None if out_cap is None else float(out_cap), eps=float(hf.get("norm_eps", 1e-6)),
        cell_eps=float(hf.get("eps", 1e-6)), chunk_size=int(hf.get("chunk_size", 64)),
        tied=bool(hf.get("tie_word_embeddings", False)),
    )


def _rows(start: int, stop: int, stacked: int):
    """A transform reading rows [start, stop) of a stacked (fused) tensor of `stacked` rows; any other as it is."""
    return lambda t: t[start:stop] if t.shape[0] == stacked else t


def key_map(cfg: XLSTMConfig) -> dict[str, Key]:
    keys = {"embed.weight": Key.of("backbone.embeddings.weight"), "ln_final.weight": Key.of("backbone.out_norm.weight")}
    qk, v, h, up = cfg.n_heads * cfg.d_qk, cfg.n_heads * cfg.d_v, cfg.n_heads, cfg.d_mlp
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"backbone.blocks.{layer}."
        cell, mixer = theirs + "mlstm_layer.", ours + "mixer."
        keys[ours + "ln1.weight"] = Key.of(theirs + "norm_mlstm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "norm_ffn.weight")
        keys[mixer + "norm_weight"] = Key.of(cell + "multihead_norm.weight")
        keys[mixer + "out_proj.weight"] = Key.of(cell + "out_proj.weight")
        keys[ours + "mlp.down_proj.weight"] = Key.of(theirs + "ffn.proj_down.weight")
        # "single": one tensor per projection; "fused": rows of the stacked one (the first name present is read)
        for n, (mine, hf_name) in enumerate((("q_proj", "q"), ("k_proj", "k"))):
            keys[f"{mixer}{mine}.weight"] = Key.of(f"{cell}{hf_name}.weight", f"{cell}qkv_opreact.weight",
                                                   transform=_rows(n * qk, (n + 1) * qk, 2 * qk + 2 * v))
        for n, (mine, hf_name) in enumerate((("v_proj", "v"), ("ogate_proj", "ogate_preact"))):
            keys[f"{mixer}{mine}.weight"] = Key.of(f"{cell}{hf_name}.weight", f"{cell}qkv_opreact.weight",
                                                   transform=_rows(2 * qk + n * v, 2 * qk + (n + 1) * v, 2 * qk + 2 * v))
        for n, gate in enumerate(("igate", "fgate")):
            for w in ("weight", "bias"):
                keys[f"{mixer}{gate}_proj.{w}"] = Key.of(f"{cell}{gate}_preact.{w}", f"{cell}ifgate_preact.{w}",
                                                         transform=_rows(n * h, (n + 1) * h, 2 * h))
        for n, (mine, hf_name) in enumerate((("gate_proj", "proj_up_gate"), ("up_proj", "proj_up"))):
            keys[f"{ours}mlp.{mine}.weight"] = Key.of(f"{theirs}ffn.{hf_name}.weight", f"{theirs}ffn.proj_up_gate_z.weight",
                                                      transform=_rows(n * up, (n + 1) * up, 2 * up))
    return keys | lm_head_keys(cfg.tied)


ARCHITECTURE = Architecture(
    name="xlstm",
    hf_classes=("xLSTMForCausalLM",),
    model_types=("xlstm",),
    config_from_hf=config_from_hf,
    build=build,
    key_map=key_map,
)
