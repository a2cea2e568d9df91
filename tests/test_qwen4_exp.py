"""Qwen4-Exp (text: delta-rule and QSA attention layers on hyper-connected streams, per-layer n-gram embeddings,
MoE): parity with HF transformers 5.24 and the new parts' invariants (issue 41, item 3).

Parity, per variant ("ple_qsa": 2 streams, PLE on two delta layers, QSA keeping 2 of 2-key blocks, an eos in the
tokens; "gate_sigmoid_tied": 3 streams, a sigmoid output gate, partial rotary 0.5, tied, QSA 4-key blocks, no
PLE): float32 logits, the embedding, every resid_post and the final read within 1e-4 of HF's max magnitude (the
chunked rule too); float64 at HF's float32 level (1e-4: HF's delta rule and norms compute in float32 even in a
float64 model, as tests/test_parity_delta_families.py says); each left-padded row == that prompt alone == HF on
the prompt alone (HF counts positions over padding, so HF padded is no reference); decoding step by step from a
DecodeState == the whole sequence == HF; save_pretrained (the n-gram table in shards, experts one tensor each)
-> from_pretrained bit for bit; a vision-language config reads its text part; a released-sized config
(HF's defaults plus QSA and one PLE layer: the 45-billion-row n-gram table) on meta with HF's shape for every
tensor and its parameter count; configs HF rejects refused by name.

Parts (float64 unless said): the n-gram ids == a brute-force Python reference (documents cut at eos); the QSA
selection == HF's indexer's mask, and the pattern is zero outside it; the streams are a plain sum (embedding,
PLE and every hook_{kind}_out add up to resid_post, 1e-12); a read's hook_scale factor gives the read back
(linear); zeroing hook_attn_out removes the sublayer; knockout on the delta layer == zeroing its kernel entries
(1e-10); fold_ln refused by name. The every-family tests (tiny_families.py) add hook axes, the model map,
attribution and circuits (exact through the streams), state edits and decode-step knockout.
"""

from __future__ import annotations

import functools
import json

import pytest
import safetensors.torch
import torch
import transformers
from hybrid_checks import (check_against_hf, check_decoding, check_knockout_equals_kernel_zeroing,
                           check_released_on_meta, check_rows_alone, check_save_pretrained, close, perturbed)

from analysis.interventions import knockout
from hooked import backends
from hooked.ops import ngram_hash
from loaders.load import from_hf, from_pretrained
from loaders.registry import REGISTRY

V = 64
BASE = dict(vocab_size=V, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=12, shared_expert_intermediate_size=10, num_experts=4, num_experts_per_tok=2,
            hc_lowrank=6, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, eos_token_id=1, pad_token_id=0,
            num_hidden_layers=4)
VARIANTS = {
    "ple_qsa": dict(hc_count=2, ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_budget=4,
                    indexer_compress_ratio=2,
                    layer_types=["linear_attention", "indexed_attention", "linear_attention", "full_attention"]),
    "gate_sigmoid_tied": dict(hc_count=3, output_gate_type="sigmoid", tie_word_embeddings=True, indexer_budget=8,
                              indexer_compress_ratio=4, indexer_head_dim=6, linear_conv_kernel_dim=3,
                              rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
                              layer_types=["indexed_attention", "linear_attention", "linear_attention",
                                           "indexed_attention"]),
}


def make_hf(variant: str = "ple_qsa", dtype: torch.dtype = torch.float32):
    config = transformers.Qwen4ExpTextConfig(**{**BASE, **VARIANTS[variant]})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # HF's grouped_mm path refuses float64
    torch.manual_seed(0)
    return perturbed(transformers.Qwen4ExpForCausalLM(config), scale=0.2).to(dtype)


@functools.cache
def model64(variant: str = "ple_qsa"):
    return from_hf(make_hf(variant, torch.float64))


def tokens(batch: int = 2, pos: int = 15, seed: int = 1) -> torch.Tensor:
    t = torch.randint(2, V, (batch, pos), generator=torch.Generator().manual_seed(seed))
    t[0, 6] = 1  # an eos: the n-grams after it start a new document
    return t



# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_and_every_resid_equal_hf(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    check_against_hf(hf, model, tokens())
    with backends.use(scan="chunked"):
        check_against_hf(hf, model, tokens(pos=23, seed=3))


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_equals_hf_at_its_float32_level(variant):
    hf = make_hf(variant, torch.float64)
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    check_against_hf(hf, model, tokens(pos=17), rel=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_each_prompt_alone_and_hf_alone(variant):
    hf = make_hf(variant)
    check_rows_alone(hf, from_hf(hf), lengths=(16, 11, 5, 1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_the_state_equals_recompute_and_hf(variant):
    """Prefill 5 tokens, then 1, 2, 1, ...: the n-gram context, the PLE and delta convs, S and the index keys carried."""
    hf = make_hf(variant)
    check_decoding(hf, from_hf(hf), tokens(pos=14), steps=[5, 1, 2, 1, 1, 3, 1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    hf = make_hf(variant)
    check_save_pretrained(hf, tokens(), tmp_path)
    names = set(safetensors.safe_open(tmp_path / "model.safetensors", "pt").keys())
    if hf.config.ple_layer_ids:  # HF's own on-disk layout: the table in split_ngram_parts shards
        assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight" in names


def test_a_vision_language_config_reads_its_text_part(tmp_path):
    hf = make_hf()
    config = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
              "text_config": hf.config.to_dict(), "vision_config": {"depth": 1, "hidden_size": 16}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v.contiguous()
             for k, v in hf.state_dict().items()}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    check_against_hf(hf, from_pretrained(tmp_path), tokens())
    with pytest.raises(ValueError, match="without a text_config"):
        REGISTRY["qwen4_exp"].config_from_hf({"model_type": "qwen4_exp", "vision_config": {}})


RELEASED = dict(model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"], indexer_n_heads=16,
                indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=64,
                ple_layer_ids=[1], eos_token_id=248046,  # HF's defaults (40 layers, 512 experts) + QSA + one PLE,
                rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))


def test_released_config_builds_hf_shapes_on_meta():
    check_released_on_meta(RELEASED, "qwen4_exp", transformers.Qwen4ExpForCausalLM)


@pytest.mark.parametrize("field, value, match", [
    ("ple_layer_ids", [2], "PLE"),  # layer 2 is attention
    ("indexer_kv_heads", 2, "indexer_kv_heads"),
    ("indexer_budget", 3, "indexer_budget"),
])
def test_configs_hf_rejects_are_refused_by_name(field, value, match):
    fields = {**BASE, **VARIANTS["ple_qsa"], field: value}
    with pytest.raises(Exception, match=match):  # HF's own refusal
        transformers.Qwen4ExpTextConfig(**fields)
    with pytest.raises(ValueError, match=match):
        REGISTRY["qwen4_exp"].config_from_hf(dict(fields, model_type="qwen4_exp_text"))


def test_attention_layers_without_qsa_fields_are_refused_by_name():
    fields = {k: v for k, v in {**BASE, **VARIANTS["ple_qsa"]}.items() if not k.startswith("indexer_")}
    with pytest.raises(ValueError, match="QSA indexer fields"):
        REGISTRY["qwen4_exp"].config_from_hf(dict(fields, model_type="qwen4_exp_text"))


# ------------------------------------------------------------------------------------------- parts
def brute_ngram_ids(seq: list[int], eos: int, n: int, per: int, mults: list[int], sizes: list[int]) -> list[list[int]]:
    """Each position's ids, from its document's earlier tokens one by one (Python ints, two's-complement int64)."""
    out = []
    for t in range(len(seq)):
        start = max((i + 1 for i in range(t) if seq[i] == eos), default=0)
        back = [seq[t - k] if t - k >= start else eos for k in range(n)]
        row, offset = [], 0
        for order in range(2, n + 1):
            mixed = 0
            for k in range(order):
                mixed ^= (back[k] * mults[k]) & ((1 << 64) - 1)
            mixed = mixed - (1 << 64) if mixed >= 1 << 63 else mixed
            for h in range(per):
                size = sizes[(order - 2) * per + h]
                row.append(sum(sizes[:(order - 2) * per + h]) + mixed % size)
        out.append(row)
    return out


def test_ngram_ids_equal_a_brute_force_reference():
    n, per, eos, layer = 4, 3, 1, 1
    sizes = ngram_hash.table_sizes(1000, (n - 1) * per, layer)
    assert all(all(s % d for d in range(2, int(s**0.5) + 1)) for s in sizes) and sizes == sorted(set(sizes))
    assert sizes[0] > ngram_hash.table_sizes(1000, (n - 1) * per, 0)[-1]  # each PLE layer its own primes
    mults = ngram_hash.multipliers(V, n, layer, 1234)
    seq = torch.tensor([[5, 9, 1, 7, 7, 30, 1, 1, 2, 63, 40]])
    ids = ngram_hash.ngram_ids(torch.cat([torch.full((1, n - 1), eos), seq], 1), torch.tensor(mults),
                               torch.tensor(sizes), torch.tensor([sum(sizes[:i]) for i in range(len(sizes))]), n, per,
                               eos)[:, n - 1:]
    assert ids[0].tolist() == brute_ngram_ids(seq[0].tolist(), eos, n, per, mults, sizes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_qsa_selection_is_hfs_and_the_pattern_is_zero_outside_it(variant):
    hf, model = make_hf(variant), from_hf(make_hf(variant))
    toks = tokens(pos=19)
    layer = hf.config.layer_types.index("indexed_attention")
    seen = {}
    hook = hf.model.layers[layer].self_attn.indexer.register_forward_hook(lambda m, a, out: seen.setdefault("m", out))
    with torch.no_grad():
        hf(toks, use_cache=False)
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("attn.hook_pattern"))
    hook.remove()
    selected = seen["m"][:, 0]  # [batch q k]
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
    assert (pattern.masked_fill(selected[:, None], 0) == 0).all()
    budget, ratio = hf.config.indexer_budget, hf.config.indexer_compress_ratio
    assert (selected.sum(-1) <= budget + ratio - 1).all() and (selected.sum(-1)[:, -1] < toks.shape[1]).all()


def test_the_streams_are_a_plain_sum_of_what_each_step_adds():
    model = model64()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
    total = cache["hook_embed"]
    for l, block in enumerate(model.blocks):
        for w in block.writers():
            total = total + cache[w.out_hook.name]
        close(total, cache[f"blocks.{l}.hook_resid_post"], f"layer {l}")


def test_a_reads_factor_gives_the_read_and_edits_it():
    model = model64()
    read = model.blocks[1].ln1
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith(("blocks.1.hook_attn_in",
                                                                                     "blocks.1.ln1.")))
        stream = cache["blocks.1.hook_attn_in"]
        close(read.normalize_with_scale(stream, cache["blocks.1.ln1.hook_scale"]), cache["blocks.1.ln1.hook_normalized"])
        halved = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.ln1.hook_scale", lambda f, hook: f / 2),
                                                           ("blocks.1.ln1.hook_normalized", lambda x, hook:
                                                            cache.cache_dict.__setitem__("half", x))])
    close(cache["half"], cache["blocks.1.ln1.hook_normalized"] / 2, "an edited factor is what the read uses")
    assert halved.shape[-1] == V


def test_zeroing_a_steps_out_removes_it_and_fold_ln_is_refused():
    model = model64()
    toks = tokens()
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_resid_pre", "hook_resid_mid")))
        zeroed = {}
        model.run_with_hooks(toks, fwd_hooks=[("blocks.1.hook_attn_out", lambda x, hook: torch.zeros_like(x)),
                                              ("blocks.1.hook_resid_mid", lambda x, hook: zeroed.setdefault("mid", x))])
    close(zeroed["mid"], cache["blocks.1.hook_resid_pre"], "resid_mid with attn_out zeroed")
    with pytest.raises(ValueError, match="hyper-connection"):
        model.blocks[0].norm_readers()


def test_knockout_on_the_delta_layer_equals_zeroing_its_kernel_entries():
    check_knockout_equals_kernel_zeroing(model64(), tokens(pos=11), 2, sources=[1, 3, 6], targets=[6, 8, 10],
                                         knockout=knockout)
