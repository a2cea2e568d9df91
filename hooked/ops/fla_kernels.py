"""The gated delta rule and KDA through flash-linear-attention's Triton kernels (the "fused" backend of the
delta-rule mixers), behind delta_rule_chunked's signature.

Glossary (ops/delta_rule.py has the rule and the axis words)
    chunked     fla's chunk_gated_delta_rule / chunk_kda: the WY form, for a prompt (any length)
    recurrent   fla's fused_recurrent_gated_delta_rule / fused_recurrent_kda: one launch per call, for a
                decoding step (one position) that autograd does not record: neither has a backward (the
                gated one raises, KDA's returns no gradient), so a recorded step takes the chunked kernel
    g           fla's decay in log space: log(alpha), [b l h] (Gated DeltaNet) or [b l h d_k] (KDA). The
                hooks give alpha (hook_alpha), so an edit of alpha is what the kernel reads
    GVA         fla's grouped values: value head h reads q/k head h // (n_heads // n_k_heads), our (and HF's)
                repeat_interleave order; q and k go in per q/k head, not repeated

The kernels take q and k as read (normalised by the mixer, hook_q / hook_k), scale=1 (q is already scaled),
beta after its sigmoid (and OLMo's factor 2) and the decay; no gate is computed in the kernel
(use_gate_in_kernel=False), so every hook before the rule keeps firing and its edits propagate. Keywords
only: fused_recurrent_gated_delta_rule's fifth parameter is gk, not beta.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from hooked.ops.delta_rule import CHUNK, delta_rule_chunked
from hooked.ops.fused import Kernels, _pick, needs_grad, record

_OPS = {(False, False): "chunk_gated_delta_rule", (False, True): "fused_recurrent_gated_delta_rule",
        (True, False): "chunk_kda", (True, True): "fused_recurrent_kda"}  # (per-channel decay, one position)


def delta_rule_op(alpha: Tensor, seq_len: int, grad: bool = False) -> str:
    """The Kernels field that computes a rule with this decay (per channel: KDA) over seq_len positions
    (grad: autograd records the call)."""
    return _OPS[(alpha.ndim == 4, seq_len == 1 and not grad)]


def delta_rule_fused(
    q: Float[Tensor, "batch pos n_k_heads d_k"],
    k: Float[Tensor, "batch pos n_k_heads d_k"],
    v: Float[Tensor, "batch pos n_heads d_v"],
    beta: Float[Tensor, "batch pos n_heads"],
    alpha: Float[Tensor, "batch pos n_heads *channel"],
    S0: Float[Tensor, "batch n_heads d_k d_v"] | None = None,
    *,
    chunk_size: int = CHUNK,
    kernels: Kernels | None = None,
    ran: list[str] | None = None,
) -> tuple[Float[Tensor, "batch pos n_heads d_v"], Float[Tensor, "batch n_heads d_k d_v"]]:
    """delta_rule_chunked's (o, S_last) through fla: chunked for a prompt, recurrent for one position (without
    autograd); our
    chunked rule where no kernel takes the call (kernels: None for the installed ones where they run, as
    ops/fused.py; ran: its glossary). o and S_last in v's dtype; the kernels compute in float32."""
    op = delta_rule_op(alpha, v.shape[1], needs_grad(q, k, v, beta, alpha, S0))
    fn = _pick(kernels, op, q, k, v, beta, alpha)
    if fn is None:
        record(ran, delta_rule_chunked)
        return delta_rule_chunked(q, k, v, beta, alpha, S0, chunk_size=chunk_size)
    record(ran, fn)
    g = torch.log(alpha.to(v.dtype))
    o, S = fn(q=q.to(v.dtype), k=k.to(v.dtype), v=v, g=g, beta=beta.to(v.dtype), scale=1.0, initial_state=S0,
              output_final_state=True)
    return o.to(v.dtype), S.to(v.dtype)
