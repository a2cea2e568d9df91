"""Every config field HF's modeling code reads is read here (parity at a non-default value) or refused by name.

The walk: for each family of tests/tiny_families.py with an HF model class, the fields its
transformers 5.24 `modeling_*.py` reads (`config.<field>`, `self.config.<field>`, `getattr(config,
"<field>")`, kept when the config object has a non-callable attribute of that name) must each have a
status in the table below, and nothing else may be listed:

    tiny     the tiny config already sets it to a value other than the config class's default, so the
             family's base parity (logits within 1e-4 of HF's, relative to their max) covers it
    vary     parity at the non-default value given (with any companion fields the value needs), after
             checking the HF model really holds that value
    refuse   that value raises an error naming the field (loaders/unsupported.py, or the family's own check)
    ignore   no effect on a loaded model's forward, for the reason given

Statuses are looked up in order: the family's own entry (FAMILY), IGNORED, tiny (found by comparing with
the class default), VARY. `summary()` counts them (the issue's closing note quotes it).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hybrid_checks import assert_rel_close
from tiny_families import CONFIGS, FAMILIES

from hooked import backends
from loaders.load import from_hf

PAT = re.compile(r"(?:self\.)?config\.([A-Za-z_]\w*)|getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")
TOKENS = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))


@dataclass(frozen=True)
class Vary:
    value: Any  # a value, or a function of the HF config giving one
    also: tuple[tuple[str, Any], ...] = ()  # companion fields the value needs (e.g. heads that divide a width)


@dataclass(frozen=True)
class Refuse:
    value: Any
    also: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Ignore:
    reason: str


TINY = "tiny"
_DROPOUT = Ignore("dropout: off in eval mode, and a loaded model is always evaluated")
_INIT = Ignore("initialisation of fresh weights only: a loaded model's weights come from the checkpoint")
_KERNEL = Ignore("which HF kernel runs (fused / reference / attention implementation); hooked.backends picks ours")
_TRAINING = Ignore("a training loss or its outputs (router aux loss, z-loss, router logits)")
_OUTPUT = Ignore("what HF returns (cache object, hidden-state tuples, logits kept): the logits are the same")
_HEADS = Ignore("another task head's setting (sequence classification, GPT-2's double heads): a causal LM has none")
_PADDING = Ignore("nn.Embedding(padding_idx=...): only the gradient and the initial row of that token change")

IGNORED: dict[str, Ignore] = {
    "_attn_implementation": _KERNEL, "use_mamba_kernels": _KERNEL, "use_mambapy": _KERNEL,
    "use_associative_scan": _KERNEL,
    "attention_dropout": _DROPOUT, "attn_pdrop": _DROPOUT, "embd_pdrop": _DROPOUT, "resid_pdrop": _DROPOUT,
    "hidden_dropout": _DROPOUT, "classifier_dropout": _DROPOUT, "router_jitter_noise": _DROPOUT,
    "initializer_range": _INIT, "rescale_prenorm_residual": _INIT, "time_step_floor": _INIT, "time_step_max": _INIT,
    "time_step_init_scheme": _INIT, "time_step_scale": _INIT, "linear_dt_init_floor": _INIT, "linear_dt_max": _INIT,
    "linear_dt_min": _INIT, "linear_a_log_min": _INIT, "linear_a_log_max": _INIT,
    "router_aux_loss_coef": _TRAINING, "output_router_logits": _TRAINING, "z_loss_coefficient": _TRAINING,
    "use_cache": _OUTPUT, "output_hidden_states": _OUTPUT, "return_dict": _OUTPUT, "output_attentions": _OUTPUT,
    "num_logits_to_keep": _OUTPUT,
    "num_labels": _HEADS, "problem_type": _HEADS, "summary_activation": _HEADS, "summary_first_dropout": _HEADS,
    "summary_proj_to_labels": _HEADS, "summary_type": _HEADS, "summary_use_proj": _HEADS,
    "pad_token_id": _PADDING,
}


def _theta(rope: dict) -> dict:
    """rope_parameters (flat, or one dict per layer type) with every rope_theta at 500."""
    out = copy.deepcopy(rope)
    for d in [out, *[v for v in out.values() if isinstance(v, dict)]]:
        if d.get("rope_theta") is not None:
            d["rope_theta"] = 500.0
    return out


VARY: dict[str, Vary] = {  # the common non-default values (a family entry overrides)
    "hidden_act": Vary("gelu"), "hidden_activation": Vary("gelu"), "activation_function": Vary("relu"),
    "mlp_hidden_act": Vary("gelu"),
    "rms_norm_eps": Vary(1e-2), "layer_norm_epsilon": Vary(1e-2), "layer_norm_eps": Vary(1e-2), "norm_eps": Vary(1e-2),
    "mixer_rms_eps": Vary(1e-2),
    "attention_bias": Vary(lambda c: not c.attention_bias), "mlp_bias": Vary(True), "use_bias": Vary(True),
    "use_conv_bias": Vary(False), "conv_bias": Vary(True), "mamba_conv_bias": Vary(False),
    "mamba_proj_bias": Vary(True), "add_bias_linear": Vary(True), "projectors_bias": Vary(True),
    "max_position_embeddings": Vary(lambda c: c.max_position_embeddings + 7),
    "rope_parameters": Vary(lambda c: _theta(c.rope_parameters)),
    "conv_kernel": Vary(3), "mamba_d_conv": Vary(3), "linear_conv_kernel_dim": Vary(3),
    "time_step_limit": Vary((0.0, 0.05)), "time_step_min": Vary(0.01),
    "num_experts_per_tok": Vary(3), "norm_topk_prob": Vary(lambda c: not c.norm_topk_prob),
    "routed_scaling_factor": Vary(1.7), "decoder_sparse_step": Vary(2),
    "attention_multiplier": Vary(0.7), "attention_in_multiplier": Vary(0.7), "key_multiplier": Vary(1.3),
    "ssm_in_multiplier": Vary(1.4),
    "original_max_position_embeddings": Vary(lambda c: c.original_max_position_embeddings + 7),
    "num_key_value_heads": Vary(4), "n_shared_experts": Vary(2), "q_lora_rank": Vary(12), "conv_L_cache": Vary(4),
}

_ZAMBA2_ADAPTER_HEADS = (("num_attention_heads", 4), ("num_key_value_heads", 4))  # adapters write 2 * d_model
FAMILY: dict[str, dict[str, Any]] = {
    "gpt2": {"add_cross_attention": Refuse(True), "n_inner": Vary(40), "scale_attn_by_inverse_layer_idx": Vary(True),
             "scale_attn_weights": Vary(False),
             "reorder_and_upcast_attn": Vary(True),  # upcasts half-precision scores: float32 is unchanged
             "max_position_embeddings": TINY},  # n_positions=64
    "qwen2": {"sliding_window": Vary(4, (("use_sliding_window", True), ("max_window_layers", 1),
                                         ("layer_types", ["full_attention", "sliding_attention"])))},
    "qwen3": {"sliding_window": Vary(4, (("use_sliding_window", True), ("max_window_layers", 1),
                                         ("layer_types", ["full_attention", "sliding_attention"])))},
    "gemma2": {"use_bidirectional_attention": Refuse(True)},
    "gemma3": {"use_bidirectional_attention": Refuse(True), "final_logit_softcapping": Vary(3.0),
               "attn_logit_softcapping": Vary(2.0)},
    "gemma": {"use_bidirectional_attention": Refuse(True)},
    "mamba": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("every layer is a Mamba layer (HF's cache reads it)"),
              "residual_in_fp32": Vary(False),  # float32: the same; half precision keeps ours in the model dtype
              "time_step_min": _INIT},
    "falcon_mamba": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("every layer is a Mamba layer"),
                     "residual_in_fp32": Vary(False), "time_step_min": _INIT},
    "mamba2": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("every layer is a Mamba-2 layer"),
               "residual_in_fp32": Vary(False), "time_step_min": _INIT,
               "time_step_rank": Ignore("Mamba-2's dt is one value per head: HF reads time_step_rank for nothing else"),
               "expand": Vary(4, (("num_heads", 8),))},
    "zamba2": {"hidden_act": Vary("silu"), "attention_hidden_size": Refuse(48), "head_dim": Ignore("the config class sets it from attention_head_dim"),
               "hybrid_layer_ids": Ignore("the config class derives it from layers_block_type (read)"),
               "layer_types": Ignore("the config class derives it from layers_block_type (read)"),
               "use_conv_bias": Vary(False), "mamba_expand": Vary(4, (("n_mamba_heads", 8),)),
               "adapter_rank": Vary(5, (("use_shared_attention_adapter", True),) + _ZAMBA2_ADAPTER_HEADS),
               "use_shared_attention_adapter": Vary(True, _ZAMBA2_ADAPTER_HEADS), "num_mem_blocks": Vary(2), "use_long_context": Vary(True)},
    "bamba": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("derived from attn_layer_indices (read)"),
              "layers_block_type": Ignore("derived from attn_layer_indices (read)"),
              "mamba_expand": Vary(4, (("mamba_n_heads", 8),)), "mamba_n_groups": Vary(2)},
    "granite": {"hidden_act": Refuse("gelu"), "layers_block_type": Ignore("derived from layer_types (read)"),
                "mamba_expand": Vary(4, (("mamba_n_heads", 8),)), "mamba_n_groups": Vary(2)},
    "falcon_h1": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("every layer is attention + Mamba-2 in parallel"),
                  "mamba_expand": Ignore("the config class derives mamba_d_ssm (read) from it"),
                  "mamba_d_head": Vary(4, (("mamba_n_heads", 8),)), "mamba_n_groups": Vary(2),
                  "mamba_norm_before_gate": Vary(False), "mamba_rms_norm": Vary(True),
                  "mlp_multipliers": Vary([0.7, 1.3])},
    "nemotron_h": {"layer_types": Ignore("derived from hybrid_override_pattern (read)"),
                   "layers_block_type": Ignore("derived from hybrid_override_pattern (read)"),
                   "num_hidden_layers": Ignore("derived from hybrid_override_pattern (read)"),
                   "mamba_hidden_act": Refuse("gelu"), "topk_group": Refuse(2),
                   "n_group": Vary(2, (("topk_group", 1),)),
                   "num_local_experts": Ignore("the config class's alias of n_routed_experts (read)"),
                   "moe_latent_size": Refuse(8)},
    "jamba": {"hidden_act": Refuse("gelu"), "layer_types": Ignore("derived from attn_layer_period/offset (read)"),
              "layers_block_type": Ignore("derived from attn_layer_period/offset (read)"),
              "layers_num_experts": Ignore("derived from expert_layer_period/offset (read)"),
              "num_local_experts": Ignore("the config class's alias of num_experts (read)"),
              "mamba_expand": Vary(3)},
    "gpt_neox": {"hidden_act": Vary("silu"), "is_decoder": Vary(True), "use_parallel_residual": Vary(False)},
    "mixtral": {"head_dim": Vary(8), "sliding_window": Vary(4)},
    "olmoe": {"clip_qkv": Refuse(0.5), "num_local_experts": Ignore("the config class's alias of num_experts (read)")},
    "qwen3_moe": {"sliding_window": Vary(4, (("use_sliding_window", True), ("max_window_layers", 1),
                                             ("layer_types", ["full_attention", "sliding_attention"])))},
    "kimi_linear": {"topk_group": Refuse(2), "q_lora_rank": Vary(12), "n_group": Vary(2, (("topk_group", 1),))},
    "lfm2": {"block_ffn_dim_multiplier": Vary(1.5, (("block_auto_adjust_ff_dim", True), ("block_multiple_of", 16))),
             "block_multiple_of": Vary(16, (("block_auto_adjust_ff_dim", True),))},
    "lfm2_moe": {"num_hidden_layers": Ignore("derived from layer_types (read)"), "use_expert_bias": Vary(False)},
    "gpt_oss": {"swiglu_alpha": Vary(2.5), "swiglu_limit": Vary(5.0)},
    "olmo_hybrid": {"linear_allow_neg_eigval": Vary(False)},
    "bailing_hybrid": {"kda_lower_bound": Vary(-8.0), "kda_safe_gate": Vary(False), "num_mtp_layers": Vary(2)},
    "recurrent_gemma": {"conv1d_width": Vary(3), "logits_soft_cap": Vary(5.0), "w_init_variance_scale": _INIT},
    "minimax": {"sliding_window": Vary(4), "full_attn_alpha_factor": Vary(0.7), "full_attn_beta_factor": Vary(1.2),
                "linear_attn_alpha_factor": Vary(1.3), "linear_attn_beta_factor": Vary(0.8),
                "mlp_alpha_factor": Vary(0.9), "mlp_beta_factor": Vary(1.1)},
    "rwkv": {"context_length": Vary(32), "rescale_every": Vary(0)},
    "zamba": {"hidden_act": Vary("silu"), "hidden_mamba_act": Refuse("gelu"), "mamba_expand": Vary(4), "n_mamba_heads": Vary(4)},
    "xlstm": {"eps": Vary(1e-2), "gate_soft_cap": Vary(2.0), "output_logit_soft_cap": Vary(2.0), "v_dim_factor": Vary(2.0),
              "weight_mode": Ignore("the weights' layout (fused: stacked projections), not the forward; HF 5.24 cannot "
                                    "build a fused model (its _init_weights fails), test_xlstm loads one by rows"),
              "max_inference_chunksize": Vary(5), "mode": Vary("train"),
              "norm_reduction_force_float32": Vary(False), "use_bias": Refuse(True),
              "inference_state_dtype": Refuse("bfloat16"),
              "autocast_kernel_dtype": Ignore("the external xlstm package's triton kernels' dtype: HF's torch-native "
                                              "kernels take it and drop it"),
              "return_last_states": Ignore("read in mode 'train' only: whether the kernel also returns its last "
                                           "state, not what it computes")},
    "qwen4_exp": {"hidden_act": Vary("gelu", (("output_gate_type", "silu"),)), "output_gate_type": Vary("sigmoid"),
                  "ngram_size": Vary(5), "ple_conv_kernel_size": Vary(3), "seed": Vary(7)},
}


# --------------------------------------------------------------------------------------------- walk
def hf_families() -> tuple[str, ...]:
    """Families whose model class is transformers' (Llamba's reference is ours: no HF modeling code)."""
    return tuple(f for f in FAMILIES if CONFIGS[f]()[0].__module__.startswith("transformers."))


@functools.cache
def hf_reads(family: str) -> tuple[str, ...]:
    """The config fields the family's HF modeling module reads."""
    cls, config = CONFIGS[family]()
    found = {a or b for a, b in PAT.findall(inspect.getsource(sys.modules[cls.__module__]))}
    return tuple(sorted(f for f in found if hasattr(config, f) and not callable(getattr(config, f))))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # noqa: BLE001 (tensors, exotic values: compared by repr)
        return repr(a) == repr(b)


def status(family: str, field: str) -> Any:
    """The table's entry for (family, field): Vary, Refuse, Ignore, TINY, or None when unlisted."""
    if field in FAMILY.get(family, {}):
        return FAMILY[family][field]
    if field in IGNORED:
        return IGNORED[field]
    _, config = CONFIGS[family]()
    if not _same(getattr(config, field), getattr(type(config)(), field, None)):
        return TINY
    return VARY.get(field)


def table() -> list[tuple[str, str, Any]]:
    return [(fam, f, status(fam, f)) for fam in hf_families() for f in hf_reads(fam)]


def summary() -> dict[str, int]:
    """Counts of the walk: fields checked at a non-default value (tiny + vary), refused, ignored, unlisted."""
    counts = {"tiny": 0, "vary": 0, "refuse": 0, "ignore": 0, "unlisted": 0}
    for _, _, s in table():
        counts[{Vary: "vary", Refuse: "refuse", Ignore: "ignore"}.get(type(s), "tiny" if s == TINY else "unlisted")] += 1
    return counts


def build_hf(family: str, overrides: dict[str, Any]):
    """The family's tiny HF model (seeded, perturbed, eager), with `overrides` set on its config."""
    cls, config = CONFIGS[family]()
    values = {k: (v(config) if callable(v) else v) for k, v in overrides.items()}
    if values:
        config = type(config).from_dict({**config.to_dict(), **values})
        for k, v in values.items():  # an alias (attribute_map) the dict round trip lost
            setattr(config, k, v)
        for k, v in values.items():
            assert _same(getattr(config, k), v if not isinstance(v, tuple) else type(getattr(config, k))(v)), \
                f"{family}: the HF config did not keep {k}={v!r} (got {getattr(config, k)!r})"
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _overrides(family: str, field: str, entry: Vary | Refuse) -> dict[str, Any]:
    return {**dict(entry.also), field: entry.value}


def _cases(kind: type) -> list:
    return [pytest.param(fam, f, id=f"{fam}-{f}") for fam, f, s in table() if isinstance(s, kind)]


@pytest.fixture(autouse=True)
def eager_attention():
    with backends.use(attention="eager"):
        yield


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", hf_families())
def test_every_field_hf_reads_is_listed(family):
    unlisted = [f for f in hf_reads(family) if status(family, f) is None]
    assert not unlisted, f"{family}: HF reads {unlisted}, which the table neither varies, refuses nor ignores"
    stale = [f for f in FAMILY.get(family, {}) if f not in hf_reads(family)]
    assert not stale, f"{family}: the table lists {stale}, which HF's modeling code does not read"


@pytest.mark.parametrize("family", hf_families())
def test_tiny_config_parity(family):
    """Base parity, which covers every field the tiny config already sets to a non-default value."""
    assert any(status(family, f) == TINY for f in hf_reads(family))
    hf = build_hf(family, {})
    with torch.no_grad():
        assert_rel_close(from_hf(hf)(TOKENS), hf(TOKENS).logits, f"{family} logits")


@pytest.mark.parametrize("family, field", _cases(Vary))
def test_non_default_value_parity(family, field):
    _, config = CONFIGS[family]()
    hf = build_hf(family, _overrides(family, field, status(family, field)))
    assert not _same(getattr(hf.config, field), getattr(type(config)(), field, None)), f"{field}: the class default"
    with torch.no_grad():
        assert_rel_close(from_hf(hf)(TOKENS), hf(TOKENS).logits, f"{family} logits with {field} varied")


@pytest.mark.parametrize("family, field", _cases(Refuse))
def test_unimplemented_value_is_refused_by_name(family, field):
    hf = build_hf(family, _overrides(family, field, status(family, field)))
    with pytest.raises((ValueError, NotImplementedError), match=field):
        from_hf(hf)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear"])
def test_delta_families_short_conv_reads_hidden_act(family):
    """HF applies hidden_act after the short conv as well as in the MLP: with "gelu" the logits move far
    (so the case is not vacuous) and ours follow (was SiLU there: 0.53 relative off on Qwen3.5)."""
    silu, gelu = build_hf(family, {}), build_hf(family, {"hidden_act": "gelu"})
    with torch.no_grad():
        moved = (gelu(TOKENS).logits - silu(TOKENS).logits).abs().max() / silu(TOKENS).logits.abs().max()
        assert moved > 1e-2
        assert_rel_close(from_hf(gelu)(TOKENS), gelu(TOKENS).logits, f"{family} logits, hidden_act=gelu")
    assert from_hf(gelu).blocks[0].mixer.spec.conv_act == "gelu"


def test_summary_counts():
    counts = summary()
    assert counts["unlisted"] == 0
    assert counts["tiny"] + counts["vary"] > 5 * (counts["refuse"] + counts["ignore"]) / 2
