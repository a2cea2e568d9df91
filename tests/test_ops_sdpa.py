"""sdpa_attention (hooked/ops/sdpa.py) == the eager attention path (hooked/models/attention.py).

The real eager path: a tiny hooked Llama / Mistral (sliding window) is run with hooks caching
rot_q, rot_k, v and z; sdpa_attention on the cached q, k, v gives the cached z (float32 within
1e-6 of its size, float64 within 1e-12), with left padding, GQA and windows, padded query rows
included (uniform, never NaN). The eager formula (the lines of Attention.forward) covers decoding
shapes (q_pos < k_pos, one query) too. visible_keys == Attention.visible. No [batch n_heads q_pos
k_pos] tensor is built on the way at 1,024 tokens (largest tensor seen by a dispatch mode).
GPU (skipped without CUDA): the same on cuda, float32 1e-5 and bfloat16 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from einops import einsum
from torch.utils._python_dispatch import TorchDispatchMode

from hooked.models.attention import Attention
from hooked.models.base import Context
from hooked.models.decode_state import DecodeState
from hooked.ops.sdpa import sdpa_attention, visible_keys

VOCAB = 64


def eager_z(q, k, v, scale, visible):
    """Attention.forward's z: scores in the activations' dtype, finfo.min mask, float32 softmax."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = einsum(q, k, "b q h d, b k h d -> b h q k") * scale
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    pattern = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return einsum(pattern, v, "b h q k, b k h d -> b q h d")


def tiny(arch: str, dtype: torch.dtype, n_kv_heads: int = 2):
    import transformers

    from conftest import build_tiny_hf
    from loaders import from_hf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=n_kv_heads, max_position_embeddings=64)
    cfg = (transformers.LlamaConfig(**common) if arch == "llama"
           else transformers.MistralConfig(**common, sliding_window=3))
    return from_hf(build_tiny_hf(cfg, perturb=0.05, dtype=dtype))


def rel_close(got, want, rel):
    torch.testing.assert_close(got, want, atol=rel * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_equals_the_models_eager_path(arch, n_kv_heads, padded, dtype, rel):
    model = tiny(arch, dtype, n_kv_heads)
    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, :4] = 0  # left padding
        mask[2, :10] = 0  # one real token: every earlier query sees no key
    names = [f"blocks.{l}.attn.{h}" for l in range(2) for h in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_z")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    key_mask = mask.bool() if padded else None
    for layer in range(2):
        attn = model.blocks[layer].attn
        c = lambda h: cache[f"blocks.{layer}.attn.{h}"]  # noqa: E731
        z = sdpa_attention(c("hook_rot_q"), c("hook_rot_k"), c("hook_v"), attn.scale, window=attn.window,
                           key_mask=key_mask)
        assert not z.isnan().any()
        rel_close(z, c("hook_z"), rel)


@pytest.mark.parametrize("q_len, k_len", [(5, 5), (3, 8), (1, 8), (1, 1)])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_equals_the_eager_formula_while_decoding(q_len, k_len, window, padded):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, q_len, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, k_len, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    key_mask = None
    if padded:
        key_mask = torch.ones(2, k_len, dtype=torch.bool)
        key_mask[1, : k_len // 2] = False
    visible = visible_keys(q_len, k_len, q.device, window=window, key_mask=key_mask)
    want = eager_z(q, k, v, 0.3, visible)
    got = sdpa_attention(q, k, v, 0.3, window=window, key_mask=key_mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("q_len, k_len", [(4, 4), (2, 6), (1, 6)])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_visible_keys_is_attention_visible(q_len, k_len, window, padded):
    key_mask = None
    if padded:
        key_mask = torch.ones(3, k_len, dtype=torch.bool)
        key_mask[0, :2] = False
    state = DecodeState() if q_len < k_len else None  # keys_mask() reads key_mask only while decoding
    ctx = Context(None if state else key_mask, torch.zeros(3, q_len, dtype=torch.long), state=state, key_mask=key_mask)
    want = Attention.visible(ctx, k_len, torch.device("cpu"), q_len=q_len, window=window)
    assert torch.equal(visible_keys(q_len, k_len, torch.device("cpu"), window=window, key_mask=key_mask), want)


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("padded", [False, True])
def test_no_batch_heads_q_k_tensor_at_1024_tokens(padded):
    """The unpadded causal path builds no mask at all; the padded one a [batch 1 q k] mask (heads x smaller)."""
    batch, pos, heads = 1, 1024, 8
    q = torch.randn(batch, pos, heads, 16)
    k, v = torch.randn(batch, pos, 2, 16), torch.randn(batch, pos, 2, 16)
    key_mask = torch.ones(batch, pos, dtype=torch.bool)
    key_mask[:, :5] = False
    with torch.no_grad(), LargestTensor() as probe:
        sdpa_attention(q, k, v, 0.25, key_mask=key_mask if padded else None)
    assert probe.numel < batch * heads * pos * pos
    if not padded:
        assert probe.numel <= batch * pos * heads * 16  # nothing bigger than q itself


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_equals_eager_on_cuda(cuda, padded, dtype, rel):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 300, 8, 64, generator=g).to(cuda, dtype)
    k, v = (torch.randn(2, 300, 2, 64, generator=g).to(cuda, dtype) for _ in range(2))
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 300, dtype=torch.bool, device=cuda)
        key_mask[1, :100] = False
    for window in (None, 32):
        want = eager_z(q, k, v, 0.125, visible_keys(300, 300, cuda, window=window, key_mask=key_mask))
        got = sdpa_attention(q, k, v, 0.125, window=window, key_mask=key_mask)
        assert not got.isnan().any()
        rel_close(got.float(), want.float(), rel)
