"""TransformerLens's weight names on a mixture of experts (moe.py): the router, and each expert as a unit.

Glossary (shapes as TL has them; every matrix is a view of our stacked parameter, a bias missing from the
architecture reads as zeros)
    moe.W_gate             [d_model n_experts]   the router (TL's MoE names its router W_gate)
    moe.b_gate             [n_experts]           the router's bias (GPT-OSS), zeros elsewhere
    moe.experts[e]         expert e, with an MLP's names:
        W_in   [d_model d_expert]   the linear (up) branch       b_in   [d_expert]
        W_gate [d_model d_expert]   the gate branch (gated)      b_gate [d_expert]
        W_out  [d_expert d_model]   the down projection           b_out  [d_model]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Expert:
    """Expert e of a mixture of experts under TL's MLP names (module docstring)."""

    def __init__(self, moe: Any, e: int) -> None:
        self.moe, self.e = moe, e

    def _bias(self, name: str, width: int) -> Tensor:
        bias = getattr(self.moe, name, None)
        return bias[self.e] if bias is not None else torch.zeros(width, dtype=self.moe.down_proj.dtype,
                                                                 device=self.moe.down_proj.device)

    @property
    def W_in(self) -> Tensor:
        return self.moe.up_proj[self.e].T

    @property
    def W_gate(self) -> Tensor:
        if self.moe.gate_proj is None:
            raise AttributeError("W_gate: these experts are not gated (down(act(up)))")
        return self.moe.gate_proj[self.e].T

    @property
    def W_out(self) -> Tensor:
        return self.moe.down_proj[self.e].T

    @property
    def b_in(self) -> Tensor:
        return self._bias("up_bias", self.moe.up_proj.shape[1])

    @property
    def b_gate(self) -> Tensor:
        return self._bias("gate_bias", self.moe.up_proj.shape[1])

    @property
    def b_out(self) -> Tensor:
        return self._bias("down_bias", self.moe.down_proj.shape[1])

    def __repr__(self) -> str:
        return f"Expert({self.e} of {self.moe.n_experts})"


class ExpertWeights:
    """TL's names on a mixture of experts (mixed into moe.py's MoE)."""

    @property
    def W_gate(self) -> Tensor:
        return self.router.weight.T

    @property
    def b_gate(self) -> Tensor:
        bias = self.router.bias
        return bias if bias is not None else torch.zeros(self.n_experts, dtype=self.router.weight.dtype,
                                                         device=self.router.weight.device)

    @property
    def experts(self) -> list[Expert]:
        return [Expert(self, e) for e in range(self.n_experts)]
