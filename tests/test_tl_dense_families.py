"""GPT-NeoX (Pythia) and Gemma (1) against TransformerLens 3.9's HookedTransformer on the same weights.

TL's own weight conversions (`convert_neox_weights`, `convert_gemma_weights`) load a tiny random HF model
into a HookedTransformer built from the config TL's `convert_hf_model_config` writes for these
architectures (no hub access). Compared: every weight under TL's names, unprocessed and after TL's
`from_pretrained` processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases),
logits and loss, and every hook both caches hold (1e-4 of the tensor's max magnitude; attention scores
at visible keys only: TL masks with -inf, we with finfo.min).

Where the two differ by convention, not by number: our `W_E` is the stored embedding, TL's Gemma W_E is
it times sqrt(d_model) (TL folds the embedding scale into W_E; we apply it in the forward, as HF does);
TL's Gemma config says act_fn "gelu" (the exact erf GELU) where HF runs the tanh form, so the oracle is
built with "gelu_pytorch_tanh", HF's function. Before fold_ln, `ln*.hook_normalized` is after the
weight here and before it in TL (README, "Hook names"), so those hooks are compared on processed
weights only.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import build_tiny_hf

from loaders.load import from_hf
from tests.tl_oracle import toy_tokenizer

tl = pytest.importorskip("transformer_lens")

VOCAB = 48
PROCESSING = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
NO_PROCESSING = {k: False for k in PROCESSING}
NAMES = ["W_U", "b_U", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out", "b_in", "b_out"]
EXTRA = {"gpt_neox": [], "gemma": ["W_gate"]}


def hf_model(name: str):
    if name == "gpt_neox":
        config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                            intermediate_size=48, max_position_embeddings=64, rotary_pct=0.25)
    else:
        config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                          max_position_embeddings=64, pad_token_id=3)
    return build_tiny_hf(config, perturb=0.1, seed=1)


def tl_config(name: str, hf) -> dict:
    """What TL 3.9's convert_hf_model_config writes for the architecture (loading_from_pretrained.py)."""
    c = hf.config
    if name == "gpt_neox":
        d_head = c.hidden_size // c.num_attention_heads
        return dict(d_model=c.hidden_size, d_head=d_head, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
                    n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.layer_norm_eps,
                    d_vocab=c.vocab_size, act_fn=c.hidden_act, use_attn_scale=True, use_local_attn=False,
                    scale_attn_by_inverse_layer_idx=False, parallel_attn_mlp=c.use_parallel_residual,
                    positional_embedding_type="rotary", rotary_adjacent_pairs=False, normalization_type="LN",
                    rotary_dim=round(c.rope_parameters["partial_rotary_factor"] * d_head),
                    original_architecture="GPTNeoXForCausalLM")
    return dict(d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
                n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps, d_vocab=c.vocab_size,
                act_fn="gelu_pytorch_tanh", normalization_type="RMS", rotary_base=c.rope_parameters["rope_theta"],
                rotary_dim=c.head_dim, positional_embedding_type="rotary", use_attn_scale=True,
                n_key_value_heads=c.num_key_value_heads, gated_mlp=True, final_rms=True,
                original_architecture="GemmaForCausalLM")


def tl_model(name: str, hf, tokenizer, **processing):
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights, convert_neox_weights

    cfg = HookedTransformerConfig(**tl_config(name, hf), dtype=torch.float32, device="cpu", default_prepend_bos=False)
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    convert = convert_neox_weights if name == "gpt_neox" else convert_gemma_weights
    model.load_and_process_state_dict(convert(hf, cfg), **(NO_PROCESSING | processing))
    return model.eval()


@pytest.fixture(scope="module", params=["gpt_neox", "gemma"])
def models(request):
    name = request.param
    hf, tokenizer = hf_model(name), toy_tokenizer()
    return name, hf, tokenizer


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def w_e(model) -> torch.Tensor:
    """The embedding as the residual stream receives it (TL's W_E: Gemma's sqrt(d_model) folded in)."""
    return model.W_E * model.embedding_multiplier


TOKENS = torch.randint(4, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("processing", [NO_PROCESSING, PROCESSING], ids=["unprocessed", "processed"])
def test_weights_logits_and_loss_equal_tls(models, processing) -> None:
    name, hf, tok = models
    ours, theirs = from_hf(hf, **processing), tl_model(name, hf, tok, **processing)
    assert rel_err(w_e(ours), theirs.W_E) < 1e-6, "W_E"
    for weight in NAMES + EXTRA[name]:
        a, b = getattr(ours, weight), getattr(theirs, weight)
        assert a.shape == b.shape, weight
        assert rel_err(a, b) < 1e-5, weight
    with torch.no_grad():
        assert rel_err(ours(TOKENS), theirs(TOKENS)) < 1e-5
        assert rel_err(ours(TOKENS, return_type="loss"), theirs(TOKENS, return_type="loss")) < 1e-5


@pytest.mark.parametrize("processing", [NO_PROCESSING, PROCESSING], ids=["unprocessed", "processed"])
def test_every_shared_hook_equals_tls(models, processing) -> None:
    name, hf, tok = models
    ours, theirs = from_hf(hf, **processing), tl_model(name, hf, tok, **processing)
    with torch.no_grad():
        _, mine = ours.run_with_cache(TOKENS)
        _, their = theirs.run_with_cache(TOKENS)
    shared = sorted(set(mine.keys()) & set(their.keys()))
    if processing is NO_PROCESSING:  # before fold_ln TL's hook_normalized is before the weight (module docstring)
        shared = [n for n in shared if not n.endswith("hook_normalized")]
    n_layers = hf.config.num_hidden_layers
    expected = {"hook_embed", "ln_final.hook_scale"} | {f"blocks.{l}.{h}" for l in range(n_layers) for h in (
        "hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "ln1.hook_scale", "ln2.hook_scale",
        "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores",
        "attn.hook_pattern", "attn.hook_z", "mlp.hook_pre", "mlp.hook_post")}
    if name == "gemma":
        expected |= {f"blocks.{l}.{h}" for l in range(n_layers) for h in ("hook_resid_mid", "mlp.hook_pre_linear")}
    assert expected <= set(shared), sorted(expected - set(shared))
    visible = torch.ones(TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool).tril()
    for hook in shared:
        a, b = mine[hook], their[hook]
        if hook.endswith("hook_attn_scores"):
            a, b = a[..., visible], b[..., visible]
        assert a.shape == b.shape, hook
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item(), msg=lambda m: f"{hook}: {m}")


def test_a_parallel_mlps_input_is_the_blocks_input_where_tl_adds_the_attention(models) -> None:
    """GPT-NeoX's MLP reads the block's input (through ln2). decompose_resid(l, mlp_input=True) is that
    input's components, normalised by ln2's cached scale: they sum to ln2's output. TL's also holds the
    layer's attn_out (its serial-block rule), which the MLP never reads: exactness wins (DESIGN.md, 2)."""
    name, hf, tok = models
    if name != "gpt_neox":
        pytest.skip("the parallel block is GPT-NeoX's")
    ours, theirs = from_hf(hf, **PROCESSING), tl_model(name, hf, tok, **PROCESSING)
    with torch.no_grad():
        _, mine = ours.run_with_cache(TOKENS)
        _, their = theirs.run_with_cache(TOKENS)
    l = 1
    a, labels = mine.decompose_resid(l, mlp_input=True, apply_ln=True, return_labels=True)
    b, their_labels = their.decompose_resid(l, mlp_input=True, apply_ln=True, return_labels=True)
    assert their_labels == labels + [f"{l}_attn_out"]
    torch.testing.assert_close(a, b[:-1], rtol=0, atol=1e-4 * b.abs().max().item())
    torch.testing.assert_close(a.sum(0), mine[f"blocks.{l}.ln2.hook_normalized"], rtol=0, atol=1e-5)
    assert not torch.allclose(b.sum(0), mine[f"blocks.{l}.ln2.hook_normalized"], atol=1e-3)
