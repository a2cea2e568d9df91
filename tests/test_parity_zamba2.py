"""HookedZamba2 against Hugging Face's Zamba2ForCausalLM (eager attention, torch SSM path).

Tiny random HF models, every parameter perturbed (HF's init leaves norms at 1 and the adapters
small, which hides misplaced weights), compared on logits and every layer's residual within 1e-4
of the reference tensor's max magnitude. HF's `hidden_states` for Zamba2 are [embedding, output of
layers 0 .. n-2, final norm of layer n-1's output]. Left padding: HF's eager Zamba2 gives each
padded row the same numbers as the prompt alone (checked below), so padded rows are compared at
their real positions (padding positions hold nothing meaningful in either model).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from safetensors import safe_open

from loaders.load import CheckpointError, from_hf, from_pretrained
from loaders.zamba2 import config_from_hf, key_map

RTOL = 1e-4
M, H = "mamba", "hybrid"

# name: (HF Zamba2Config overrides, batch, sequence length); chunk_size 8 everywhere
CASES = {
    "1_hybrid": (dict(layers_block_type=[M, H, M]), 2, 13),
    "1_hybrid_first_layer": (dict(layers_block_type=[H, M]), 2, 11),
    "2_hybrid_mem1": (dict(layers_block_type=[M, H, M, H]), 2, 13),
    "2_hybrid_mem2": (dict(layers_block_type=[M, H, M, H], num_mem_blocks=2), 2, 13),
    "3_hybrid_mem1_adapters": (dict(layers_block_type=[M, H, H, M, H], use_shared_attention_adapter=True), 2, 13),
    "3_hybrid_mem2_adapters": (dict(layers_block_type=[M, H, H, M, H], num_mem_blocks=2,
                                    use_shared_attention_adapter=True), 2, 13),
    "3_hybrid_mem2_adapters_rope": (dict(layers_block_type=[H, M, H, M, H], num_mem_blocks=2,
                                         use_shared_attention_adapter=True, use_mem_rope=True), 3, 21),
    "3_hybrid_mem3_rope": (dict(layers_block_type=[H, H, H, M], num_mem_blocks=3, use_mem_rope=True), 2, 13),
    "gqa": (dict(layers_block_type=[M, H, M, H], num_key_value_heads=2), 2, 13),
    "gqa_rope_mem2": (dict(layers_block_type=[M, H, M, H], num_key_value_heads=1, use_mem_rope=True,
                           num_mem_blocks=2), 2, 13),
    "rope_linear_scaling": (dict(layers_block_type=[M, H, H], use_mem_rope=True,
                                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}), 2, 13),
    "bias_silu": (dict(layers_block_type=[M, H, H], add_bias_linear=True, hidden_act="silu",
                       use_shared_attention_adapter=True), 2, 13),
    "untied_embeddings": (dict(layers_block_type=[M, H, H], num_mem_blocks=2, tie_word_embeddings=False), 2, 13),
    "groups_1_heads_8": (dict(layers_block_type=[M, H, M], mamba_ngroups=1, n_mamba_heads=8), 2, 13),
    "len_1": (dict(layers_block_type=[M, H, H], use_mem_rope=True), 2, 1),
    "len_under_chunk": (dict(layers_block_type=[M, H, H], use_mem_rope=True), 2, 5),
    "len_chunk_multiple": (dict(layers_block_type=[M, H, H], use_mem_rope=True), 2, 16),
    "len_ragged_long": (dict(layers_block_type=[M, H, H], use_mem_rope=True, num_mem_blocks=2,
                             use_shared_attention_adapter=True), 1, 29),
}


def make_hf(seed: int = 0, **overrides) -> transformers.Zamba2ForCausalLM:
    kw = dict(hidden_size=16, num_hidden_layers=len(overrides.get("layers_block_type", [M, H, M])), mamba_d_state=8,
              n_mamba_heads=4, mamba_ngroups=2, mamba_expand=2, num_attention_heads=4, intermediate_size=24,
              vocab_size=61, chunk_size=8, adapter_rank=3, max_position_embeddings=64)
    kw.update(overrides)
    config = transformers.Zamba2Config(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Zamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = RTOL) -> None:
    torch.testing.assert_close(ours, ref, rtol=0, atol=rel * ref.abs().max().item(), msg=lambda m: f"{what}: {m}")


def check_against_hf(hf, model, tokens, attention_mask=None, rel: float = RTOL) -> None:
    """Logits and every residual; with a mask, at the real positions of each row only."""
    with torch.no_grad():
        out = hf(tokens, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(tokens, attention_mask=attention_mask, names_filter=lambda n: (
            n == "hook_embed" or "resid_post" in n or n.startswith("ln_final")))
    n = model.cfg.n_layers
    ours = [cache["hook_embed"]] + [cache[f"blocks.{l}.hook_resid_post"] for l in range(n - 1)]
    ours += [cache["ln_final.hook_normalized"], logits]
    refs = list(out.hidden_states) + [out.logits]
    assert len(refs) == len(ours) == n + 2
    names = ["embed"] + [f"resid_post {l}" for l in range(n - 1)] + ["ln_final", "logits"]
    real = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    for what, a, b in zip(names, ours, refs):
        assert_rel_close(a.float()[real], b.float()[real], what, rel)


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name):
    overrides, batch, seq_len = CASES[name]
    hf = make_hf(**overrides)
    model = from_hf(hf)
    assert model.cfg.chunk_size == hf.config.chunk_size == 8
    assert model.cfg.hybrid_layer_ids == tuple(hf.config.hybrid_layer_ids)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    check_against_hf(hf, model, tokens)


def left_padded(lengths: list[int], width: int, vocab: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        tokens[b, : width - n] = 0
    return tokens, mask


PADDED = {
    "mem2_adapters_rope": dict(layers_block_type=[M, H, M, H, H], num_mem_blocks=2, use_shared_attention_adapter=True,
                               use_mem_rope=True),
    "gqa_mem1": dict(layers_block_type=[H, M, H], num_key_value_heads=2),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_parity_left_padding(name):
    hf = make_hf(**PADDED[name])
    model = from_hf(hf)
    lengths, width = [19, 11, 8, 1], 19
    tokens, mask = left_padded(lengths, width, hf.config.vocab_size)
    check_against_hf(hf, model, tokens, mask)
    with torch.no_grad():  # the reference itself: HF's padded rows equal each prompt alone
        padded = hf(tokens, attention_mask=mask, use_cache=False).logits
        ours = model(tokens, attention_mask=mask)
        for b, n in enumerate(lengths):
            alone = hf(tokens[b:b + 1, width - n:], use_cache=False).logits
            assert_rel_close(padded[b:b + 1, width - n:], alone, f"HF row {b}")
            assert_rel_close(ours[b:b + 1, width - n:], alone, f"our row {b}")


def test_weights_equal_hf_and_shared_blocks_share_storage():
    hf = make_hf(layers_block_type=[M, H, H, M, H, H], num_mem_blocks=2, use_shared_attention_adapter=True)
    model = from_hf(hf)
    cfg = model.cfg
    params = dict(model.named_parameters())
    hf_state = hf.state_dict()
    keys = key_map(cfg)
    assert set(keys) == set(params)
    for name, key in keys.items():
        ref = hf_state[key.names[0]]
        ref = key.transform(ref) if key.transform is not None else ref
        assert torch.equal(params[name], ref), name
    # every invocation's modules point at its block's weights, whatever the names
    for l in cfg.hybrid_layer_ids:
        shared = model.blocks[l].shared
        theirs = f"model.layers.{l}.shared_transformer."
        i = cfg.hybrid_layer_ids.index(l)
        pairs = {"attn.q_proj.base.weight": "self_attn.q_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
                 "ln1.weight": "input_layernorm.weight", "ln2.weight": "pre_ff_layernorm.weight",
                 "mlp.gate_up_proj.base.weight": "feed_forward.gate_up_proj.weight",
                 "attn.v_proj.up.weight": f"self_attn.linear_v_adapter_list.{i}.1.weight",
                 "mlp.gate_up_proj.down.weight": f"feed_forward.gate_up_proj_adapter_list.{i}.0.weight"}
        own = dict(shared.named_parameters())
        for ours, hf_name in pairs.items():
            assert torch.equal(own[ours], hf_state[theirs + hf_name]), (l, ours)


def test_save_pretrained_layout_and_reload(tmp_path):
    """HF writes each shared block once, under its first hybrid layer; adapters by invocation index."""
    hf = make_hf(layers_block_type=[M, H, H, M, H], num_mem_blocks=2, use_shared_attention_adapter=True,
                 use_mem_rope=True)
    hf.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    shared_layers = {int(k.split(".")[2]) for k in saved if ".shared_transformer." in k}
    assert shared_layers == {1, 2}  # blocks 0 and 1 owned by hybrid layers 1 and 2; layer 4 reuses block 0
    assert "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.0.weight" in saved
    assert "lm_head.weight" not in saved
    cfg = config_from_hf(hf.config.to_dict())
    assert {n for k in key_map(cfg).values() for n in k.names[:1]} == saved
    model = from_pretrained(tmp_path)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    check_against_hf(hf, model, tokens)


def test_missing_shared_tensor_is_named(tmp_path):
    hf = make_hf(layers_block_type=[M, H, H], use_shared_attention_adapter=True)
    state = {k: v for k, v in hf.state_dict().items() if "linear_k_adapter_list.1.1" not in k}
    from loaders.load import build_from_source
    from loaders.safetensors_io import MappingSource

    with pytest.raises(CheckpointError, match=r"linear_k_adapter_list\.1\.1\.weight"):
        build_from_source(hf.config.to_dict(), MappingSource(state, origin="test"), dtype=torch.float32, device="cpu")


def test_untied_hf_model_with_a_repeated_block_is_refused():
    """HF (v5) ties the shared blocks only when tie_word_embeddings is True: without it every hybrid
    layer has its own copy, which is not a Zamba2 with shared blocks. from_hf names the extra copies."""
    hf = make_hf(layers_block_type=[M, H, H], tie_word_embeddings=False)
    state = hf.state_dict()
    name = "model.layers.{}.shared_transformer.self_attn.q_proj.weight"
    assert not torch.equal(state[name.format(1)], state[name.format(2)])
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.2\.shared_transformer"):
        from_hf(hf)


def test_config_mapping():
    hf = make_hf(layers_block_type=[M, H, M, H], num_mem_blocks=2, num_key_value_heads=2, use_mem_rope=True,
                 time_step_min=0.01, add_bias_linear=True, rope_parameters={"rope_type": "default", "rope_theta": 77.0})
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_types == ("mamba", "hybrid", "mamba", "hybrid") and cfg.hybrid_layer_ids == (1, 3)
    assert (cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_inner, cfg.d_state, cfg.n_groups) == (16, 4, 8, 32, 8, 2)
    assert (cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.d_attn_head, cfg.d_mlp) == (4, 2, 8, 24)
    assert cfg.dt_limit == (0.01, math.inf) and cfg.proj_bias and cfg.rope_theta == 77.0 and cfg.rope_scaling is None
    assert [cfg.shared_block_of(l) for l in cfg.hybrid_layer_ids] == [0, 1]
    legacy = {**hf.config.to_dict(), "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}
    assert config_from_hf(legacy).layer_types == cfg.layer_types
    with pytest.raises(ValueError, match="layer types"):
        config_from_hf({**hf.config.to_dict(), "layers_block_type": ["mamba", "attention", "mamba", "hybrid"]})


def test_gqa_with_adapters_is_refused_like_hf():
    """HF's k/v adapters write 2 * d_model features: with GQA its forward fails; we refuse the config."""
    hf = make_hf(layers_block_type=[M, H], num_key_value_heads=2, use_shared_attention_adapter=True)
    with pytest.raises(RuntimeError):
        hf(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="adapters"):
        config_from_hf(hf.config.to_dict())


# ------------------------------------------------------------------------------------------- GPU
GPU_CASES = ["3_hybrid_mem2_adapters_rope", "gqa_rope_mem2", "len_ragged_long"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_parity_gpu_float32(name):
    overrides, batch, seq_len = CASES[name]
    hf = make_hf(**overrides).cuda()
    model = from_hf(hf)
    assert next(model.parameters()).is_cuda
    tokens = torch.randint(0, hf.config.vocab_size, (batch, seq_len), device="cuda")
    check_against_hf(hf, model, tokens)
    tokens, mask = left_padded([seq_len, max(seq_len // 2, 1)], seq_len, hf.config.vocab_size)
    check_against_hf(hf, model, tokens.cuda(), mask.cuda())


@pytest.mark.gpu
def test_parity_gpu_bfloat16():
    overrides, batch, seq_len = CASES["3_hybrid_mem2_adapters_rope"]
    hf = make_hf(**overrides).to("cuda", torch.bfloat16)
    model = from_hf(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, seq_len), device="cuda")
    check_against_hf(hf, model, tokens, rel=2e-2)
