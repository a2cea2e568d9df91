"""The pieces family loaders share: key maps of the shared sublayers, and HF config fields read alike.

Family loaders (loaders/<family>.py) compose these and never import each other, so an edit to one
family cannot break another.

Key maps: `ours` and `theirs` are name prefixes ending in "." (our module path, the checkpoint's);
each function returns {our parameter: Key(checkpoint names)} for one sublayer.
    attention_keys     q/k/v/o projections (`{q,k,v,o}_proj`), optional biases
    qk_norm_keys       per-head q / k RMSNorm weights (Qwen3, Gemma 3)
    gated_mlp_keys     `{gate,up,down}_proj` (SwiGLU / GeGLU)
    mlp_keys           `{up,down}_proj` (an ungated MLP)
    stacked_experts_keys  moe.py's stacked experts from HF 5.x's `experts.gate_up_proj` / `down_proj`
    mamba1_keys, mamba2_keys  the SSM mixers (HF's conv1d weight squeezed)
    decoder_keys       a whole Llama-layout decoder (Llama, Mistral, Qwen2/3, Gemma 2/3)
    lm_head_keys       `lm_head.weight`, unless the embedding is tied

HF config fields (`hf` is the config dict): rotary settings in either spelling (`rope_parameters`
of transformers >= 5, or top-level rope_theta / rope_scaling), Mamba-2 `time_step_limit`,
Qwen's sliding windows, and the field sets that several families' configs read the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loaders.architecture import Key

# ------------------------------------------------------------------------------------- key maps


def squeeze_conv(w: Tensor) -> Tensor:
    """HF's Conv1d weight [channels 1 d_conv] -> our conv_weight [channels d_conv] (a view). Another
    shape stays as it is, so the loader's shape check names it."""
    return w.squeeze(1)


def first_half(w: Tensor) -> Tensor:
    """The gate rows of a fused [.. 2F d_model] gate-and-up weight."""
    return w.chunk(2, dim=-2)[0]


def second_half(w: Tensor) -> Tensor:
    """The up rows of a fused [.. 2F d_model] gate-and-up weight."""
    return w.chunk(2, dim=-2)[1]


def attention_keys(ours: str, theirs: str, qkv_bias: bool, o_bias: bool) -> dict[str, Key]:
    keys = {f"{ours}{p}_proj.weight": Key.of(f"{theirs}{p}_proj.weight") for p in "qkvo"}
    for p in "qkv" if qkv_bias else "":
        keys[f"{ours}{p}_proj.bias"] = Key.of(f"{theirs}{p}_proj.bias")
    if o_bias:
        keys[f"{ours}o_proj.bias"] = Key.of(f"{theirs}o_proj.bias")
    return keys


def qk_norm_keys(ours: str, theirs: str) -> dict[str, Key]:
    return {f"{ours}{norm}.weight": Key.of(f"{theirs}{norm}.weight") for norm in ("q_norm", "k_norm")}


def gated_mlp_keys(ours: str, theirs: str, bias: bool) -> dict[str, Key]:
    return {f"{ours}{p}_proj.{w}": Key.of(f"{theirs}{p}_proj.{w}")
            for p in ("gate", "up", "down") for w in ("weight", "bias")[: 1 + bias]}


def mlp_keys(ours: str, theirs: str, bias: bool) -> dict[str, Key]:
    return {f"{ours}{p}_proj.{w}": Key.of(f"{theirs}{p}_proj.{w}")
            for p in ("up", "down") for w in ("weight", "bias")[: 1 + bias]}


def stacked_experts_keys(ours: str, theirs: str, gated: bool = True) -> dict[str, Key]:
    """moe.py's stacked experts from HF 5.x's `experts.gate_up_proj` [E 2F m] (or `up_proj`) and `down_proj`."""
    if gated:
        keys = {ours + "gate_proj": Key.of(theirs + "gate_up_proj", transform=first_half),
                ours + "up_proj": Key.of(theirs + "gate_up_proj", transform=second_half)}
    else:
        keys = {ours + "up_proj": Key.of(theirs + "up_proj")}
    keys[ours + "down_proj"] = Key.of(theirs + "down_proj")
    return keys


def _ssm_keys(ours: str, theirs: str, names: list[str], conv_bias: bool) -> dict[str, Key]:
    keys = {ours + n: Key.of(theirs + n) for n in names}
    keys[ours + "conv_weight"] = Key.of(theirs + "conv1d.weight", transform=squeeze_conv)
    if conv_bias:
        keys[ours + "conv_bias"] = Key.of(theirs + "conv1d.bias")
    return keys


def mamba1_keys(ours: str, theirs: str, conv_bias: bool, proj_bias: bool) -> dict[str, Key]:
    """Our MambaMixer from an HF Mamba-1 mixer (Mamba, FalconMamba, Jamba; Jamba adds its three norms)."""
    names = ["in_proj.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight"]
    names += ["in_proj.bias", "out_proj.bias"] if proj_bias else []
    return _ssm_keys(ours, theirs, names, conv_bias)


def mamba2_keys(ours: str, theirs: str, conv_bias: bool, proj_bias: bool, out_bias: bool | None = None,
                norm: bool = True) -> dict[str, Key]:
    """Our Mamba2Mixer from an HF Mamba-2 mixer (every Mamba-2 family's layout); `norm`: its gated RMSNorm
    has a weight; `out_bias`: out_proj's bias when it differs from in_proj's."""
    names = ["in_proj.weight", "dt_bias", "A_log", "D", "out_proj.weight"]
    names += ["in_proj.bias"] if proj_bias else []
    names += ["out_proj.bias"] if (proj_bias if out_bias is None else out_bias) else []
    names += ["norm.weight"] if norm else []
    return _ssm_keys(ours, theirs, names, conv_bias)


def interleaved(groups: int, sizes: list[int], take: list[int]) -> Callable[[Tensor], Tensor]:
    """A transform reading rows laid out per group ([group][part 0 | part 1 | ...], `sizes` rows per part):
    the parts `take`, each over every group in group order, concatenated (HF's per-head fused layouts)."""
    def rows(w: Tensor) -> Tensor:
        parts = w.unflatten(0, (groups, -1)).split(sizes, dim=1)
        return torch.cat([parts[i].flatten(0, 1) for i in take])
    return rows


def gated_attention_keys(ours: str, theirs: str, n_heads: int, d_head: int, bias: bool) -> dict[str, Key]:
    """gated_attention.py's GatedAttention from q_proj rows [query_h | gate_h] per head (Qwen3-Next, Qwen3.5),
    k/v/o projections and per-head q/k norms."""
    keys = attention_keys(ours, theirs, bias, bias) | qk_norm_keys(ours, theirs)
    for w in ("weight", "bias")[: 1 + bias]:
        keys[f"{ours}q_proj.{w}"] = Key.of(f"{theirs}q_proj.{w}", transform=interleaved(n_heads, [d_head, d_head], [0]))
        keys[f"{ours}gate_proj.{w}"] = Key.of(f"{theirs}q_proj.{w}", transform=interleaved(n_heads, [d_head, d_head], [1]))
    return keys


def sigmoid_shared_moe_keys(ours: str, theirs: str) -> dict[str, Key]:
    """moe.py's MoE with shared_expert.py's sigmoid-gated shared expert from Qwen's `gate` (the router),
    `experts.*`, `shared_expert.*` and `shared_expert_gate` (Qwen3-Next, Qwen3.5-MoE)."""
    keys = {ours + "router.weight": Key.of(theirs + "gate.weight")}
    keys |= stacked_experts_keys(ours, theirs + "experts.")
    keys |= gated_mlp_keys(ours + "shared.", theirs + "shared_expert.", False)
    return keys | {ours + "shared.out_gate.weight": Key.of(theirs + "shared_expert_gate.weight")}


PER_EXPERT_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # expert_view's


def delta_mixer_keys(ours: str, theirs: str, names: dict[str, str | Key]) -> dict[str, Key]:
    """delta_mixer.py's mixer: `names` maps our parameter (relative) to theirs (relative, or a Key with
    relative names); `conv_weight` from `conv1d.weight` (squeezed) unless `names` gives it."""
    keys = {ours + "conv_weight": Key.of(theirs + "conv1d.weight", transform=squeeze_conv)}
    for mine, their in names.items():
        key = their if isinstance(their, Key) else Key.of(their)
        keys[ours + mine] = Key(tuple(theirs + n for n in key.names), key.transform)
    return keys


def lm_head_keys(tied: bool) -> dict[str, Key]:
    """The output projection; a tied one is the embedding itself and is left out of the key map."""
    return {} if tied else {"unembed.weight": Key.of("lm_head.weight")}


LLAMA_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
GEMMA_NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
               "ln2_post": "post_feedforward_layernorm"}


def decoder_keys(n_layers: int, norms: dict[str, str], *, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool = False, tied: bool) -> dict[str, Key]:
    """A Llama-layout decoder: `model.embed_tokens`, `model.layers.{l}.{norms, self_attn.*, mlp.*}`,
    `model.norm`. Every name is also accepted without `model.` (the tensors of a bare LlamaModel)."""
    keys = {"embed.weight": Key.of("embed_tokens.weight"), "ln_final.weight": Key.of("norm.weight")}
    for l in range(n_layers):
        ours, theirs = f"blocks.{l}.", f"layers.{l}."
        keys |= {f"{ours}{norm}.weight": Key.of(f"{theirs}{hf}.weight") for norm, hf in norms.items()}
        keys |= attention_keys(ours + "attn.", theirs + "self_attn.", qkv_bias, o_bias)
        keys |= qk_norm_keys(ours + "attn.", theirs + "self_attn.") if qk_norm else {}
        keys |= gated_mlp_keys(ours + "mlp.", theirs + "mlp.", mlp_bias)
    keys = {ours: Key.of(*(p + n for n in key.names for p in ("model.", ""))) for ours, key in keys.items()}
    return keys | lm_head_keys(tied)


# ------------------------------------------------------------------------------ HF config fields


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for the default rope) from either config spelling."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:  # the pre-4.45 spelling
        params["rope_type"] = params.pop("type")
    rope_type = params.get("rope_type", "default")
    return float(theta), (None if rope_type == "default" else params)


def rope_fields(hf: dict[str, Any], default_partial: float = 1.0) -> dict[str, Any]:
    """rope_theta, rope_scaling and partial_rotary_factor from either config spelling."""
    theta, scaling = rope_from_hf(hf)
    params = dict(hf.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial)))
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)


def dt_limit_from_hf(hf: dict[str, Any], key: str = "time_step_limit") -> tuple[float, float]:
    limit = hf.get(key) or (0.0, math.inf)
    return float(limit[0]), float(limit[1])


def sliding_windows(hf: dict[str, Any]) -> dict[str, Any]:
    """{sliding_window, layer_types} as HF's Qwen2/Qwen3 configs resolve them: `layer_types` as HF
    writes it after its own __post_init__; without it, with use_sliding_window, layers
    l >= max_window_layers slide, all others (and all, without it) are full."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first_sliding = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and l >= first_sliding else "full_attention"
                 for l in range(hf["num_hidden_layers"])]
    return dict(sliding_window=window, layer_types=tuple(types))


def llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig's fields, read alike by Llama, Mistral and Qwen2/3."""
    theta, scaling = rope_from_hf(hf)
    n_heads = hf["num_attention_heads"]
    return dict(
        n_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 2048),
        eps=hf.get("rms_norm_eps", 1e-6),
        act_fn=hf.get("hidden_act", "silu"),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        tied=hf.get("tie_word_embeddings", False),
    )


def gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 fields read the same way (all but rope, caps and layer types)."""
    if hf.get("use_bidirectional_attention"):
        raise NotImplementedError("bidirectional Gemma attention (use_bidirectional_attention) is not supported")
    n_heads = hf["num_attention_heads"]
    return dict(
        n_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 8192),
        eps=hf.get("rms_norm_eps", 1e-6),
        act_fn=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        attention_bias=hf.get("attention_bias", False),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=hf.get("sliding_window"),
        tied=hf.get("tie_word_embeddings", True),
    )


def gemma_layer_types(hf: dict[str, Any], period: int) -> tuple[str, ...]:
    """HF's layer_types, or its default: layer l slides unless (l + 1) is a multiple of `period`."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (l + 1) % period else "full_attention" for l in range(hf["num_hidden_layers"])]
    return tuple(types)


def mamba2_fields(hf: dict[str, Any], d_inner: int) -> dict[str, Any]:
    """The Mamba-2 mixer fields of the `mamba_*`-named hybrid configs (Bamba, Granite 4, Falcon-H1)."""
    n_heads = int(hf["mamba_n_heads"])
    d_head = hf.get("mamba_d_head", "auto")
    return dict(
        n_heads=n_heads, d_head=d_inner // n_heads if d_head in (None, "auto") else int(d_head), d_inner=d_inner,
        d_state=int(hf.get("mamba_d_state", 256)), n_groups=int(hf.get("mamba_n_groups", 1)),
        d_conv=int(hf.get("mamba_d_conv", 4)), chunk_size=int(hf.get("mamba_chunk_size", 256)),
        dt_limit=dt_limit_from_hf(hf), conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
    )


def attention_fields(hf: dict[str, Any], d_attn_head: int | None = None) -> dict[str, Any]:
    """n_attn_heads, n_attn_kv_heads, d_attn_head of a hybrid's attention layers; `d_attn_head`
    default: head_dim, else hidden_size // num_attention_heads."""
    n_attn_heads = int(hf["num_attention_heads"])
    if d_attn_head is None:
        d_attn_head = int(hf.get("head_dim") or int(hf["hidden_size"]) // n_attn_heads)
    return dict(n_attn_heads=n_attn_heads, n_attn_kv_heads=int(hf.get("num_key_value_heads") or n_attn_heads),
                d_attn_head=d_attn_head)


# ------------------------------------------------------------------ layouts two families share
KDA_LAYER_TYPES = {"linear_attention": "delta", "full_attention": "attention"}  # Kimi Linear, Bailing-hybrid
KDA_MLP_TYPES = {"dense": "dense", "sparse": "moe"}


def first_of(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` the dict holds (HF's to_dict writes its attribute_map names: num_experts, ...)."""
    return next((hf[n] for n in names if hf.get(n) is not None), default)


def kda_key_map(cfg: Any, attention: Callable[[Any, str, str], dict[str, Key]],
                mixer: dict[str, str | Key]) -> dict[str, Key]:
    """The keys of a KDA + MLA + DeepSeek-V3 MoE model (Kimi Linear, Bailing-hybrid): `attention(cfg, ours, theirs)`
    gives an MLA layer's keys, `mixer` names a KDA layer's parameters under HF's `self_attn.`."""
    keys = {"embed.weight": Key.of("model.embed_tokens.weight"), "ln_final.weight": Key.of("model.norm.weight")}
    for layer, (kind, mlp_kind) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        keys[ours + "ln1.weight"] = Key.of(theirs + "input_layernorm.weight")
        keys[ours + "ln2.weight"] = Key.of(theirs + "post_attention_layernorm.weight")
        if kind == "attention":
            keys |= attention(cfg, ours + "attn.", theirs + "self_attn.")
        else:
            keys |= delta_mixer_keys(ours + "mixer.", theirs + "self_attn.", mixer)
        if mlp_kind == "dense":
            keys |= gated_mlp_keys(ours + "mlp.", theirs + "mlp.", False)
            continue
        keys[ours + "mlp.router.weight"] = Key.of(theirs + "mlp.gate.weight")
        keys[ours + "mlp.select.correction_bias"] = Key.of(theirs + "mlp.gate.e_score_correction_bias")
        keys |= stacked_experts_keys(ours + "mlp.", theirs + "mlp.experts.")
        keys |= gated_mlp_keys(ours + "mlp.shared.", theirs + "mlp.shared_experts.", False)
    return keys | lm_head_keys(cfg.tied)


def lfm2_operator_keys(cfg: Any, layer: int, kind: str) -> dict[str, Key]:
    """Layer `layer`'s norms and its operator (attention, or the gated short conv) of an LFM2 checkpoint (LFM2 and
    LFM2-MoE alike: their feed-forwards differ)."""
    ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
    keys = {ours + "ln1.weight": Key.of(theirs + "operator_norm.weight"),
            ours + "ln2.weight": Key.of(theirs + "ffn_norm.weight")}
    if kind == "attention":
        names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "out_proj",
                 "q_norm": "q_layernorm", "k_norm": "k_layernorm"}
        return keys | {f"{ours}attn.{m}.weight": Key.of(f"{theirs}self_attn.{t}.weight") for m, t in names.items()}
    conv = theirs + "conv."
    keys[ours + "mixer.conv_weight"] = Key.of(conv + "conv.weight", transform=squeeze_conv)
    for w in ("weight", "bias")[: 1 + cfg.conv_bias]:
        keys[f"{ours}mixer.in_proj.{w}"] = Key.of(f"{conv}in_proj.{w}")
        keys[f"{ours}mixer.out_proj.{w}"] = Key.of(f"{conv}out_proj.{w}")
    if cfg.conv_bias:
        keys[ours + "mixer.conv_bias"] = Key.of(conv + "conv.bias")
    return keys


def lfm2_feed_forward_keys(layer: int) -> dict[str, Key]:
    """A dense feed-forward's keys (w1, w3, w2 = gate, up, down)."""
    return {f"blocks.{layer}.mlp.{m}_proj.weight": Key.of(f"model.layers.{layer}.feed_forward.{t}.weight")
            for m, t in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}


def qwen_fields(hf: dict[str, Any], layer_types: dict[str, str],
                attention: str = "full_attention") -> dict[str, Any]:
    """The fields Qwen3-Next, Qwen3.5 and Qwen4-Exp read alike (all but the MLP layout and Qwen4-Exp's new
    parts). layer_types: HF's layer type -> ours; without HF's layer_types, every full_attention_interval-th
    layer is `attention`, the others linear_attention."""
    n_layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [
        attention if (l + 1) % int(hf.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for l in range(n_layers)]
    unknown = sorted({k for k in kinds if k not in layer_types})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (known: {', '.join(layer_types)})")
    rope = rope_fields(hf)
    n_heads = int(hf["num_attention_heads"])
    return dict(
        d_model=int(hf["hidden_size"]), d_vocab=int(hf["vocab_size"]), layer_types=tuple(layer_types[k] for k in kinds),
        n_heads=int(hf["linear_num_value_heads"]), n_k_heads=int(hf["linear_num_key_heads"]),
        d_k=int(hf["linear_key_head_dim"]), d_v=int(hf["linear_value_head_dim"]),
        d_conv=int(hf.get("linear_conv_kernel_dim", 4)), n_attn_heads=n_heads,
        n_attn_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_attn_head=int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads),
        partial_rotary=rope["partial_rotary_factor"], rope_theta=rope["rope_theta"], rope_scaling=rope["rope_scaling"],
        attention_bias=bool(hf.get("attention_bias", False)), act_fn=hf.get("hidden_act", "silu"),
        eps=float(hf.get("rms_norm_eps", 1e-6)), tied=bool(hf.get("tie_word_embeddings", False)),
        n_ctx=int(hf.get("max_position_embeddings") or 32768),
    )
