"""Weights under TransformerLens's names, read from the module structure (no per-architecture code).

Glossary (shapes as TL has them; "view" = shares memory with our parameter)
    attention module (q_proj, k_proj, v_proj, o_proj: nn.Linear), per module, views:
        W_Q [n_heads d_in d_head]   _W_K, _W_V [n_kv_heads d_in d_head]   W_O [n_heads d_head d_out]
        b_Q [n_heads d_head]        _b_K, _b_V [n_kv_heads d_head]       b_O [d_out]
        W_K, W_V, b_K, b_V: the kv heads repeated for each query head (GQA as TL does it; a copy when
        grouped). A missing bias reads as zeros (not a view).
    MLP module (up_proj, optional gate_proj, down_proj): W_in [d_model d_mlp] (the linear branch,
        up_proj), W_gate [d_model d_mlp] (gated MLPs), W_out [d_mlp d_model], b_in, b_gate, b_out.
    SSM mixer (in_proj, out_proj): W_in_proj [d_model in_width] (in_proj's output columns in the
        mixer's order: Mamba-1 [x ; z], Mamba-2 [z ; xBC ; dt]), W_out_proj [d_inner d_model], and
        W_out_heads [n_heads d_head d_model] (Mamba-1: [d_inner 1 d_model]): head h's write is
        gated[..., h*d_head:(h+1)*d_head] @ W_out_heads[h], exactly what hook_head_out holds.
    model: W_E [d_vocab d_model], W_pos [n_ctx d_model] (learned positions only), W_U [d_model d_vocab],
        b_U [d_vocab]; every per-module name stacked over the blocks ([n_layers, ...], a copy), when
        every block has that module (hybrids: use model.blocks[l].<module>.W_*); QK and OV as
        FactoredMatrix [n_layers n_heads d_model d_model].
    dispatched models (loaders/dispatch.py): the model-level names read offloaded modules through
        `hooked.devices.onloaded`, so they are real weights (copies); a module-level name on an
        offloaded module (meta between forwards) is refused with the way to read it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hooked.devices import onloaded
from hooked.factored_matrix import FactoredMatrix
from hooked.validate import Flag, Integer, checked, token_ids


def _linear(module: nn.Module, name: str) -> nn.Linear:
    lin = getattr(module, name, None)
    if not isinstance(lin, nn.Linear):
        raise ValueError(f"{type(module).__name__}.{name} is {type(lin).__name__}, not an nn.Linear: "
                             "its weight has no single matrix to show")
    if lin.weight.is_meta:
        raise ValueError(f"{type(module).__name__}.{name}'s weight is offloaded (meta between forwards on a "
                         "dispatched model): read the model-level name (model.W_Q, ...), or read this one inside "
                         "`with hooked.devices.onloaded(model, module):`")
    return lin


def _bias(lin: nn.Linear) -> Tensor:
    return lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])


class AttentionWeights:
    """TL's weight names on an attention module (mixed into hooked.models.attention.Attention)."""

    def _in_heads(self, name: str, heads: int) -> Tensor:  # [heads d_in d_head]
        w = _linear(self, name).weight
        return w.view(heads, self.d_head, w.shape[-1]).transpose(-1, -2)

    @property
    def W_Q(self) -> Tensor:
        return self._in_heads("q_proj", self.n_heads)

    @property
    def _W_K(self) -> Tensor:
        return self._in_heads("k_proj", self.n_kv_heads)

    @property
    def _W_V(self) -> Tensor:
        return self._in_heads("v_proj", self.n_kv_heads)

    @property
    def W_K(self) -> Tensor:
        return self._W_K.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def W_V(self) -> Tensor:
        return self._W_V.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def W_O(self) -> Tensor:
        w = _linear(self, "o_proj").weight  # [d_out (n_heads d_head)]
        return w.T.view(self.n_heads, self.d_head, w.shape[0])

    @property
    def b_Q(self) -> Tensor:
        return _bias(_linear(self, "q_proj")).view(self.n_heads, self.d_head)

    @property
    def _b_K(self) -> Tensor:
        return _bias(_linear(self, "k_proj")).view(self.n_kv_heads, self.d_head)

    @property
    def _b_V(self) -> Tensor:
        return _bias(_linear(self, "v_proj")).view(self.n_kv_heads, self.d_head)

    @property
    def b_K(self) -> Tensor:
        return self._b_K.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def b_V(self) -> Tensor:
        return self._b_V.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def b_O(self) -> Tensor:
        return _bias(_linear(self, "o_proj"))

    @property
    def QK(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_V, self.W_O)


class MLPWeights:
    """TL's weight names on an MLP (mixed into MLP and GatedMLP)."""

    @property
    def W_in(self) -> Tensor:
        return _linear(self, "up_proj").weight.T

    @property
    def W_gate(self) -> Tensor:
        return _linear(self, "gate_proj").weight.T

    @property
    def W_out(self) -> Tensor:
        return _linear(self, "down_proj").weight.T

    @property
    def b_in(self) -> Tensor:
        return _bias(_linear(self, "up_proj"))

    @property
    def b_gate(self) -> Tensor:
        return _bias(_linear(self, "gate_proj"))

    @property
    def b_out(self) -> Tensor:
        return _bias(_linear(self, "down_proj"))


class MixerWeights:
    """Documented names of an SSM mixer's projections (mixed into the Mamba-1 and Mamba-2 mixers)."""

    @property
    def W_in_proj(self) -> Tensor:
        return _linear(self, "in_proj").weight.T

    @property
    def W_out_proj(self) -> Tensor:
        return _linear(self, "out_proj").weight.T

    @property
    def W_out_heads(self) -> Tensor:
        w = _linear(self, "out_proj").weight  # [d_model d_inner]
        d_head = getattr(self, "d_head", 1)
        return w.T.view(w.shape[1] // d_head, d_head, w.shape[0])


_STACKED = {
    "attn": ("W_Q", "W_K", "W_V", "W_O", "_W_K", "_W_V", "b_Q", "b_K", "b_V", "b_O", "_b_K", "_b_V"),
    "mlp": ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out"),
    "mixer": ("W_in_proj", "W_out_proj", "W_out_heads"),
}
_MODULE_OF = {name: module for module, names in _STACKED.items() for name in names}


class ModelWeights:
    """Model-level names (mixed into HookedModel): embeddings, unembedding, stacked block weights."""

    def _read(self, module: nn.Module, read: Any) -> Tensor:
        """read(module) with real weights: on a dispatched model, inside `onloaded`, as a copy."""
        if not any(p.is_meta for p in module.parameters()):
            return read(module)
        with onloaded(self, module):
            return read(module).clone()

    @property
    def W_E(self) -> Tensor:
        return self._read(self.embed, lambda m: m.weight)

    @property
    def W_pos(self) -> Tensor:
        pos = getattr(self, "pos_embed", None)
        if pos is None:
            raise AttributeError(f"{type(self).__name__} has no learned position embedding (W_pos)")
        return self._read(pos, lambda m: m.weight)

    @property
    def W_E_pos(self) -> Tensor:
        """[d_vocab + n_ctx, d_model]: the token and position embeddings stacked (TL's)."""
        return torch.cat([self.W_E, self.W_pos], dim=0)

    @property
    def W_U(self) -> Tensor:
        return self._read(self.unembed, lambda m: m.weight.T)

    @property
    def b_U(self) -> Tensor:
        def read(m: nn.Module) -> Tensor:
            bias = getattr(m, "bias", None)
            return bias if bias is not None else m.weight.new_zeros(m.weight.shape[0])

        return self._read(self.unembed, read)

    @property
    def QK(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_V, self.W_O)

    def tokens_to_residual_directions(self, tokens: Any) -> Tensor:
        """W_U's column of each token, [..., d_model] (TL's name); a str must be one token."""
        if isinstance(tokens, str):
            try:
                tokens = self.to_single_token(tokens)
            except ValueError as e:
                raise ValueError(f"tokens_to_residual_directions: tokens={tokens!r}: {e}") from None
        ids = token_ids(tokens, self.cfg.d_vocab, "tokens_to_residual_directions: tokens")
        return self.unembed.weight[ids.to(self.unembed.weight.device)]

    @checked(layer=Integer(ge=0, le=lambda args: args["self"].cfg.n_layers), mlp_input=Flag(), include_mlp_biases=Flag())
    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """The output biases (o_proj, the MLP's down_proj, a mixer's out_proj: each sublayer's
        `output_bias()`, times its block's output scale) every block before `layer` writes, plus block
        `layer`'s writers before its MLP when `mlp_input` (TL's; none where the MLP is a parallel branch,
        GPT-NeoX's, reading the block's input): [d_model]. A post-normed sublayer's
        bias (Gemma's) is not a constant direction: it is left to the decomposition (cache_resid.py).
        On a dispatched model each bias is read through `onloaded` and summed on the CPU."""
        from hooked.devices import onloaded

        dispatched = getattr(self, "hf_device_map", None) is not None
        total = None
        mid = layer == self.cfg.n_layers or self.blocks[layer].mlp_reads_mid  # False: a parallel MLP reads the input
        for l in range(layer + (1 if mlp_input and mid else 0)):
            for w in self.blocks[l].writers():
                if (l == layer and w.kind == "mlp") or (w.kind == "mlp" and not include_mlp_biases):
                    continue
                if w.post_norm is not None:
                    continue
                with onloaded(self, w.module):
                    bias = w.module.output_bias()
                    if bias is not None:
                        bias = bias.detach().to("cpu") if dispatched else bias
                        bias = bias if w.scale == 1.0 else bias * w.scale
                        total = bias if total is None else total + bias.to(total.device)
        if total is None:
            weight = self.unembed.weight
            total = torch.zeros(self.cfg.d_model, dtype=weight.dtype, device="cpu" if dispatched else weight.device)
        return total

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id (TL's)."""
        return self.tokenizer.decode([int(token_ids(int_token, self.cfg.d_vocab, "to_single_str_token: int_token"))])

    def stacked_weight(self, name: str) -> Tensor:
        """`name` of every block's attn / mlp / mixer, stacked: [n_layers, ...]."""
        module = _MODULE_OF[name]
        missing = [l for l, b in enumerate(self.blocks) if b.sublayer(module) is None]
        if missing:
            raise AttributeError(f"{name}: blocks {missing} have no {module!r} module; "
                                 f"read model.blocks[l].{module}.{name} (or a shared block's) instead")
        return torch.stack([self._read(b.sublayer(module), lambda m: getattr(m, name)) for b in self.blocks])

    def __getattr__(self, name: str) -> Any:
        if name in _MODULE_OF:
            return self.stacked_weight(name)
        return super().__getattr__(name)
