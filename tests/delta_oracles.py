"""Hugging Face oracles for the delta-rule families (transformers 5.24, torch paths only).

    RULES                      {family module: (chunked, recurrent)} names of HF's delta-rule torch paths
    hf_delta_rule(module, dtype)  HF's (chunked, recurrent) functions of that modeling module computing in
                               `dtype`. HF always computes the rule in float32 (it casts its inputs); the
                               float64 versions are HF's own source with the working dtype replaced, so the
                               float64 tests compare against HF's algorithm, not HF's float32 rounding
    TINY                       {model_type: (config class, model class, config kwargs)}: a 4-layer model
                               with both layer types (and, where the family has them, dense and MoE MLPs)
    tiny_delta_hf(model_type, perturb=0.2, dtype=float32, **overrides) -> (hf_model, config)
    force_torch_paths()        make every HF delta/conv function the torch path (done on import)

model_type is HF's config.model_type: "qwen3_next", "qwen3_5_text" (Qwen3.5 dense, text part),
"qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lfm2". HF picks flash-linear-attention /
causal-conv1d at import when they are installed; force_torch_paths puts the torch functions back in
the modeling modules' globals, where the layers look them up at call time.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from typing import Any

import torch
import transformers
from conftest import build_tiny_hf

RULES = {
    "qwen3_next": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "qwen3_5": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "qwen3_5_moe": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "olmo_hybrid": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kimi_linear": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
}
_CONV = ("causal_conv1d_fn", "causal_conv1d_update")
_MODULES = [*RULES, "lfm2"]


def _modeling(module: str) -> Any:
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def force_torch_paths() -> None:
    """Every delta-rule and short-conv function of the families: the undecorated torch function."""
    for module in _MODULES:
        modeling = _modeling(module)
        for name in (*RULES.get(module, ()), *_CONV):
            if hasattr(modeling, name):
                setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))


force_torch_paths()


def hf_delta_rule(module: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """HF's (chunked, recurrent) delta rule of `module`, computing in `dtype` (module docstring)."""
    fns = tuple(inspect.unwrap(getattr(_modeling(module), name)) for name in RULES[module])
    if dtype == torch.float32:
        return fns
    if dtype != torch.float64:
        raise ValueError(f"float32 or float64, got {dtype}")
    return tuple(_in_float64(fn) for fn in fns)


def _in_float64(fn: Any) -> Any:
    source = textwrap.dedent(inspect.getsource(fn))
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("@"))
    replaced = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    assert replaced != source, f"{fn.__name__}: no float32 cast found; HF's source changed"
    namespace = dict(fn.__globals__)
    exec(compile(replaced, f"<{fn.__module__}.{fn.__name__}, float64>", "exec"), namespace)
    return namespace[fn.__name__]


_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, tie_word_embeddings=False)
_ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_conv_kernel_dim=4)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

TINY: dict[str, tuple[Any, Any, dict]] = {
    # mlp_only_layers [0, 3]: linear + dense, full + MoE, linear + MoE, full + dense
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(_SMALL, **_GDN, **_QWEN_MOE, head_dim=16, layer_types=_ALTERNATING, decoder_sparse_step=1,
                        mlp_only_layers=[0, 3], norm_topk_prob=True)),
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                     dict(_SMALL, **_GDN, head_dim=16, layer_types=_ALTERNATING)),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                         dict({k: v for k, v in _SMALL.items() if k != "intermediate_size"}, **_GDN, **_QWEN_MOE,
                              head_dim=16, layer_types=_ALTERNATING)),
    # rope_parameters {"rope_theta": None} gives the released checkpoints' NoPE
    "olmo_hybrid": (transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM,
                    dict(_SMALL, **_GDN, layer_types=_ALTERNATING, pad_token_id=0, eos_token_id=1)),
    # MLA needs num_key_value_heads == num_attention_heads (kv_b_proj already writes every head);
    # first_k_dense_replace (default 1): layer 0 dense, the others MoE
    "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                    dict(_SMALL, num_key_value_heads=4, layer_types=_ALTERNATING, linear_num_heads=4, linear_head_dim=8,
                         linear_conv_kernel_dim=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, num_local_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # block_auto_adjust_ff_dim False: intermediate_size is the MLP width as given
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
             dict(_SMALL, layer_types=["conv", "full_attention", "conv", "full_attention"],
                  block_auto_adjust_ff_dim=False, conv_L_cache=3)),
}


def tiny_delta_hf(model_type: str, perturb: float = 0.2, dtype: torch.dtype = torch.float32, seed: int = 0,
                  **overrides: Any) -> tuple[Any, Any]:
    """(hf_model, config): a seeded tiny model of `model_type`, eval mode, eager attention and experts,
    torch paths.

    perturb: add perturb * N(0, 1) to every parameter (HF's init leaves norms at their identity and
    gates at their defaults, which hides misplaced weights). overrides: config kwargs.
    """
    config_cls, model_cls, kwargs = TINY[model_type]
    config = config_cls(**{**kwargs, **overrides})
    config._experts_implementation = "eager"  # the default grouped_mm refuses float64
    hf = build_tiny_hf(config, model_cls, seed=seed, perturb=perturb, dtype=dtype)
    return hf, hf.config
