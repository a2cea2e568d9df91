"""The embeddings and the unembedding (weights tied to the token embedding or its own), with
TransformerLens's weight names: `embed.W_E` [d_vocab d_model], `pos_embed.W_pos` [n_ctx d_model],
`unembed.W_U` [d_model d_vocab] (a transposed view) and `unembed.b_U` [d_vocab] (zeros without a bias),
and TL's `unembed.hook_in` [batch pos d_model] / `unembed.hook_out` [batch pos d_vocab] (the logits,
before a final soft-cap).

Glossary
    d_vocab    vocabulary size; d_model residual width
    W_U        unembed.weight [d_vocab d_model]; logits = x @ W_U^T (no bias, as in GPT-2 and Llama)
    tied       W_U is the token embedding's weight: `model.unembed.weight is model.embed.weight`
    scale      a constant multiplying the logits (Granite's 1 / logits_scaling, Falcon-H1's
               lm_head_multiplier); 1 elsewhere. Logit attributions through W_U must apply it too.
    softcap    optional final-logit soft-capping after the scale (Gemma 2): logits = cap * tanh(logits / cap),
               hooks `unembed.softcap.hook_in` (before the cap) and `unembed.softcap.hook_out` (softcap.py)

A tied Unembed does not own a parameter: it reads the embedding's weight when called. The tie is
therefore structural, and survives what breaks ties held as two references to one Parameter
(`module.to_empty(device=...)` after building on the meta device replaces each module's
parameters separately). The embedding is kept out of the module tree here, so it appears once in
`named_parameters()` and `state_dict()` (under `embed.weight`); a loader's key map leaves
`unembed.weight` out when tied.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.softcap import SoftCap
from hooked.ops.row_sparse import row_sparse_linear


class Embed(nn.Embedding):
    """Token embedding; `weight` is W_E (TL's name as a property)."""

    @property
    def W_E(self) -> Tensor:
        return self.weight


class PosEmbed(nn.Embedding):
    """Learned absolute positions; `weight` is W_pos."""

    @property
    def W_pos(self) -> Tensor:
        return self.weight


class Unembed(nn.Module):
    def __init__(self, d_model: int, d_vocab: int, tied_to: nn.Embedding | None = None, scale: float = 1.0,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.scale = float(scale)
        self.__dict__["_tied_to"] = tied_to  # a plain reference, not a submodule
        self.softcap = SoftCap(softcap, "batch pos d_vocab") if softcap is not None else None
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(d_vocab, d_model))
            nn.init.normal_(self.weight, std=0.02)
        self.register_parameter("bias", None)  # b_U: only weight processing (fold_ln) gives one
        self.hook_in = HookPoint("batch pos d_model")  # TL's: ln_final's output
        self.hook_out = HookPoint("batch pos d_vocab")  # TL's: the logits (before a final soft-cap)

    @property
    def tied(self) -> bool:
        return self._tied_to is not None

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("_tied_to") is not None:
            return self._tied_to.weight
        return super().__getattr__(name)

    @property
    def W_U(self) -> Tensor:
        return self.weight.T

    @property
    def b_U(self) -> Tensor:
        return self.bias if self.bias is not None else self.weight.new_zeros(self.weight.shape[0])

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        x = self.hook_in(x)
        logits = row_sparse_linear(x, self.weight, self.bias)  # bias: only weight processing (fold_ln) gives one
        logits = logits if self.scale == 1.0 else logits * self.scale
        logits = self.hook_out(logits)
        return logits if self.softcap is None else self.softcap(logits)

    def extra_repr(self) -> str:
        d_vocab, d_model = self.weight.shape
        scale = f", scale={self.scale:g}" if self.scale != 1.0 else ""
        return f"d_model={d_model}, d_vocab={d_vocab}, tied={self.tied}{scale}"
