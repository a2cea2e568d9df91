"""Parity of the Llama-derived and Gemma families with HF transformers' eager attention.

One table per family: tiny random HF models (every parameter perturbed), compared as in
tests/test_parity_llama.py: logits, the embedding, every block's resid_post and ln_final's output at
real (non-padding) positions, within `rel` of the HF tensor's max magnitude. Sliding windows (16 or
1) are shorter than the long inputs (67 tokens), so the windowed mask is exercised with and without
padding. Family-specific checks (window in the pattern, config derivations) follow the tables.
"""

from __future__ import annotations

import re

import attention_parity
import pytest
import safetensors.torch
import torch
import transformers
from attention_parity import build_hf, compare, config_matches, key_map_matches
from conftest import build_tiny_hf

from hooked.models.gemma2 import Gemma2Config
from hooked.models.qwen2 import Qwen2Config
from hooked.ops.rotary import rope_inv_freq
from loaders.load import from_hf
from loaders.registry import REGISTRY, find_architecture

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)
GEMMA = {**COMMON, "head_dim": 24, "sliding_window": 16, "query_pre_attn_scalar": 24}
GEMMA3 = {**GEMMA, "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": dict(rope_type="default", rope_theta=1e6),
                              "sliding_attention": dict(rope_type="default", rope_theta=100.0)}}
QWEN_SLIDING = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=3)

FAMILIES = {  # family -> (HF config class, HF model class, base config, {variant: overrides})
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {**COMMON, "sliding_window": 16}, {
        "gqa_2": dict(num_key_value_heads=2),
        "mha": dict(num_key_value_heads=4),
        "mqa_3_layers": dict(num_key_value_heads=1, num_hidden_layers=3),
        "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
        "window_1": dict(num_key_value_heads=2, sliding_window=1),  # each token reads only itself
        "no_window": dict(num_key_value_heads=2, sliding_window=None),
        "head_dim_24_theta": dict(num_key_value_heads=2, head_dim=24,
                                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    }),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, COMMON, {
        "gqa_2": dict(num_key_value_heads=2),
        "mqa_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
        "sliding_top_layers": dict(num_key_value_heads=2, **QWEN_SLIDING),  # layer 0 full, 1 and 2 windowed
        "sliding_all_tied": dict(num_key_value_heads=4, tie_word_embeddings=True,
                                 **{**QWEN_SLIDING, "max_window_layers": 0}),
        "window_off": dict(num_key_value_heads=2, use_sliding_window=False, sliding_window=16, max_window_layers=0),
    }),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**COMMON, "head_dim": 24}, {
        "gqa_2": dict(num_key_value_heads=2),
        "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
        "mqa_bias": dict(num_key_value_heads=1, attention_bias=True),
        "head_dim_16": dict(num_key_value_heads=4, head_dim=16),
        "sliding_top_layers": dict(num_key_value_heads=2, **QWEN_SLIDING),
    }),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, GEMMA, {
        "gqa_2": dict(num_key_value_heads=2),  # default caps (50, 30): barely active
        "caps_active": dict(num_key_value_heads=2, attn_logit_softcapping=0.5, final_logit_softcapping=0.25),
        "untied_mha_no_caps": dict(num_key_value_heads=4, tie_word_embeddings=False, attn_logit_softcapping=None,
                                   final_logit_softcapping=None),
        "mqa_3_layers": dict(num_key_value_heads=1, num_hidden_layers=3, query_pre_attn_scalar=7),
        "window_1_bias": dict(num_key_value_heads=2, sliding_window=1, attention_bias=True),
    }),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3, {
        "local_global": dict(num_key_value_heads=2),  # layers: local, global, local
        "global_linear_rope_untied": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=10.0)}),
        "default_pattern_7_layers": dict(num_key_value_heads=2, num_hidden_layers=7, layer_types=None,
                                         sliding_window=8),  # five local, one global, one local
        "final_cap_mha": dict(num_key_value_heads=4, final_logit_softcapping=0.25,
                              attn_logit_softcapping=0.5),  # HF's Gemma 3 ignores the attention cap: so do we
    }),
}
INPUTS = {  # name -> (real lengths per row, padding side)
    "len1": ([1, 1], "left"),
    "len67": ([67], "left"),
    "left_pad": ([67, 40, 1], "left"),
    "right_pad": ([23, 67], "right"),
}
CASES = [(f, v) for f, (_, _, _, variants) in FAMILIES.items() for v in variants]


def hf_config(family: str, variant: str):
    config_cls, _, base, variants = FAMILIES[family]
    return config_cls(**{**base, **variants[variant]})


def make_hf(family: str, variant: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    return build_hf(hf_config(family, variant), FAMILIES[family][1], dtype, device)


def hf_windows(hf) -> list[int | None]:
    """Each HF layer's window (Mistral's attention reads the config's; the others keep their own)."""
    return [layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window") else hf.config.sliding_window
            for layer in hf.model.layers]


def make_batch(lengths, side, device="cpu"):
    return attention_parity.make_batch(lengths, side, VOCAB, 1, device)


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("family, variant", CASES)
def test_parity_cpu_float32(family: str, variant: str, inputs: str, assert_rel_close) -> None:
    hf = make_hf(family, variant)
    model = from_hf(hf)
    assert isinstance(model.cfg, type(REGISTRY[family].config_from_hf(hf.config.to_dict())))
    tokens, mask = make_batch(*INPUTS[inputs])
    compare(hf, hf.model.layers, model, tokens, mask, 1e-4, assert_rel_close)


OTHER_DTYPES = [(f, v) for f, v in CASES if v in ("gqa_2", "tied", "sliding_top_layers", "mqa_tied", "caps_active",
                                                  "local_global")]


@pytest.mark.parametrize("dtype, rel, inputs", [(torch.float64, 1e-4, ["len67"]),
                                                 (torch.bfloat16, 2e-2, ["len67", "right_pad", "left_pad"])])
@pytest.mark.parametrize("family, variant", OTHER_DTYPES)
def test_parity_cpu_other_dtypes(family: str, variant: str, dtype: torch.dtype, rel: float, inputs: list[str],
                                 assert_rel_close) -> None:
    """float64 and bf16 on the CPU. No padding in float64: HF's float32 softmax turns its float64
    mask into -inf, so a query that sees no key (a left-padding query; with a window, a right-padding
    query past the window) is NaN in HF, and the NaN reaches real rows through 0 * NaN in the next
    layer (see test_parity_llama). Ours stays finite: test_parity_llama checks padded rows there."""
    hf = make_hf(family, variant, dtype=dtype)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {dtype}
    for name in inputs:
        compare(hf, hf.model.layers, model, *make_batch(*INPUTS[name]), rel, assert_rel_close)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("family, variant", OTHER_DTYPES)
def test_parity_gpu(family: str, variant: str, dtype: torch.dtype, rel: float, cuda: torch.device,
                    assert_rel_close) -> None:
    hf = make_hf(family, variant, dtype=dtype, device=cuda)
    model = from_hf(hf)
    assert next(model.parameters()).device.type == "cuda"
    for name in ("len67", "left_pad"):
        compare(hf, hf.model.layers, model, *make_batch(*INPUTS[name], device=cuda), rel, assert_rel_close)


@pytest.mark.parametrize("family, variant", CASES)
def test_config_windows_and_key_map(family: str, variant: str) -> None:
    hf = make_hf(family, variant)
    arch = find_architecture(hf.config.to_dict())
    assert arch is REGISTRY[family]
    cfg = arch.config_from_hf(hf.config.to_dict())
    config_matches(cfg, hf.config)
    model = arch.build(cfg)
    assert [b.attn.window for b in model.blocks] == hf_windows(hf)
    key_map_matches(arch, cfg, model, hf)
    rotary, kinds = hf.model.rotary_emb, getattr(hf.config, "layer_types", None)
    for l, block in enumerate(model.blocks):  # Gemma 3: one table per layer kind
        expected = getattr(rotary, f"{kinds[l]}_inv_freq", None) if kinds else None
        expected = rotary.inv_freq if expected is None else expected
        rope = block.attn.rotary
        torch.testing.assert_close(rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling)), expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- per family
@pytest.mark.parametrize("family, variant", [("mistral", "gqa_2"), ("qwen2", "sliding_top_layers")])
def test_window_is_in_the_pattern(family: str, variant: str) -> None:
    """On a windowed layer hook_pattern is zero for keys W or more tokens back; rows sum to one."""
    model = from_hf(make_hf(family, variant))
    tokens, _ = make_batch([40], "left")
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    q, k = torch.arange(40)[:, None], torch.arange(40)[None]
    for l, block in enumerate(model.blocks):
        window = block.attn.window or 10**9
        outside = (k <= q - window) | (k > q)
        pattern = cache["pattern", l]
        assert (pattern[..., outside] == 0).all() and (pattern[..., ~outside] > 0).all()
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))
    assert any(b.attn.window for b in model.blocks)


def test_ministral_layer_types_are_refused() -> None:
    raw = {**COMMON, "model_type": "mistral", "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(NotImplementedError, match="Ministral"):
        REGISTRY["mistral"].config_from_hf(raw)


@pytest.mark.parametrize("raw, window, types", [
    (dict(use_sliding_window=False, sliding_window=4096, max_window_layers=1), None, ("full_attention",) * 3),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), 8,
     ("full_attention", "full_attention", "sliding_attention")),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"]), 8,
     ("sliding_attention", "full_attention", "sliding_attention")),
])
def test_qwen2_raw_config_windows(raw: dict, window, types) -> None:
    """A raw config.json (no layer_types) gets HF's rule; HF's own config class agrees."""
    cfg = REGISTRY["qwen2"].config_from_hf({**COMMON, "num_hidden_layers": 3, **raw})
    assert (cfg.sliding_window, cfg.layer_types) == (window, types)
    hc = transformers.Qwen2Config(**{**COMMON, "num_hidden_layers": 3, **raw})
    assert (hc.sliding_window, tuple(hc.layer_types)) == (window, types)


def test_gemma2_soft_caps_are_active_and_bound() -> None:
    """In "caps_active" both caps saturate (inputs far beyond the cap), and the outputs stay inside it."""
    model = from_hf(make_hf("gemma2", "caps_active"))
    tokens, _ = make_batch([67], "left")
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "softcap" in n)
    for where, cap in [("blocks.0.attn.softcap", 0.5), ("blocks.1.attn.softcap", 0.5), ("unembed.softcap", 0.25)]:
        before, after = cache[f"{where}.hook_in"], cache[f"{where}.hook_out"]
        assert before.abs().max() > 4 * cap, where
        assert after.abs().max() <= cap
        torch.testing.assert_close(after, cap * torch.tanh(before / cap))


@pytest.mark.parametrize("config_cls", [Qwen2Config, Gemma2Config])
@pytest.mark.parametrize("kwargs, match", [
    (dict(layer_types=("full_attention",)), "1 entries for 2 layers"),
    (dict(layer_types=("full_attention", "chunked_attention")), "unknown layer types"),
    (dict(layer_types=("sliding_attention", "full_attention"), sliding_window=None), "sliding_window is None"),
])
def test_bad_layer_types_are_named(config_cls, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_cls(n_layers=2, d_model=16, n_heads=2, d_mlp=8, d_vocab=10, **kwargs)


def test_gemma_bidirectional_attention_is_refused() -> None:
    raw = transformers.Gemma3TextConfig(**{**GEMMA3, "use_bidirectional_attention": True}).to_dict()
    with pytest.raises(NotImplementedError, match="bidirectional"):
        REGISTRY["gemma3"].config_from_hf(raw)


@pytest.mark.parametrize("inputs", ["len1", "left_pad", "right_pad"])
def test_gemma3_multimodal_checkpoint_loads_its_language_model(inputs: str, assert_rel_close, tmp_path) -> None:
    """Gemma3ForConditionalGeneration (4B and larger): text in, the language model's logits out;
    the vision tower's tensors are ignored, not reported as unexpected, in memory and on disk."""
    from loaders import from_pretrained

    text = {**GEMMA3, "final_logit_softcapping": 3.0}  # set, and not applied by HF's multimodal class
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    hf = build_tiny_hf(config, transformers.Gemma3ForConditionalGeneration, perturb=0.1)
    model = from_hf(hf)
    assert model.family == "Gemma3" and model.unembed.softcap is None
    tokens, mask = make_batch(*INPUTS[inputs])
    compare(hf, hf.model.language_model.layers, model, tokens, mask, 1e-4, assert_rel_close)
    hf.save_pretrained(tmp_path)
    legacy = tmp_path / "legacy"  # the released files' names: language_model.model.*, vision_tower.*
    hf.save_pretrained(legacy)
    state = safetensors.torch.load_file(legacy / "model.safetensors")
    def released(name: str) -> str:
        name = re.sub(r"^model\.(vision_tower|multi_modal)", r"\1", name)
        return re.sub(r"^model\.language_model\.", "language_model.model.", name)

    renamed = {released(n): t for n, t in state.items()}
    assert any(n.startswith("language_model.model.layers.") for n in renamed)
    safetensors.torch.save_file(renamed, legacy / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        for d in (tmp_path, legacy):
            assert torch.equal(from_pretrained(d)(tokens, mask), model(tokens, mask)), d


# --------------------------------------------------------------- released checkpoints' configs
REAL = {  # config.json fields shaped like released checkpoints (no weights): sizes, windows, rope, caps
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                    tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False,
                  sliding_window=32768, max_window_layers=21, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                  use_sliding_window=False, sliding_window=None, max_window_layers=28, tie_word_embeddings=True),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=2304,
                   intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10000.0),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152,
                   intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                   rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, max_position_embeddings=32768,
                   final_logit_softcapping=None, attn_logit_softcapping=None),
}


@pytest.mark.parametrize("family", list(REAL))
def test_released_config_builds_hf_shapes(family: str) -> None:
    """A config.json like a released checkpoint's, read as loaders.read_config reads it (through
    HF's config class): every tensor of our key map has HF's shape (both models on the meta device),
    and the layer windows and rope bases are HF's."""
    from loaders.load import normalise_config
    from loaders.meta import on_meta as params_on_meta

    raw = normalise_config(dict(REAL[family]))
    arch = find_architecture(raw)
    assert arch is REGISTRY[family]
    cfg = arch.config_from_hf(raw)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**REAL[family]))
    with params_on_meta():
        model = arch.build(cfg)
    theirs = {n: t.shape for n, t in hf.state_dict().items()}
    ours = dict(model.named_parameters())
    for name, key in arch.key_map(cfg).items():
        source = next(n for n in key.names if n in theirs)
        assert tuple(ours[name].shape) == tuple(theirs[source]), name
    assert [b.attn.window for b in model.blocks] == hf_windows(hf)
    rotary, kinds = type(hf.model.rotary_emb)(hf.config), getattr(hf.config, "layer_types", None)  # off meta
    for l, block in enumerate(model.blocks):
        expected = getattr(rotary, f"{kinds[l]}_inv_freq", None) if kinds else None
        expected = rotary.inv_freq if expected is None else expected
        rope = block.attn.rotary
        torch.testing.assert_close(rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling)), expected,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family, variant", [("mistral", "tied"), ("qwen2", "sliding_top_layers"),
                                             ("qwen3", "mqa_bias"), ("gemma2", "untied_mha_no_caps"),
                                             ("gemma3", "local_global")])
def test_saved_checkpoint_loads_like_the_model_in_memory(family: str, variant: str, tmp_path) -> None:
    """save_pretrained (safetensors, config.json as HF writes it) -> from_pretrained == from_hf, bit for bit."""
    from loaders import from_pretrained

    hf = make_hf(family, variant)
    hf.save_pretrained(tmp_path)
    loaded, direct = from_pretrained(tmp_path), from_hf(hf)
    assert loaded.cfg == direct.cfg
    tokens, mask = make_batch(*INPUTS["left_pad"])
    with torch.no_grad():
        assert torch.equal(loaded(tokens, mask), direct(tokens, mask))
