"""Zamba2 hook contract, per-invocation hooks over shared weights, and interventions.

Contract (DESIGN.md section 3): every documented hook exists, fires once per forward in the
documented order with the documented shape; identity hooks leave logits bit-identical.
Sharing: the invocations of one shared block hold the same weight storage and their own adapters
and hooks; an edit at one invocation's hook_pattern acts there only. References are computed here
from cached activations and the parameters (einsum / torch primitives), not from hooked.models.
"""

from __future__ import annotations

import pytest
import torch

from hooked import backends
from hooked.models.zamba2 import Zamba2Config
from hooked.models.families import build

M, H = "mamba", "hybrid"
BATCH, POS = 2, 11
TOL = dict(rtol=0, atol=1e-10)
BASE = dict(d_model=16, d_vocab=37, n_heads=4, d_state=8, n_groups=2, chunk_size=8, n_attn_heads=4, d_mlp=24,
            adapter_rank=3)
CONFIGS = {  # invocations: layer 1 -> block 0, layer 3 -> block 1, layer 4 -> block 0
    "mem2_adapters_rope": Zamba2Config(n_layers=6, layer_types=(M, H, M, H, H, M), num_mem_blocks=2,
                                       use_shared_attention_adapter=True, use_mem_rope=True, proj_bias=True, **BASE),
    "mem1_gqa": Zamba2Config(n_layers=4, layer_types=(H, M, H, M), n_attn_kv_heads=2, **BASE),
}
CFG = CONFIGS["mem2_adapters_rope"]

MIXER = {
    "hook_in": lambda c, b, l: (b, l, c.conv_dim), "hook_gate": lambda c, b, l: (b, l, c.d_inner),
    "hook_conv": lambda c, b, l: (b, l, c.conv_dim), "hook_ssm_in": lambda c, b, l: (b, l, c.n_heads, c.d_head),
    "hook_dt": lambda c, b, l: (b, l, c.n_heads), "hook_B": lambda c, b, l: (b, l, c.n_groups, c.d_state),
    "hook_C": lambda c, b, l: (b, l, c.n_groups, c.d_state), "hook_A_bar": lambda c, b, l: (b, l, c.n_heads),
    "hook_B_bar": lambda c, b, l: (b, l, c.n_heads, c.d_state),
    "hook_h": lambda c, b, l: (b, l, c.n_heads, c.d_head, c.d_state),
    "hook_kernel": lambda c, b, l: (b, c.n_heads, l, l), "hook_y": lambda c, b, l: (b, l, c.n_heads, c.d_head),
    "hook_ssm_out": lambda c, b, l: (b, l, c.n_heads, c.d_head), "hook_gated": lambda c, b, l: (b, l, c.d_inner),
    "hook_head_out": lambda c, b, l: (b, l, c.n_heads, c.d_model),
}
RESID = lambda c, b, l: (b, l, c.d_model)  # noqa: E731
Q = lambda c, b, l: (b, l, c.n_attn_heads, c.d_attn_head)  # noqa: E731
KV = lambda c, b, l: (b, l, c.n_attn_kv_heads, c.d_attn_head)  # noqa: E731
PATTERN = lambda c, b, l: (b, c.n_attn_heads, l, l)  # noqa: E731
MLP = lambda c, b, l: (b, l, c.d_mlp)  # noqa: E731


def shared_hooks(cfg: Zamba2Config) -> dict:
    """blocks.{l}.shared.* in forward order, then hook_shared_out."""
    rot = {"attn.hook_rot_q": Q, "attn.hook_rot_k": KV} if cfg.use_mem_rope else {}
    wide = lambda c, b, l: (b, l, 2 * c.d_model)  # noqa: E731
    scale = lambda c, b, l: (b, l, 1)  # noqa: E731
    hooks = {"hook_in": wide, "ln1.hook_scale": scale, "ln1.hook_normalized": wide,
             "attn.hook_q": Q, "attn.hook_k": KV, "attn.hook_v": KV, **rot, "attn.hook_attn_scores": PATTERN,
             "attn.hook_pattern": PATTERN, "attn.hook_z": Q,
             "attn.hook_result": lambda c, b, l: (b, l, c.n_attn_heads, c.d_model), "hook_attn_out": RESID,
             "ln2.hook_scale": scale, "ln2.hook_normalized": RESID, "mlp.hook_pre": MLP, "mlp.hook_pre_linear": MLP, "mlp.hook_post": MLP,
             "hook_mlp_out": RESID, "hook_out": RESID}
    return {f"shared.{k}": v for k, v in hooks.items()} | {"hook_shared_out": RESID}


def expected_hooks(cfg: Zamba2Config) -> dict:
    """Every hook name -> shape function, in forward order."""
    names = {"hook_embed": RESID}
    for layer, kind in enumerate(cfg.layer_types):
        block = {"hook_resid_pre": RESID, **(shared_hooks(cfg) if kind == H else {}), "hook_mixer_in": RESID,
                 "ln1.hook_scale": lambda c, b, l: (b, l, 1), "ln1.hook_normalized": RESID}
        block |= {f"mixer.{k}": v for k, v in MIXER.items()} | {"hook_mixer_out": RESID, "hook_resid_post": RESID}
        names |= {f"blocks.{layer}.{k}": v for k, v in block.items()}
    return names | {"ln_final.hook_scale": lambda c, b, l: (b, l, 1), "ln_final.hook_normalized": RESID,
                    "unembed.hook_in": RESID, "unembed.hook_out": lambda c, b, l: (b, l, c.d_vocab)}


def make_model(cfg: Zamba2Config = CFG, dtype: torch.dtype = torch.float64, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    model = build(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def tokens_for(cfg: Zamba2Config = CFG, batch: int = BATCH, pos: int = POS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_hook_exists_fires_once_in_order_with_its_shape(name):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    fired: list[tuple[str, tuple]] = []
    with torch.no_grad():
        model.run_with_hooks(tokens_for(cfg), fwd_hooks=[(lambda n: True, lambda x, hook: fired.append(
            (hook.name, tuple(x.shape))))])
    expected = expected_hooks(cfg)
    assert list(model.hook_dict) == list(expected)
    assert [n for n, _ in fired] == list(expected)  # each once, in forward order
    for hook_name, shape in fired:
        assert shape == expected[hook_name](cfg, BATCH, POS), hook_name


@pytest.mark.parametrize("identity", ["none", "same", "clone"])
def test_identity_hooks_keep_logits_bit_identical(identity):
    model = make_model(dtype=torch.float32)
    tokens = tokens_for()
    fn = {"none": lambda x, hook: None, "same": lambda x, hook: x, "clone": lambda x, hook: x.clone()}[identity]
    with torch.no_grad():
        with backends.use(attention="eager"):  # the hooks below put every layer on the exact path
            plain = model(tokens)
        hooked = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, fn)])
        cached, cache = model.run_with_cache(tokens, incl_lazy=True)
    assert torch.equal(plain, hooked) and torch.equal(plain, cached)
    assert len(cache) == len(model.hook_dict)


# ----------------------------------------------------------------------------------------- sharing
SHARED_WEIGHTS = ["attn.q_proj.base.weight", "attn.k_proj.base.weight", "attn.v_proj.base.weight",
                  "attn.o_proj.weight", "ln1.weight", "ln2.weight", "mlp.gate_up_proj.base.weight",
                  "mlp.gate_up_proj.base.bias", "mlp.down_proj.weight", "mlp.down_proj.bias"]
ADAPTERS = ["attn.q_proj.down.weight", "attn.k_proj.up.weight", "attn.v_proj.down.weight",
            "mlp.gate_up_proj.down.weight", "mlp.gate_up_proj.up.weight"]


def _ptr(model: LanguageModel, layer: int, name: str) -> int:
    return model.blocks[layer].shared.get_parameter(name).data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_invocations_share_weights_not_adapters(dtype):
    model = make_model(dtype=dtype)  # .to(dtype) must keep the sharing
    for name in SHARED_WEIGHTS:
        assert _ptr(model, 1, name) == _ptr(model, 4, name), name  # block 0 at layers 1 and 4
        assert _ptr(model, 1, name) != _ptr(model, 3, name), name  # block 1 at layer 3
    for name in ADAPTERS:
        assert len({_ptr(model, l, name) for l in (1, 3, 4)}) == 3, name
    params = dict(model.named_parameters())
    for name in SHARED_WEIGHTS:  # listed once, under the block's first invocation
        assert f"blocks.1.shared.{name}" in params and f"blocks.3.shared.{name}" in params
        assert f"blocks.4.shared.{name}" not in params
    assert all(f"blocks.4.shared.{name}" in params for name in ADAPTERS)
    assert model.blocks[1].shared.ln1.hook_normalized is not model.blocks[4].shared.ln1.hook_normalized


def test_invocation_reads_hidden_and_embedding_and_feeds_the_mixer_input():
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(), incl_lazy=True)
    for layer in CFG.hybrid_layer_ids:
        pre = f"blocks.{layer}."
        assert cache["pattern", layer] is cache[pre + "shared.attn.hook_pattern"]  # the cache's shorthand
        hook_in = cache[pre + "shared.hook_in"]
        torch.testing.assert_close(hook_in, torch.cat([cache[pre + "hook_resid_pre"], cache["hook_embed"]], -1), **TOL)
        out = cache[pre + "shared.hook_out"]
        torch.testing.assert_close(out, cache[pre + "shared.hook_mlp_out"], **TOL)  # no residual inside
        shared_out = out @ model.blocks[layer].linear.weight.T
        torch.testing.assert_close(cache[pre + "hook_shared_out"], shared_out, **TOL)
        x = cache[pre + "hook_resid_pre"] + shared_out  # the mixer's input; the residual skips shared_out
        normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CFG.eps) * model.blocks[layer].ln1.weight
        scale = normed.abs().max().item()
        torch.testing.assert_close(cache[pre + "ln1.hook_normalized"], normed, rtol=0, atol=1e-6 * scale)
        # (RMSNorm computes its statistic in float32, as HF does, also in a float64 model)
        resid_post = cache[pre + "hook_resid_pre"] + cache[pre + "hook_mixer_out"]
        torch.testing.assert_close(cache[pre + "hook_resid_post"], resid_post, **TOL)
        results = cache[pre + "shared.attn.hook_result"].sum(2)  # o_proj has no bias
        torch.testing.assert_close(results, cache[pre + "shared.hook_attn_out"], **TOL)


# ------------------------------------------------------------------------------- interventions
def _uniform_causal(pattern: torch.Tensor) -> torch.Tensor:
    pos = pattern.shape[-1]
    tril = torch.ones(pos, pos, dtype=pattern.dtype).tril()
    return (tril / tril.sum(-1, keepdim=True)).expand_as(pattern).clone()


def test_pattern_edit_at_one_invocation_acts_there_only():
    model, tokens = make_model(), tokens_for()
    edited_name = "blocks.4.shared.attn.hook_pattern"  # block 0, also invoked at layer 1
    _, clean = model.run_with_cache(tokens, incl_lazy=True)
    with model.hooks([(edited_name, lambda p, hook: _uniform_causal(p))]):
        _, edited = model.run_with_cache(tokens, incl_lazy=True)
    order = list(model.hook_dict)
    at = order.index(edited_name)
    for name in order[:at]:  # everything before, block 0's first invocation included, is untouched
        assert torch.equal(edited[name], clean[name]), name
    pattern = edited[edited_name]
    assert torch.equal(pattern, _uniform_causal(clean[edited_name]))
    v = edited["blocks.4.shared.attn.hook_v"].repeat_interleave(CFG.n_attn_heads // CFG.n_attn_kv_heads, dim=2)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
    torch.testing.assert_close(edited["blocks.4.shared.attn.hook_z"], z, **TOL)
    for name in ["shared.attn.hook_z", "shared.attn.hook_result", "shared.hook_attn_out", "shared.hook_out",
                 "hook_shared_out", "mixer.hook_in", "hook_mixer_out", "hook_resid_post"]:
        assert not torch.allclose(edited[f"blocks.4.{name}"], clean[f"blocks.4.{name}"]), name


def test_pattern_edit_at_first_invocation_is_not_reused_later():
    """Editing layer 1's pattern: layer 4 (same shared block) computes its own softmax again."""
    model, tokens = make_model(), tokens_for()
    with model.hooks([("blocks.1.shared.attn.hook_pattern", lambda p, hook: _uniform_causal(p))]):
        _, cache = model.run_with_cache(tokens)
    first = cache["blocks.1.shared.attn.hook_pattern"]
    assert torch.equal(first, _uniform_causal(first))
    scores = cache["blocks.4.shared.attn.hook_attn_scores"]
    torch.testing.assert_close(cache["blocks.4.shared.attn.hook_pattern"], scores.softmax(-1), **TOL)
    assert not torch.allclose(cache["blocks.4.shared.attn.hook_pattern"], _uniform_causal(scores))


def test_head_ablation_at_one_invocation():
    """Zeroing head h's result at layer 4 == zeroing its z there; layer 1 (same weights) is untouched."""
    model, tokens, head = make_model(), tokens_for(), 2

    def zero_head(x, hook):
        x = x.clone()
        x[:, :, head] = 0
        return x

    with torch.no_grad():
        by_result = model.run_with_hooks(tokens, fwd_hooks=[("blocks.4.shared.attn.hook_result", zero_head)])
        by_z = model.run_with_hooks(tokens, fwd_hooks=[("blocks.4.shared.attn.hook_z", zero_head)])
        clean = model(tokens)
    torch.testing.assert_close(by_result, by_z, **TOL)
    assert not torch.allclose(by_z, clean)
    ablation = pytest.importorskip("analysis.interventions.ablation")
    z_name = "blocks.4.shared.attn.hook_z"
    with ablation.ablate_heads(model, [("blocks.4.shared.attn", head)]):
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.1.") or n == z_name)
            logits = model(tokens)
    torch.testing.assert_close(logits, by_z, **TOL)
    _, clean_cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.1."))
    for name in clean_cache.keys():  # layer 1 runs the same shared block: unaffected
        torch.testing.assert_close(cache[name], clean_cache[name], **TOL)
    assert torch.equal(cache[z_name][:, :, head], torch.zeros_like(cache[z_name][:, :, head]))


def test_embed_edit_reaches_every_shared_block():
    model, tokens = make_model(), tokens_for()
    with model.hooks([("hook_embed", lambda x, hook: x * 0 + 1)]):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("shared.hook_in"))
    for layer in CFG.hybrid_layer_ids:
        embedding = cache[f"blocks.{layer}.shared.hook_in"][..., CFG.d_model:]
        assert torch.equal(embedding, torch.ones_like(embedding))


def test_in_place_edit_of_the_residual_leaves_the_embedding_alone():
    model, tokens = make_model(), tokens_for()

    def zero_in_place(x, hook):
        x.zero_()

    with model.hooks([("blocks.0.hook_resid_pre", zero_in_place)]):
        _, cache = model.run_with_cache(tokens, names_filter=["hook_embed", "blocks.1.shared.hook_in"])
    torch.testing.assert_close(cache["blocks.1.shared.hook_in"][..., CFG.d_model:], model.embed(tokens), **TOL)


def test_mixer_kernel_reconstructs_y_in_a_hybrid_layer():
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(), names_filter=lambda n: n.startswith("blocks.3.mixer.hook_"))
    kernel, u = cache["blocks.3.mixer.hook_kernel"], cache["blocks.3.mixer.hook_ssm_in"]
    torch.testing.assert_close(torch.einsum("bhji,bihp->bjhp", kernel, u), cache["blocks.3.mixer.hook_y"], **TOL)


# ----------------------------------------------------------------------------- start / stop, errors
@pytest.mark.parametrize("start", [1, 2, 5])
def test_start_at_layer_resumes_with_tokens(start):
    model, tokens = make_model(), tokens_for()
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(tokens, attention_mask=mask)
        resid = model(tokens, attention_mask=mask, stop_at_layer=start)
        resumed = model(resid, attention_mask=mask, start_at_layer=start, tokens=tokens)
    torch.testing.assert_close(resumed, full, **TOL)


def test_start_at_layer_without_tokens():
    model, tokens = make_model(), tokens_for()
    with torch.no_grad():
        resid = model(tokens, stop_at_layer=2)
        with pytest.raises(ValueError, match=r"blocks\.3 is a hybrid layer.*tokens="):
            model(resid, start_at_layer=2)
        with pytest.raises(ValueError, match="tokens have shape"):
            model(resid, start_at_layer=2, tokens=tokens[:, :-1])
        last = model(tokens, stop_at_layer=5)
        torch.testing.assert_close(model(last, start_at_layer=5), model(tokens), **TOL)  # no hybrid layer after 5


def test_config_checks():
    with pytest.raises(ValueError, match="layer_types"):
        Zamba2Config(n_layers=2, layer_types=(M, "attention"), **BASE)
    with pytest.raises(ValueError, match="layer_types"):
        Zamba2Config(n_layers=3, layer_types=(M, H), **BASE)
    with pytest.raises(ValueError, match="adapters"):
        Zamba2Config(n_layers=2, layer_types=(M, H), n_attn_kv_heads=2, use_shared_attention_adapter=True, **BASE)
    cfg = Zamba2Config(n_layers=3, layer_types=[H, M, H], **BASE)
    assert cfg.layer_types == (H, M, H) and cfg.hybrid_layer_ids == (0, 2) and cfg.d_attn_head == 8
    assert (cfg.d_inner, cfg.d_head) == (32, 8)
