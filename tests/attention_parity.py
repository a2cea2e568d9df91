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
