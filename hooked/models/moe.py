"""Mixture-of-experts MLP: a router picks top_k experts per token, their outputs are mixed by weight.

Glossary
    n_experts   E, routed experts; top_k = k experts per token; d_expert = F, one expert's hidden width
    router      linear d_model -> E without bias; its output is the router logits
    select      the routing rule: (logits) -> (chosen [.. k] expert ids, weights [.. k])
                SoftmaxTopK: Jamba / Mixtral (softmax over all E, keep the top k) and, with
                renormalise=True, Granite 4 (softmax over the top k logits)
                SigmoidTopK: NemotronH (DeepSeek-V3 style: sigmoid scores, a per-expert correction
                bias for the choice only, expert groups, optional renormalisation, a scaling factor)
    experts     stacked weights: gate_proj and up_proj [E F d_model] (gated experts: down(act(gate) * up)),
                up_proj only for plain experts (down(act(up))), down_proj [E d_model F]
    shared      an always-on MLP added to the routed output (Granite 4's shared_mlp, NemotronH's
                shared_experts), or None

    out = sum_k weights[k] * expert_{chosen[k]}(x)  (+ shared(x))

Hooks, under blocks.{l}.mlp. (the MoE is the layer's `mlp`; its output is blocks.{l}.hook_mlp_out):
    hook_router_logits [batch pos n_experts]       router(x), float32 or wider (as HF routes)
    hook_chosen        [batch pos top_k] (int64)   each token's experts, in slot order
    hook_routing_weights [batch pos top_k]         each slot's weight
    hook_expert_out    [batch pos top_k d_model]   the chosen experts' outputs, before weighting
    hook_routed_out    [batch pos d_model]         sum_k weights * expert_out
    shared.*, hook_shared_out [batch pos d_model]  the shared MLP (when there is one)

TransformerLens's weight names (the router W_gate, each expert's W_in, W_gate, W_out): expert_weights.py.

Edits propagate: edited logits are what the rule selects from; an edited `chosen` runs the experts it
names (its slots keep their weights); edited weights and expert outputs are what is summed. Zeroing
the weights of expert e (analysis `ablate_experts`) equals zeroing expert e's down_proj.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.expert_weights import ExpertWeights
from hooked.models.mlp import activation
from hooked.models.protocol import ExpertMixture

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # torch >= 2.8
_CPU_ANY_ADDRESS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)


class SoftmaxTopK(nn.Module):
    """Top-k by logit; weights softmax(logits)[chosen], or (renormalise) softmax(logits[chosen])."""

    def __init__(self, top_k: int, renormalise: bool = False) -> None:
        super().__init__()
        self.top_k, self.renormalise = top_k, renormalise

    def forward(self, logits: Float[Tensor, "n n_experts"]) -> tuple[Int[Tensor, "n k"], Float[Tensor, "n k"]]:
        top_logits, chosen = logits.topk(self.top_k, dim=-1)
        if self.renormalise:
            return chosen, top_logits.softmax(dim=-1)
        return chosen, logits.softmax(dim=-1).gather(-1, chosen)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalise={self.renormalise}"


class SigmoidTopK(nn.Module):
    """sigmoid scores; choose top-k of scores + correction_bias within the topk_group best groups.

    A group's score is the sum of its two best biased scores (DeepSeek-V3, NemotronH). Weights are
    the unbiased scores of the chosen experts, divided by their sum when renormalise, times scaling.
    """

    def __init__(self, n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1, renormalise: bool = True,
                 scaling: float = 1.0) -> None:
        super().__init__()
        if n_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide n_experts ({n_experts})")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalise, self.scaling = renormalise, float(scaling)
        self.correction_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)  # choice only

    def forward(self, logits: Float[Tensor, "n n_experts"]) -> tuple[Int[Tensor, "n k"], Float[Tensor, "n k"]]:
        scores = logits.sigmoid()
        biased = scores + self.correction_bias.to(scores.dtype)
        grouped = rearrange(biased, "n (g e) -> n g e", g=self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        chosen = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.renormalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scaling

    def extra_repr(self) -> str:
        return (f"top_k={self.top_k}, n_group={self.n_group}, topk_group={self.topk_group}, "
                f"renormalise={self.renormalise}, scaling={self.scaling:g}")


class StackedRows(nn.Module):
    """A stacked expert weight [n_experts d_expert d_model] seen as one [n_experts * d_expert, d_model] matrix
    (a view: scaling its columns scales every expert's), without a bias: a LayerNorm's bias cannot fold here."""

    bias = None

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.__dict__["weight"] = weight.view(-1, weight.shape[-1])  # a view, not a parameter of this module

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "bias":
            raise ValueError("fold_ln cannot fold a LayerNorm's bias into stacked experts (they have no biases); "
                             "leave fold_ln off for this model")
        super().__setattr__(name, value)


class MoE(ExpertMixture, ExpertWeights, nn.Module):
    """Router, rule, stacked experts and an optional shared MLP, every routing quantity hooked.

    Args:
        d_model, d_expert, n_experts: sizes (glossary).
        select: a routing rule (SoftmaxTopK, SigmoidTopK); its top_k is the slots per token.
        act_fn: the experts' activation (mlp.py's names).
        gated: experts are down(act(gate) * up) when True, down(act(up)) when False.
        shared: the always-on MLP, or None.
        router_dtype: the router's compute dtype floor (HF routes in float32).
        narrow_router: the router's linear runs in the activations' dtype and its logits are widened after
            (Mixtral, OLMoE, Qwen3-MoE, GPT-OSS in HF: bf16 logits, so bf16 ties are chosen as HF does).
    """

    def __init__(self, d_model: int, d_expert: int, n_experts: int, select: nn.Module, act_fn: str = "silu",
                 gated: bool = True, shared: nn.Module | None = None, narrow_router: bool = False) -> None:
        super().__init__()
        self.narrow_router = narrow_router
        self.n_experts, self.top_k, self.act_fn = n_experts, select.top_k, act_fn
        self.act = activation(act_fn)
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.select = select
        scale = d_model**-0.5
        # allocated empty, then initialised: a loader's meta build skips both (loaders/meta.py)
        self.gate_proj = nn.Parameter(nn.init.normal_(torch.empty(n_experts, d_expert, d_model), std=scale)) \
            if gated else None
        self.up_proj = nn.Parameter(nn.init.normal_(torch.empty(n_experts, d_expert, d_model), std=scale))
        self.down_proj = nn.Parameter(nn.init.normal_(torch.empty(n_experts, d_model, d_expert), std=d_expert**-0.5))
        self.shared = shared
        self.dims = {"d_model": d_model, "n_experts": n_experts, "top_k": select.top_k, "d_expert": d_expert}
        self.hook_router_logits = HookPoint("batch pos n_experts", element="wide")
        self.hook_chosen = HookPoint("batch pos top_k", element="int64")  # int64
        self.hook_routing_weights = HookPoint("batch pos top_k")
        self.hook_expert_out = HookPoint("batch pos top_k d_model")
        self.hook_routed_out = HookPoint("batch pos d_model")
        if shared is not None:
            self.hook_shared_out = HookPoint("batch pos d_model")

    def input_linears(self) -> list[Any]:
        """The router, every expert's gate and up rows (StackedRows), and the shared MLP's readers: what
        fold_ln scales by an RMSNorm's weight."""
        experts = [StackedRows(w) for w in (self.gate_proj, self.up_proj) if w is not None]
        return [self.router, *experts, *(self.shared.input_linears() if self.shared is not None else [])]

    def output_bias(self) -> Tensor | None:
        return None if self.shared is None else self.shared.output_bias()

    def expert(self, e: int, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """Expert e on the rows of x."""
        up = F.linear(x, self.up_proj[e])
        hidden = self.act(up) if self.gate_proj is None else self.act(F.linear(x, self.gate_proj[e])) * up
        return F.linear(hidden, self.down_proj[e])

    def expert_outputs(self, x: Float[Tensor, "n d_model"], chosen: Int[Tensor, "n k"]) -> Float[Tensor, "n k d_model"]:
        """Each slot's expert on its token: the slots sorted by expert, each expert run on its run of rows.

        Grouped matrix multiplies (no host read) where they apply; while compiling where they do not,
        every expert on every token (n_experts / k times the flops, no host read); else one read of
        the counts per call.
        """
        n, k = chosen.shape
        if torch.compiler.is_compiling() and not self._grouped_mm_applies(x):
            return self._every_expert(x).gather(1, chosen[..., None].expand(n, k, x.shape[-1]))
        ids = chosen.reshape(-1)
        order = ids.argsort(stable=True)  # slots grouped by expert
        rows = x[order // k]  # [n*k d_model], each slot's token
        if self._grouped_mm_applies(rows):
            ends = torch.searchsorted(ids[order], torch.arange(self.n_experts, device=ids.device), right=True)
            out = self._grouped_experts(rows, ends.to(torch.int32))
        else:
            counts = torch.bincount(ids, minlength=self.n_experts).tolist()
            out = torch.cat([self.expert(e, part) for e, part in enumerate(rows.split(counts)) if part.shape[0]])
        return out[order.argsort()].view(n, k, -1)  # back to slot order

    def _grouped_experts(self, rows: Float[Tensor, "m d_model"],
                         ends: Int[Tensor, "n_experts"]) -> Float[Tensor, "m d_model"]:
        """Every expert on its run of rows (expert e: rows ends[e-1]..ends[e]) in three grouped multiplies."""
        def linear(a: Tensor, weight: Tensor) -> Tensor:  # per group: a @ weight[e].T
            return _GROUPED_MM(a, weight.transpose(1, 2), offs=ends)

        up = linear(rows, self.up_proj)
        hidden = self.act(up) if self.gate_proj is None else self.act(linear(rows, self.gate_proj)) * up
        return linear(hidden, self.down_proj)

    def _every_expert(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n n_experts d_model"]:
        up = einsum(x, self.up_proj, "n m, e f m -> n e f")
        hidden = self.act(up) if self.gate_proj is None else self.act(einsum(x, self.gate_proj, "n m, e f m -> n e f")) * up
        return einsum(hidden, self.down_proj, "n e f, e m f -> n e m")

    def _grouped_mm_applies(self, rows: Tensor) -> bool:
        """torch's grouped multiply takes this call: no autograd (its CPU backward refuses broadcast
        gradients), float32 / bfloat16 / float16 on CPU and bfloat16 on CUDA (sm80+), 16-byte rows,
        16-byte aligned weights (on CUDA, or torch < 2.11); while compiling bfloat16 only (its meta
        function refuses the others)."""
        weights = [w for w in (self.gate_proj, self.up_proj, self.down_proj) if w is not None]
        if _GROUPED_MM is None or any(w.dtype != rows.dtype or w.device != rows.device for w in weights):
            return False
        if torch.is_grad_enabled() and (rows.requires_grad or any(w.requires_grad for w in weights)):
            return False
        if torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
            return False
        if rows.device.type == "cuda":
            ok_device = rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (8, 0)
        else:
            ok_device = rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
        size = rows.element_size()
        # torch >= 2.11 takes any address on CPU (a memory-mapped checkpoint's); the address is not traceable
        aligned = (torch.compiler.is_compiling() or (rows.device.type == "cpu" and _CPU_ANY_ADDRESS)
                   or all(w.data_ptr() % 16 == 0 for w in weights))
        return ok_device and aligned and all(w.shape[-1] * size % 16 == 0 for w in weights)

    def forward(self, x: Float[Tensor, "batch pos d_model"], ctx: Any = None) -> Float[Tensor, "batch pos d_model"]:
        batch, _, d_model = x.shape
        router_dtype = torch.promote_types(x.dtype, torch.float32)
        if self.narrow_router:
            router_logits = self.router(x).to(router_dtype)
        else:
            bias = None if self.router.bias is None else self.router.bias.to(router_dtype)  # GPT-OSS's router has one
            router_logits = F.linear(x.to(router_dtype), self.router.weight.to(router_dtype), bias)
        router_logits = self.hook_router_logits(router_logits)
        chosen, weights = self.select(rearrange(router_logits, "b l e -> (b l) e"))
        chosen = self.hook_chosen(rearrange(chosen, "(b l) k -> b l k", b=batch))
        routing_weights = self.hook_routing_weights(rearrange(weights, "(b l) k -> b l k", b=batch).to(x.dtype))
        # the router's choice is in range by construction: only a hook's edit is checked (a host read)
        if self.hook_chosen.has_hooks and (chosen.dtype != torch.long or ((chosen < 0) | (chosen >= self.n_experts)).any()):
            raise ValueError(f"{self.hook_chosen.name}: chosen experts must be int64 ids in [0, {self.n_experts})")
        outs = self.expert_outputs(rearrange(x, "b l m -> (b l) m"), rearrange(chosen, "b l k -> (b l) k"))
        expert_out = self.hook_expert_out(rearrange(outs, "(b l) k m -> b l k m", b=batch))
        routed_out = einsum(routing_weights, expert_out, "b l k, b l k m -> b l m")
        routed_out = self.hook_routed_out(routed_out)
        if self.shared is None:
            return routed_out
        shared_out = self.hook_shared_out(self.shared(x))
        return routed_out + shared_out

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, gated={self.gate_proj is not None}, act_fn={self.act_fn}"
