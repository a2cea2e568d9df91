"""Parity of the mixture-of-experts transformers (Mixtral, OLMoE, Qwen3-MoE, GPT-OSS) with HF transformers.

One table of tiny random HF models (every parameter perturbed), compared as in test_parity_families.py:
logits, the embedding, every resid_post and ln_final's output at real positions, within `rel` of the HF
tensor's max magnitude, on ragged left- and right-padded batches. Then, per family: float64, each row of
a left-padded batch == that prompt alone, incremental decoding == recompute, HF's router choices and
weights == ours, save_pretrained -> from_pretrained (the on-disk expert layout), the released sizes
built on meta with HF's shapes and the published parameter counts, expert ablation == zeroed weights,
weight processing (fold_ln) keeps the logits. GPT-OSS's sinks, windows and clamp have their own checks.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
import types

import pytest
import safetensors
import safetensors.torch
import torch
import transformers as T
from attention_parity import build_hf, compare, key_map_matches, make_batch, run_ours

from analysis.interventions.experts import ablate_experts
from hooked import backends
from hooked.models.decode_state import DecodeState
from hooked.ops.rotary import rope_attention_factor, rope_inv_freq
from loaders import from_pretrained
from loaders.load import from_hf
from loaders.meta import build_on_meta
from loaders.registry import REGISTRY, find_architecture

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, eos_token_id=None, bos_token_id=None)
GPT_OSS = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
               num_hidden_layers=3)  # layers: sliding, full, sliding (HF's default alternation)

FAMILIES = {  # family -> (HF config class, HF model class, base config, {variant: overrides})
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {**COMMON, "intermediate_size": 32, "num_local_experts": 4}, {
        "top2_of_4": dict(num_experts_per_tok=2),
        "top1_window_16_mqa": dict(num_experts_per_tok=1, sliding_window=16, num_key_value_heads=1),
        "top4_of_4_tied": dict(num_experts_per_tok=4, tie_word_embeddings=True),
    }),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, {**COMMON, "intermediate_size": 32, "num_experts": 4}, {
        "top2_softmax_weights": dict(num_experts_per_tok=2),  # norm_topk_prob=False, as OLMoE-1B-7B
        "top3_renormalised_mha": dict(num_experts_per_tok=3, norm_topk_prob=True, num_key_value_heads=4),
    }),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  {**COMMON, "intermediate_size": 48, "moe_intermediate_size": 24, "num_experts": 4, "head_dim": 16}, {
        "top2_renormalised": dict(num_experts_per_tok=2, norm_topk_prob=True),  # as Qwen3-30B-A3B
        "dense_layer_0": dict(num_experts_per_tok=2, mlp_only_layers=[0]),
        "sparse_step_2_sliding": dict(num_experts_per_tok=3, decoder_sparse_step=2, num_hidden_layers=3,
                                      use_sliding_window=True, sliding_window=16, norm_topk_prob=True),
    }),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, {**COMMON, **GPT_OSS}, {
        "alternating": {},  # YaRN rope (HF's default), window 16 on even layers
        "strong_sinks_tight_clamp": dict(swiglu_limit=0.3),  # sinks set to N(2, 1) below; the clamp bites
        "window_1_full_top1": dict(sliding_window=1, num_experts_per_tok=1, num_key_value_heads=1,
                                   layer_types=["sliding_attention", "full_attention", "full_attention"],
                                   rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    }),
}
INPUTS = {"len1": ([1, 1], "left"), "len67": ([67], "left"), "left_pad": ([67, 40, 1], "left"),
          "right_pad": ([23, 67], "right")}
CASES = [(f, v) for f, (_, _, _, variants) in FAMILIES.items() for v in variants]
FIRST = [(f, next(iter(variants))) for f, (_, _, _, variants) in FAMILIES.items()]


def hf_config(family: str, variant: str):
    config_cls, _, base, variants = FAMILIES[family]
    return config_cls(**{**base, **variants[variant]})


def make_hf(family: str, variant: str, dtype: torch.dtype = torch.float32):
    hf = build_hf(hf_config(family, variant), FAMILIES[family][1], dtype)
    if dtype == torch.float64:
        hf.config._experts_implementation = "eager"  # HF's default grouped_mm takes no float64 (its loop does)
    if variant == "strong_sinks_tight_clamp":
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.sinks.copy_(2.0 + torch.randn(layer.self_attn.sinks.shape, generator=g))
    return hf


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("family, variant", CASES)
def test_parity_cpu_float32(family: str, variant: str, inputs: str, assert_rel_close) -> None:
    hf = make_hf(family, variant)
    model = from_hf(hf)
    assert isinstance(model.cfg, type(REGISTRY[family].config_from_hf(hf.config.to_dict())))
    tokens, mask = make_batch(*INPUTS[inputs], VOCAB)
    compare(hf, hf.model.layers, model, tokens, mask, 1e-4, assert_rel_close)


def _float64_forward(module):
    """`module`'s HF forward, from HF's own source with its float32 casts made float64."""
    method = type(module).forward
    source = "\n".join(line for line in textwrap.dedent(inspect.getsource(method)).splitlines()
                       if not line.lstrip().startswith("@"))
    replaced = (source.replace("torch.float32", "torch.float64").replace("dtype=torch.float)", "dtype=torch.float64)")
                .replace("dtype=torch.float,", "dtype=torch.float64,").replace(".float()", ".double()"))
    assert replaced != source, f"{method.__qualname__}: no float32 cast found; HF's source changed"
    namespace = dict(method.__globals__)
    exec(compile(replaced, f"<{method.__qualname__}, float64>", "exec"), namespace)
    return types.MethodType(namespace[method.__name__], module)


def hf_in_float64(hf, model):
    """HF's float64 model with its float32 parts made float64: the RMSNorms, the routers' softmax, the rotary
    forward (cast replaced in HF's source) and its frequencies (our float64 table: bit-equal to HF's in float32,
    test_config_windows_rope_and_key_map); attention through SDPA (its math kernel keeps float64; HF's eager
    softmax is float32), except GPT-OSS, whose eager softmax runs in the scores' dtype and which has no SDPA."""
    for module in hf.modules():
        if type(module).__name__.endswith(("RMSNorm", "RotaryEmbedding", "TopKRouter")) and not (
                type(module).__name__ == "GptOssTopKRouter"):  # its softmax is in the logits' dtype already
            module.forward = _float64_forward(module)
    rope = model.blocks[0].attn.rotary
    hf.model.rotary_emb.inv_freq = rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling), torch.float64)
    if hf.config.model_type != "gpt_oss":
        hf.config._attn_implementation = "sdpa"
    return hf


@pytest.mark.parametrize("family, variant", CASES)
def test_parity_float64_where_hf_allows(family: str, variant: str, assert_rel_close) -> None:
    """float64 within 1e-10 of HF's float64 model with its float32 parts made float64 (hf_in_float64)."""
    hf = make_hf(family, variant, dtype=torch.float64)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    compare(hf_in_float64(hf, model), hf.model.layers, model, *make_batch([67], "left", VOCAB), 1e-10,
            assert_rel_close)


@pytest.mark.parametrize("family, variant", FIRST)
def test_float64_gap_to_hf_as_shipped_is_float32s(family: str, variant: str) -> None:
    """Against HF's float64 model as shipped (float32 norms, router softmax, rotary, eager softmax) the gap is
    float32's, 1e-9 < gap < 1e-5: what 1e-10 needs hf_in_float64 for."""
    hf = make_hf(family, variant, dtype=torch.float64)
    model = from_hf(hf)
    tokens, mask = make_batch([67], "left", VOCAB)
    with torch.no_grad():
        want = hf(tokens, attention_mask=mask).logits
        gap = ((model(tokens, mask) - want).abs().max() / want.abs().max()).item()
    assert 1e-9 < gap < 1e-5, gap


BF16 = [("mixtral", "top2_of_4"), ("mixtral", "top4_of_4_tied"), ("qwen3_moe", "top2_renormalised"),
        ("qwen3_moe", "sparse_step_2_sliding")]


@pytest.mark.parametrize("family, variant", BF16)
def test_parity_cpu_bfloat16(family: str, variant: str, assert_rel_close) -> None:
    """bf16 within 2e-2: the router's linear runs in bf16 as HF's (MoE narrow_router), so bf16 ties pick HF's
    experts. Variants whose tiny random routers meet a bf16 near-tie at some position (GPT-OSS's, OLMoE's)
    flip an expert there, as any two bf16 implementations may (GPT-OSS window_1: layer 2, position 29, router
    logits 0.0410 / 0.0347 in HF, 0.0354 / 0.0413 here), and are left out."""
    hf = make_hf(family, variant, dtype=torch.bfloat16)
    model = from_hf(hf)
    with backends.use(attention="eager"):
        for lengths, side in (([67], "left"), ([23, 67], "right"), ([67, 40, 1], "left")):
            compare(hf, hf.model.layers, model, *make_batch(lengths, side, VOCAB), 2e-2, assert_rel_close)


@pytest.mark.parametrize("family, variant", CASES)
def test_config_windows_rope_and_key_map(family: str, variant: str) -> None:
    hf = make_hf(family, variant)
    arch = find_architecture(hf.config.to_dict())
    assert arch is REGISTRY[family]
    cfg = arch.config_from_hf(hf.config.to_dict())
    model = arch.build(cfg)
    key_map_matches(arch, cfg, model, hf)
    hf_windows = [getattr(layer.self_attn, "sliding_window", None) or (
        hf.config.sliding_window if family in ("mixtral", "qwen3_moe") else None) for layer in hf.model.layers]
    assert [b.attn.window for b in model.blocks] == hf_windows
    rope, hf_rope = model.blocks[0].attn.rotary, hf.model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling)), hf_rope.inv_freq,
                               rtol=0, atol=0)
    assert rope_attention_factor(dict(rope.scaling)) == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    moe_layers = [l for l, b in enumerate(model.blocks) if hasattr(b.mlp, "router")]
    hf_moe = [l for l, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == hf_moe and moe_layers


def test_gpt_oss_yarn_is_active_and_matters() -> None:
    """The default GPT-OSS rope is YaRN (factor 32): its frequencies and cos/sin scale differ from plain rope."""
    cfg = REGISTRY["gpt_oss"].config_from_hf(make_hf("gpt_oss", "alternating").config.to_dict())
    plain = rope_inv_freq(16, cfg.rope_theta)
    yarn = rope_inv_freq(16, cfg.rope_theta, cfg.rope_scaling)
    assert cfg.rope_scaling["rope_type"] == "yarn" and not torch.allclose(plain, yarn)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)


# ------------------------------------------------------------------------------- per family
@pytest.mark.parametrize("family, variant", FIRST)
def test_left_padded_rows_equal_each_prompt_alone(family: str, variant: str, assert_rel_close) -> None:
    hf = make_hf(family, variant)
    model = from_hf(hf)
    lengths = [30, 19, 7, 1]
    tokens, mask = make_batch(lengths, "left", VOCAB)
    width = tokens.shape[1]
    with torch.no_grad():
        padded = model(tokens, attention_mask=mask)
        for b, n in enumerate(lengths):
            alone = model(tokens[b:b + 1, width - n:])
            assert_rel_close(padded[b:b + 1, width - n:], alone, 1e-5, f"row {b} vs alone")
            assert_rel_close(alone, hf(tokens[b:b + 1, width - n:]).logits, 1e-4, f"row {b} vs HF alone")


@pytest.mark.parametrize("family, variant", FIRST)
def test_incremental_decoding_equals_recompute(family: str, variant: str) -> None:
    model = from_hf(make_hf(family, variant))
    tokens = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded prompt, read once with its mask
    with torch.no_grad():
        full = model(tokens, mask)
        state = DecodeState()
        parts = [model(tokens[:, :17], mask[:, :17], state=state)]  # past the window of 16
        parts += [model(tokens[:, i:i + 1], state=state) for i in range(17, 22)]
        parts.append(model(tokens[:, 22:], state=state))  # two positions at once
        step = torch.cat(parts, dim=1)
    real = mask.bool()
    assert ((step - full)[real].abs().max() / full[real].abs().max()).item() < 1e-5
    assert state.length == 24


@pytest.mark.parametrize("family, variant", CASES)
def test_router_choices_and_weights_equal_hfs(family: str, variant: str) -> None:
    """Each MoE layer's chosen experts and their weights equal HF's router outputs on the same input."""
    hf = make_hf(family, variant)
    model = from_hf(hf)
    tokens, mask = make_batch([40, 23], "left", VOCAB)
    seen = {}
    routers = {l: (layer.mlp.router if family == "gpt_oss" else layer.mlp.gate)
               for l, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}
    handles = [r.register_forward_hook(lambda m, i, o, l=l: seen.__setitem__(l, o)) for l, r in routers.items()]
    try:
        with torch.no_grad():
            hf(tokens, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    finally:
        for h in handles:
            h.remove()
    names = [f"blocks.{l}.mlp.hook_{n}" for l in routers for n in ("chosen", "routing_weights")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    real = mask.bool().reshape(-1)
    for l, (_, hf_weights, hf_chosen) in seen.items():
        k = model.blocks[l].mlp.top_k
        chosen = cache[f"blocks.{l}.mlp.hook_chosen"].reshape(-1, k)[real]
        weights = cache[f"blocks.{l}.mlp.hook_routing_weights"].reshape(-1, k)[real]
        # the same set of experts per token, each with HF's weight (slot order may differ on ties)
        ours = torch.zeros(real.sum(), model.blocks[l].mlp.n_experts).scatter(1, chosen, weights)
        theirs = torch.zeros_like(ours).scatter(1, hf_chosen[real], hf_weights[real].float())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


ON_DISK = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",  # what save_pretrained writes
           "olmoe": "model.layers.0.mlp.experts.3.gate_proj.weight",
           "qwen3_moe": "model.layers.0.mlp.experts.3.gate_proj.weight",
           "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj"}  # GPT-OSS: stored as in memory


@pytest.mark.parametrize("family, variant", FIRST)
def test_save_pretrained_round_trip(family: str, variant: str, tmp_path) -> None:
    """HF's save_pretrained writes the on-disk layout (per-expert tensors where HF converts them); from_pretrained
    reads it back to the same model as from_hf, and HF reloads the same logits."""
    hf = make_hf(family, variant)
    hf.save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert ON_DISK[family] in set(f.keys())
    loaded, direct = from_pretrained(tmp_path, dtype=torch.float32), from_hf(hf)
    assert loaded.cfg == direct.cfg
    for (name, p), (name2, q) in zip(loaded.named_parameters(), direct.named_parameters(), strict=True):
        assert name == name2
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    tokens, mask = make_batch([20, 9], "left", VOCAB)
    reloaded = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, mask)[mask.bool()],
                                   reloaded(tokens, attention_mask=mask).logits[mask.bool()], rtol=0, atol=1e-4)


RELEASED = {  # name -> (HF config class, HF model class, the release's config.json sizes, published count)
    "Mixtral-8x7B": (T.MixtralConfig, T.MixtralForCausalLM, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1e6)), 46_702_792_704),
    "OLMoE-1B-7B": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096), 6_919_161_856),
    "Qwen3-30B-A3B": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960), 30_532_122_624),
    "gpt-oss-20b": (T.GptOssConfig, T.GptOssForCausalLM, dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072), 20_914_757_184),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_sizes_build_on_meta_with_hfs_shapes_and_the_published_count(name: str) -> None:
    config_cls, model_cls, fields, published = RELEASED[name]
    config = config_cls(**fields)
    with torch.device("meta"):
        hf = model_cls(config)
    arch = find_architecture(config.to_dict())
    cfg = arch.config_from_hf(config.to_dict())
    model = build_on_meta(arch.build, cfg)
    ours = dict(model.named_parameters())
    assert sum(p.numel() for p in ours.values()) == sum(p.numel() for p in hf.parameters()) == published
    theirs = hf.state_dict()
    for mine, key in arch.key_map(cfg).items():  # every tensor, read through the key map, has our shape
        src = next(n for n in key.names if n in theirs)
        t = theirs[src] if key.transform is None else key.transform(theirs[src])
        assert tuple(t.shape) == tuple(ours[mine].shape), mine


@pytest.mark.parametrize("family, variant", FIRST)
def test_expert_ablation_equals_zeroed_expert_weights(family: str, variant: str) -> None:
    model = from_hf(make_hf(family, variant))
    tokens = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    layer = next(l for l, b in enumerate(model.blocks) if hasattr(b.mlp, "router"))
    with torch.no_grad():
        plain = model(tokens)
        with ablate_experts(model, [(layer, 1), (layer, 3)]):
            ablated = model(tokens)
        moe = model.blocks[layer].mlp
        for name in ("down_proj", "down_bias"):
            if getattr(moe, name, None) is not None:
                getattr(moe, name)[[1, 3]] = 0.0
        zeroed = model(tokens)
    torch.testing.assert_close(ablated, zeroed, rtol=0, atol=1e-5)
    assert (ablated - plain).abs().max() > 1e-3


@pytest.mark.parametrize("family, variant", FIRST)
def test_fold_ln_keeps_the_logits(family: str, variant: str) -> None:
    """fold_ln folds ln2 into the router and every expert's gate and up rows (RMSNorm: nothing is centred)."""
    hf = make_hf(family, variant, dtype=torch.float64)
    sinks = pytest.warns(UserWarning, match="sinks") if family == "gpt_oss" else contextlib.nullcontext()
    with sinks:  # GPT-OSS: fold_value_biases is skipped (pattern rows sum to less than 1)
        plain, folded = from_hf(hf), from_hf(hf, fold_ln=True, center_unembed=True, fold_value_biases=True)
    tokens = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    assert torch.all(folded.blocks[0].ln2.weight == 1)
    with torch.no_grad():
        a, b = plain(tokens).log_softmax(-1), folded(tokens).log_softmax(-1)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------------- GPT-OSS
def test_sink_takes_the_rest_of_each_pattern_row() -> None:
    """pattern + the sink's share = 1 on every row: the share is exp(s) / (sum_k exp(score_k) + exp(s))."""
    model = from_hf(make_hf("gpt_oss", "strong_sinks_tight_clamp")).double()
    tokens = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    names = [f"blocks.0.attn.hook_{n}" for n in ("attn_scores", "pattern", "sink")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    scores, pattern, sink = (cache[n] for n in names)
    assert sink.shape == (2, 4, 20, 1)
    torch.testing.assert_close(sink[0, :, 0, 0], model.blocks[0].attn.sinks, rtol=0, atol=0)
    share = sink.exp()[..., 0] / (scores.exp().sum(-1) + sink.exp()[..., 0])
    torch.testing.assert_close(pattern.sum(-1) + share, torch.ones_like(share), rtol=0, atol=1e-12)
    assert share.mean() > 0.2 and share.min() > 0.01  # the strong sinks take a visible share


def test_an_edited_sink_is_what_the_softmax_reads() -> None:
    """A sink at -inf is no sink (rows sum to 1, as plain attention); at +inf the head writes nothing but o_proj's bias."""
    model = from_hf(make_hf("gpt_oss", "strong_sinks_tight_clamp"))
    tokens = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    names = ["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z"]

    def to(value):
        return lambda s, hook: torch.full_like(s, value)

    with torch.no_grad():
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_sink", to(float("-inf")))]):
            _, gone = model.run_with_cache(tokens, names_filter=names)
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_sink", to(1e4))]):
            _, full = model.run_with_cache(tokens, names_filter=names)
    torch.testing.assert_close(gone["blocks.0.attn.hook_pattern"].sum(-1), torch.ones(1, 4, 9))
    assert full["blocks.0.attn.hook_z"].abs().max() == 0


def test_gpt_oss_clamp_is_active_in_the_tight_variant() -> None:
    """Some expert inputs pass the limit there, so the parity above covers the clamp."""
    model = from_hf(make_hf("gpt_oss", "strong_sinks_tight_clamp"))
    tokens = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=["blocks.0.ln2.hook_normalized"])
    moe, x = model.blocks[0].mlp, cache["blocks.0.ln2.hook_normalized"]
    up = torch.einsum("bpm,efm->bpef", x, moe.up_proj) + moe.up_bias
    assert (up.abs() > moe.limit).float().mean() > 0.1


def test_gpt_oss_attention_never_takes_sdpa() -> None:
    model = from_hf(make_hf("gpt_oss", "alternating"))
    with torch.no_grad(), backends.use(attention="sdpa"):
        model(torch.tensor([[1, 2, 3]]))
    assert set(backends.active(model).values()) == {"eager"}


def test_olmoe_q_norm_is_over_all_heads() -> None:
    """OLMoE's q/k norms: one statistic per position over n_heads * d_head (HF's q_norm over hidden_size)."""
    model = from_hf(make_hf("olmoe", "top2_softmax_weights")).double()
    tokens = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.q_norm.hook_normalized"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    q = cache[names[0]]
    flat = q.flatten(-2)
    expected = flat / flat.pow(2).mean(-1, keepdim=True).add(model.cfg.eps).sqrt() * model.blocks[0].attn.q_norm.weight
    torch.testing.assert_close(cache[names[1]], expected.view_as(q), rtol=0, atol=1e-12)


def test_unsupported_configs_are_refused() -> None:
    raw = {**hf_config("olmoe", "top2_softmax_weights").to_dict(), "clip_qkv": 8.0}
    with pytest.raises(NotImplementedError, match="clip_qkv"):
        REGISTRY["olmoe"].config_from_hf(raw)


def test_run_ours_names_every_layer() -> None:
    """The parity helper reads every block (guards the table above against a silently short model)."""
    model = from_hf(make_hf("gpt_oss", "alternating"))
    _, resids = run_ours(model, *make_batch([5], "left", VOCAB))
    assert len(resids) == model.cfg.n_layers + 2


@pytest.mark.parametrize("family, variant", FIRST)
def test_cli_hooks_and_parity_and_tl(family: str, variant: str, tmp_path, capsys) -> None:
    """`hooked hooks` lists every hook (the routers' and GPT-OSS's hook_sink among them); `hooked parity` passes
    at 1e-4 against HF's checkpoint; loaders.tl.HookedTransformer.from_pretrained reads it with TL's default
    processing (fold_ln into the routers and experts): the same log-probabilities."""
    from analysis.cli import main
    from loaders.tl import HookedTransformer

    make_hf(family, variant).save_pretrained(tmp_path / "ckpt")
    assert main(["hooks", str(tmp_path / "ckpt")]) == 0
    listed = capsys.readouterr().out
    model = from_pretrained(tmp_path / "ckpt")
    for hook in model.hook_dict:
        assert f"| {hook} " in listed, hook
    assert "| blocks.1.mlp.hook_routing_weights " in listed
    assert ("| blocks.0.attn.hook_sink " in listed) == (family == "gpt_oss")
    assert main(["parity", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--tol", "1e-4"]) == 0
    assert "PASS" in capsys.readouterr().out and (tmp_path / "out" / "parity.csv").is_file()
    sinks = pytest.warns(UserWarning, match="sinks") if family == "gpt_oss" else contextlib.nullcontext()
    with pytest.warns(UserWarning, match="center_writing_weights skipped"), sinks:
        tl = HookedTransformer.from_pretrained(tmp_path / "ckpt")
    tokens, _ = make_batch([30], "left", VOCAB)
    with torch.no_grad():
        a, b = tl(tokens).log_softmax(-1), model(tokens).log_softmax(-1)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("family, variant", FIRST)
def test_tl_weight_names_of_the_router_and_each_expert(family: str, variant: str) -> None:
    """TL's names: the router W_gate [d_model n_experts] (+ b_gate) gives hook_router_logits; expert e's W_in,
    W_gate, W_out (+ biases) give its output, as the MoE computes it."""
    model = from_hf(make_hf(family, variant)).double()
    tokens = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    layer = next(l for l, b in enumerate(model.blocks) if hasattr(b.mlp, "router"))
    names = [f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.mlp.hook_router_logits"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
        moe, x = model.blocks[layer].mlp, cache[names[0]][0]
        torch.testing.assert_close(x @ moe.W_gate + moe.b_gate, cache[names[1]][0], rtol=0, atol=1e-12)
        assert moe.W_gate.shape == (model.cfg.d_model, moe.n_experts) and len(moe.experts) == moe.n_experts
        for e, ex in enumerate(moe.experts):
            gate, up = x @ ex.W_gate + ex.b_gate, x @ ex.W_in + ex.b_in
            hidden = moe.glu(gate, up) if family == "gpt_oss" else torch.nn.functional.silu(gate) * up
            torch.testing.assert_close(hidden @ ex.W_out + ex.b_out, moe.expert(e, x), rtol=0, atol=1e-12)
        assert moe.experts[1].W_in.data_ptr() == moe.up_proj[1].data_ptr()  # a view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_experts_grouped_loop_and_every_expert_paths_agree(dtype) -> None:
    """GPT-OSS's experts three ways: grouped multiplies with per-row biases (no autograd), one expert at a time
    (autograd), every expert on every token (the compile path)."""
    moe = from_hf(make_hf("gpt_oss", "strong_sinks_tight_clamp")).blocks[0].mlp.to(dtype)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(10)).to(dtype)
    chosen = torch.randint(0, 4, (40, 2), generator=torch.Generator().manual_seed(11))
    chosen[:, 1] = (chosen[:, 0] + 1) % 4
    with torch.no_grad():
        assert moe._grouped_mm_applies(x)
        grouped = moe.expert_outputs(x, chosen)
        every = moe._every_expert(x).gather(1, chosen[..., None].expand(40, 2, 64))
    with torch.enable_grad():
        loop = moe.expert_outputs(x.requires_grad_(), chosen)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grouped, loop.detach(), **tol)
    torch.testing.assert_close(every, loop.detach(), **tol)


def test_gpt_oss_mxfp4_checkpoint_loads_dequantised_as_hf(tmp_path) -> None:
    """The released gpt-oss layout (experts in MXFP4: `*_blocks` + `*_scales`) loads through mxfp4_view: each
    dequantised tensor equals HF's convert_moe_packed_tensors (bf16), and the logits equal HF's model holding those
    tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = make_hf("gpt_oss", "alternating")
    g = torch.Generator().manual_seed(12)
    state = {n: t.contiguous() for n, t in hf.state_dict().items() if not n.endswith(("gate_up_proj", "down_proj"))}
    for l, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for name, (rows, width) in {"gate_up_proj": (64, 64), "down_proj": (64, 32)}.items():
            blocks = torch.randint(0, 256, (4, rows, width // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(122, 128, (4, rows, width // 32), generator=g, dtype=torch.uint8)
            state[f"model.layers.{l}.mlp.experts.{name}_blocks"] = blocks
            state[f"model.layers.{l}.mlp.experts.{name}_scales"] = scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
            assert dense.shape == getattr(experts, name).shape
            with torch.no_grad():
                getattr(experts, name).copy_(dense.float())
    hf.config.save_pretrained(tmp_path)
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = from_pretrained(tmp_path, dtype=torch.float32)
    direct = from_hf(hf)
    for (name, p), (_, q) in zip(model.named_parameters(), direct.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    tokens, mask = make_batch([20, 9], "left", VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, mask)[mask.bool()], hf(tokens, attention_mask=mask).logits[mask.bool()],
                                   rtol=0, atol=1e-4)
