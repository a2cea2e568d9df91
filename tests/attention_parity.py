"""Shared scaffolding for the GPT-2 and Llama parity tables (imported by those test files)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def make_batch(lengths: list[int], side: str, vocab: int, seed: int = 1,
               device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
    """Random tokens [batch max(lengths)] and a 0/1 mask, padded on `side` with token 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        tokens[b, cols] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, cols] = 1
    return tokens.to(device), mask.to(device)


def run_hf(hf: nn.Module, blocks: nn.ModuleList, tokens: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Logits and [embedding, block outputs..., final norm output] from HF, with our position ids."""
    outs: list[Tensor] = []
    handles = [block.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
               for block in blocks]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    try:
        with torch.no_grad():
            out = hf(tokens, attention_mask=mask, position_ids=position_ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out.logits, [out.hidden_states[0], *outs, out.hidden_states[-1]]


def run_ours(model: nn.Module, tokens: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    n = model.cfg.n_layers
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.hook_resid_post" for l in range(n)] + ["ln_final.hook_normalized"]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    return logits, [cache[name] for name in names]


def compare(hf: nn.Module, blocks: nn.ModuleList, model: nn.Module, tokens: Tensor, mask: Tensor, rel: float,
            rel_close: Callable[..., None]) -> None:
    """Logits, embedding, every resid_post and the final norm at real positions, within `rel`."""
    hf_logits, hf_resids = run_hf(hf, blocks, tokens, mask)
    logits, resids = run_ours(model, tokens, mask)
    real = mask.bool()
    assert logits.dtype == hf_logits.dtype
    rel_close(logits[real], hf_logits[real], rel, "logits")
    labels = ["embed"] + [f"resid_post {l}" for l in range(len(resids) - 2)] + ["ln_final"]
    for label, ours, theirs in zip(labels, resids, hf_resids, strict=True):
        rel_close(ours[real], theirs[real], rel, label)


def build_hf(config, cls, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             perturb: float = 0.1, seed: int = 0) -> nn.Module:
    """A tiny random HF causal LM (eager attention, every parameter perturbed) in `dtype`, its rotary
    buffers kept in float32 as `from_pretrained(dtype=)` keeps them (`.to(dtype)` would round them to
    bf16 and move every angle)."""
    from conftest import build_tiny_hf

    hf = build_tiny_hf(config, cls, seed=seed, perturb=perturb)
    rotary = hf.model.rotary_emb
    fp32 = {n: b.clone() for n, b in rotary.named_buffers()}
    hf = hf.to(device=device, dtype=dtype)
    for n, b in fp32.items():
        setattr(rotary, n, b.to(device))
    return hf


def config_matches(cfg, hc) -> None:
    """The sizes every attention family shares, read from the HF config `hc`."""
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == (
        hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads, head_dim,
        hc.intermediate_size, hc.vocab_size)
    assert cfg.tied == hc.tie_word_embeddings


def key_map_matches(arch, cfg, model: nn.Module, hf: nn.Module) -> None:
    """The key map names exactly our parameters, and each one's checkpoint name is in HF's state dict."""
    keys = arch.key_map(cfg)
    assert set(keys) == {n for n, _ in model.named_parameters()}
    hf_names = set(hf.state_dict())
    assert all(any(k in hf_names for k in key.names) for key in keys.values())
