"""The residual stream read back from a cache, with TransformerLens's signatures and numbers.

Glossary
    component    one term of a stack [component, batch, pos, d_model] ([component, pos, d_model]
                 after remove_batch_dim); a decomposition's components sum to the residual
    layer        "up to the input of block `layer`": None or -1 means the final residual (the input
                 of ln_final), `n_layers` too. `mlp_input=True` moves the point to the input of
                 block `layer`'s MLP (its ln2).
    pos_slice    TransformerLens's Slice: None (all), an int (drops the axis), a tuple (slice(*t)),
                 a slice, or a list / tensor of indices; refused by name when it selects no position
                 or a position outside the axis (hooked.validate.pos_index)
    scale        the cached `hook_scale` of the norm that reads the residual at `layer` (ln1, ln2
                 or ln_final): apply_ln_to_stack divides by it, so the map stays linear

apply_ln_to_stack: (stack - mean) / scale for LayerNorm, stack / scale for RMSNorm, as TL does, and
then times the norm's weight. TL leaves the weight out because its defaults fold it into the next
matrix (`fold_ln`); on unprocessed weights the weight belongs there for the result to be exact,
and on processed weights it is 1, so both agree with TL on the weights TL uses.
accumulated_resid(apply_ln=True) at the final layer normalises each component with its own
statistics (the logit lens), as TL 3.9 does; elsewhere the scale of the full residual.

Dispatched models (loaders/dispatch.py): weights read here (norms, W_O, W_out) are brought in with
`hooked.devices.onloaded`, and stacks of activations from several devices are moved to the last
one's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hooked.devices import onloaded
from hooked.models.model_map import label, label_layer, model_map
from hooked.models.protocol import ExpertMixture
from hooked.validate import Flag, checked, pos_index, resid_layer, token_ids

SliceInput = Any  # None | int | tuple | slice | list | Tensor


def slice_pos(t: Tensor, pos_slice: SliceInput, dim: int = -2, name: str = "pos_slice", unit: str = "positions") -> Tensor:
    """TransformerLens's Slice(pos_slice).apply(t, dim); `name` is the argument's, for messages."""
    if pos_slice is None:
        return t
    pos_slice = pos_index(pos_slice, t.shape[dim], name, unit)  # refuses what selects nothing or is no position
    if torch.is_tensor(pos_slice):
        pos_slice = pos_slice.to(t.device)
    index = [slice(None)] * t.ndim
    index[dim] = pos_slice
    return t[tuple(index)]


def _stack(parts: list[Tensor], cat: bool = False) -> Tensor:
    """torch.stack (or cat) of tensors that may sit on several devices (a dispatched model's layers):
    all moved to the last one's device."""
    device = parts[-1].device
    parts = [p.to(device) for p in parts]
    return torch.cat(parts) if cat else torch.stack(parts)


class ResidualStreamMethods:
    """Mixed into ActivationCache: needs `cache_dict`, `model`, `has_batch_dim`, `n_layers`, `__getitem__`."""

    # ------------------------------------------------------------------------------- helpers
    def _final_layer(self, layer: int | None) -> int:
        return resid_layer(layer, self.n_layers)

    def _mid_at(self, layer: int) -> bool:
        """Whether block `layer`'s MLP reads the block's writers before it (resid_mid), not the block's
        input (a parallel block, GPT-NeoX's): what `mlp_input=True` decomposes."""
        return layer >= self.n_layers or self.model.blocks[layer].mlp_reads_mid

    def _norm_at(self, layer: int, mlp_input: bool) -> tuple[Any, str]:
        """The norm reading the residual at `layer` (the block's first step, or its MLP's with
        mlp_input) and its hook-name prefix."""
        if layer == self.n_layers:
            return self.model.ln_final, "ln_final"
        writers = list(self.model.blocks[layer].writers())
        if mlp_input:
            mlps = [w for w in writers if w.kind == "mlp"]
            if not mlps or writers[0].kind == "mlp":
                raise ValueError(f"block {layer} has no MLP after another sublayer (mlp_input={mlp_input})")
            writers = mlps
        norm = writers[0].norm
        return norm, norm.hook_scale.name.rsplit(".", 1)[0]

    def _renorms(self, layer: int, mlp_input: bool) -> list[tuple[int, int, Any, float]]:
        """(block, step, norm, alpha) of every step that renormalises the stream itself before the residual at
        `layer` (block.stream_norms: MiniMax's resid = alpha * norm(resid) + ...; none in other blocks)."""
        out = []
        for l in range(min(layer + 1, self.n_layers)):
            for i, norm, alpha in self.model.blocks[l].stream_norms():
                if l < layer or (mlp_input and i < self._mlp_writer(l).step):
                    out.append((l, i, norm, alpha))
        return out

    def _carried(self, stack: Tensor, origin: tuple[int, int], renorms: list, pos_slice: SliceInput = None) -> Tensor:
        """A component added at `origin` (block, step; the embedding: (-1, 0)) as it reaches the residual:
        through every later renormalising step, alpha times the norm with its cached scale (linear)."""
        for l, i, norm, alpha in renorms:
            if (l, i) <= origin:
                continue
            key = norm.hook_scale.name
            if key not in self.cache_dict:
                raise KeyError(f"a decomposition through a renormalised stream needs {key!r} in the cache")
            with onloaded(self.model, norm):
                device = norm.weight.device
                scale = slice_pos(self.cache_dict[key], pos_slice).to(device)
                stack = (norm.normalize_with_scale(stack.to(device), scale) * alpha).to(stack.device)
        return stack

    def _carried_heads(self, heads: Tensor, labels: list[str], renorms: list, pos_slice: SliceInput) -> Tensor:
        """Per-unit writes (stack_head_results' order) carried from their block's token-mixing step."""
        if not renorms:
            return heads
        layers = torch.tensor([label_layer(t) for t in labels])
        out = heads.clone()
        for l in layers.unique().tolist():
            step = min(w.step for w in self.model.blocks[l].writers() if w.kind != "mlp")
            idx = (layers == l).nonzero()[:, 0].to(heads.device)
            out[idx] = self._carried(heads[idx], (l, step), renorms, pos_slice)
        return out

    # ----------------------------------------------------------------------------- layer norm
    @checked(mlp_input=Flag(), has_batch_dim=Flag(none=True), recompute_ln=Flag())
    def apply_ln_to_stack(self, residual_stack: Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: SliceInput = None, batch_slice: SliceInput = None,
                          has_batch_dim: bool | None = None, recompute_ln: bool = False) -> Tensor:
        """Normalise a stack of components as the norm at `layer` normalised the full residual."""
        layer = self._final_layer(layer)
        d_model = self.model.dims.get("d_stream", self.model.cfg.d_model)  # the residual's width (Qwen4-Exp: streams)
        if not torch.is_tensor(residual_stack) or residual_stack.ndim < 2 or residual_stack.shape[-1] != d_model:
            shape = tuple(residual_stack.shape) if torch.is_tensor(residual_stack) else type(residual_stack).__name__
            raise ValueError(f"apply_ln_to_stack: residual_stack must be [..., pos, d_model={d_model}], got {shape}")
        has_batch_dim = self.has_batch_dim if has_batch_dim is None else has_batch_dim
        if has_batch_dim and batch_slice is not None:
            residual_stack = slice_pos(residual_stack, batch_slice, dim=1)
        norm, prefix = self._norm_at(layer, mlp_input)
        with onloaded(self.model, norm):
            device = norm.weight.device
            if recompute_ln and layer == self.n_layers:
                return norm.normalize_fresh(residual_stack.to(device))
            key = f"{prefix}.hook_scale"
            if key not in self.cache_dict:
                raise KeyError(f"apply_ln needs {key!r} in the cache (a bare run_with_cache() has it)")
            scale = slice_pos(self.cache_dict[key], pos_slice)
            if has_batch_dim and batch_slice is not None and self.has_batch_dim:
                scale = slice_pos(scale, batch_slice, dim=0)
            return norm.normalize_with_scale(residual_stack.to(device), scale.to(device))

    # --------------------------------------------------------------------------- residuals
    @checked(incl_mid=Flag(), apply_ln=Flag(), mlp_input=Flag(), return_labels=Flag())
    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: SliceInput = None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream at the input of blocks 0..layer (layer None / -1 / n_layers: then the
        final residual, labelled "final_post"). Returns [component, (batch,) pos, d_model] (and labels)."""
        layer = self._final_layer(layer)
        parts, labels = [], []
        for l in range(layer + 1):
            if l == self.n_layers:
                parts.append(self[("resid_post", self.n_layers - 1)])
                labels.append("final_post")
                continue
            parts.append(self[("resid_pre", l)])
            labels.append(f"{l}_pre")
            if ((incl_mid and l < layer) or (mlp_input and l == layer)) and self.model.blocks[l].mlp_reads_mid:
                parts.append(self[("resid_mid", l)])
                labels.append(f"{l}_mid")
        stack = _stack([slice_pos(p, pos_slice) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice,
                                           recompute_ln=layer == self.n_layers)
        return (stack, labels) if return_labels else stack

    @checked(mlp_input=Flag(), apply_ln=Flag(), incl_embeds=Flag(), return_labels=Flag())
    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: SliceInput = None, incl_embeds: bool = True,
                        return_labels: bool = False):
        """The residual at `layer` split into what wrote it: the embeddings, then each block's outputs
        (attn_out and mlp_out; an SSM block's mixer_out counts as "attn"). mode: "all", "attn", "mlp"."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._final_layer(layer)
        renorms = self._renorms(layer, mlp_input)
        parts, labels = [], []
        if incl_embeds:
            for key in ("hook_embed", "hook_pos_embed"):
                if key in self.cache_dict:
                    parts.append(self._carried(self.cache_dict[key], (-1, 0), renorms))
                    labels.append(key[len("hook_"):])
        for l in range(layer + (1 if mlp_input and self._mid_at(layer) else 0)):
            for w in self.model.blocks[l].writers():  # what each block adds, hooked (block.py)
                if l == layer and w.kind == "mlp":
                    continue  # mlp_input: block `layer`'s writers before its MLP
                if mode == "all" or (w.kind == "mlp") == (mode == "mlp"):
                    parts.append(self._carried(self.cache_dict[w.out_hook.name], (l, w.step), renorms))
                    labels.append(f"{l}_{w.kind}_out")
        like = slice_pos(self["embed"], pos_slice)
        stack = _stack([slice_pos(p, pos_slice) for p in parts]) if parts else like.new_zeros((0, *like.shape))
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None) -> Tensor:
        """One activation of every block < layer (-1: all), stacked: [layer, ...] (TL's)."""
        layer = self._final_layer(layer)
        return _stack([self[(activation_name, l, sublayer_type)] for l in range(layer)])

    # ------------------------------------------------------------------------------- heads
    def _to_resid(self, w: Any, stack: Tensor) -> Tensor:
        """Part of writer `w`'s module output [.., pos, d_model] as it reaches the residual: through the
        post-norm with its cached (frozen) scale, then times the block's output scale. Linear, so the
        parts of an output sum to what the block adds (hook_{kind}_out)."""
        if w.post_norm is not None:
            key = w.post_norm.hook_scale.name
            if key not in self.cache_dict:
                raise KeyError(f"a post-normed sublayer's parts need {key!r} in the cache")
            with onloaded(self.model, w.post_norm):
                scale = self.cache_dict[key]
                device = w.post_norm.weight.device
                stack = w.post_norm.normalize_with_scale(stack.to(device), scale.to(device)).to(stack.device)
        return stack if w.scale == 1.0 else stack * w.scale

    def _head_parts(self, l: int, incl_shared: bool) -> list[tuple[Tensor, list[str]]]:
        """Block l's per-unit writes [units, .., pos, d_model] in the residual (biases left out), with labels."""
        out = []
        for site in model_map(self.model).layer_sites(l):
            if not site.mixes_tokens or (site.writer is None and not incl_shared):
                continue  # experts: _expert_parts; a side block's units write into its input, not the residual
            key = site.result_hook.name
            if key not in self.cache_dict:
                continue
            res = self.cache_dict[key].movedim(-2, 0)  # [units .. pos d]
            if site.writer is not None:
                res = self._to_resid(site.writer, res)
            out.append((res, site.labels()))
        return out

    def compute_head_results(self) -> None:
        """Add each unit's write (the mixers' result hooks: `attn.hook_result`, `mixer.hook_head_out`)
        to the cache where it is missing, asked from the mixer through the model map (`Site.writes_from`:
        hook_z, and hook_gate for gated attention; hook_gated for SSMs)."""
        for site in model_map(self.model):
            if not site.mixes_tokens or site.result_hook.name in self.cache_dict:
                continue
            reads = [self.cache_dict.get(h.name) for h in site.reads]
            if any(r is None for r in reads):
                continue
            with onloaded(self.model, site.module):
                device = next(site.module.parameters()).device
                self.cache_dict[site.result_hook.name] = site.writes(*(r.to(device) for r in reads)).to(reads[0].device)

    @checked(return_labels=Flag(), incl_remainder=Flag(), apply_ln=Flag(), incl_shared=Flag())
    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: SliceInput = None, apply_ln: bool = False, incl_shared: bool = False):
        """Each unit's write to the residual for blocks < layer (-1: all): [unit, (batch,) pos, d_model],
        labels of the model map (hooked.models.model_map: H, M beside attention, SH shared, C channels).

        Attention heads from `attn.hook_result`, SSM units (Mamba-2 heads, Mamba-1 channels) from
        `mixer.hook_head_out`; where those were not cached they are computed from hook_z / hook_gated
        (compute_head_results). Each is taken as it reaches the residual: times the block's output scale
        (Granite's residual multiplier, Falcon-H1's branch multipliers) and through a post-norm with its
        cached scale (Gemma 2/3), so heads plus biases sum to the block's output exactly. Zamba2's
        shared-attention heads ("L{l}SH{h}") write into the shared block, not the residual stream, so
        they are left out unless `incl_shared=True` (then as they are, unscaled).
        `incl_remainder` adds resid_post[layer - 1] minus the heads' sum ("remainder").
        """
        layer = self._final_layer(layer)
        self.compute_head_results()
        parts, labels = [], []
        for l in range(layer):
            for res, names in self._head_parts(l, incl_shared):
                parts.append(slice_pos(res, pos_slice))
                labels += names
        if not parts and layer > 0 and not incl_remainder:
            raise KeyError("no per-head results and no hook_z / hook_gated in the cache to compute them from")
        like = slice_pos(self["embed"], pos_slice) if not parts or (incl_remainder and layer == 0) else None
        stack = _stack(parts, cat=True) if parts else like.new_zeros((0, *like.shape))  # a hook_z-only cache needs no embed
        if incl_remainder:
            total = slice_pos(self[("resid_post", layer - 1)], pos_slice) if layer > 0 else like
            stack = torch.cat([stack, (total.to(stack.device) - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    # ----------------------------------------------------------------------------- neurons
    def get_neuron_results(self, layer: int, neuron_slice: SliceInput = None, pos_slice: SliceInput = None) -> Tensor:
        """Each neuron's write out of the MLP [(batch,) pos, d_mlp, d_model]: post * W_out (times the
        MLP's own output multiplier, Falcon-H1's, and its output gate where it has one, RWKV's receptance:
        the hook `mlp.output_gate` [batch pos d_model] multiplying the output feature by feature; bias left out)."""
        post = slice_pos(self[("post", layer, "mlp")], pos_slice)
        mlp = self.model.blocks[layer].mlp
        with onloaded(self.model, mlp):
            W_out = mlp.down_proj.weight.T.to(post.device)  # [d_mlp d_model]
            W_out = W_out * getattr(mlp, "out_multiplier", 1.0)
        if neuron_slice is not None:
            post = slice_pos(post, neuron_slice, dim=-1, name="neuron_slice", unit="neurons")
            W_out = slice_pos(W_out, neuron_slice, dim=0, name="neuron_slice", unit="neurons")
        gate = getattr(mlp, "output_gate", None)
        if gate is None:
            return post[..., None] * W_out
        return post[..., None] * W_out * slice_pos(self.cache_dict[gate.name], pos_slice).to(post.device)[..., None, :]

    def _mlp_writer(self, l: int) -> Any:
        return next((w for w in self.model.blocks[l].writers() if w.kind == "mlp"), None)

    @checked(return_labels=Flag(), incl_remainder=Flag(), apply_ln=Flag())
    def stack_neuron_results(self, layer: int, pos_slice: SliceInput = None, neuron_slice: SliceInput = None,
                             return_labels: bool = False, incl_remainder: bool = False, apply_ln: bool = False):
        """Each MLP neuron's write to the residual for blocks < layer: [neuron, (batch,) pos, d_model],
        labels "L{l}N{i}" (times the block's output scale, through a post-norm's cached scale)."""
        layer = self._final_layer(layer)
        parts, labels = [], []
        for l in range(layer):
            if f"blocks.{l}.mlp.hook_post" not in self.cache_dict:
                continue
            res = self._to_resid(self._mlp_writer(l), self.get_neuron_results(l, neuron_slice).movedim(-2, 0))
            parts.append(slice_pos(res, pos_slice))
            ids = slice_pos(torch.arange(self.model.cfg.d_mlp if neuron_slice is not None else res.shape[0]),
                            neuron_slice, dim=0, name="neuron_slice", unit="neurons")
            labels += [label(l, "N", int(i)) for i in ids.reshape(-1)]
        like = slice_pos(self["embed"], pos_slice) if not parts or (incl_remainder and layer == 0) else None
        stack = _stack(parts, cat=True) if parts else like.new_zeros((0, *like.shape))  # a hook_z-only cache needs no embed
        if incl_remainder:
            total = slice_pos(self[("resid_post", layer - 1)], pos_slice) if layer > 0 else like
            stack = torch.cat([stack, (total - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def _expert_parts(self, l: int, w: Any) -> tuple[list[Tensor], list[str]]:
        """A mixture of experts' output split by expert (its write, asked of the mixture through the model
        map: routing weight times expert output), plus its always-on shared MLP whole ("L{l}shared")."""
        site = model_map(self.model).site(w.out_hook.name.rsplit(".", 1)[0] + "." + w.kind)
        per_expert = site.writes_from(self.cache_dict).movedim(-2, 0)  # [E .. pos d]
        parts, labels = [self._to_resid(w, per_expert)], site.labels()
        if w.module.shared is not None:
            parts.append(self._to_resid(w, self.cache_dict[w.module.hook_shared_out.name][None]))
            labels.append(label(l, "shared"))
        return parts, labels

    # ------------------------------------------------------------------------- attribution
    @checked(mlp_input=Flag(), expand_neurons=Flag(), apply_ln=Flag(), return_labels=Flag())
    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False,
                                     pos_slice: SliceInput = None, return_labels: bool = False):
        """Every unit's write, then each MLP's neurons (a mixture of experts: each expert and its shared
        MLP; or each block's whole mlp_out with expand_neurons=False), embed, pos_embed and the biases:
        components that sum to the residual at `layer` exactly, on every family (block output scales,
        post-norms with their cached scales, MoE routing included). The bias component is one vector
        broadcast over positions, or per position where a post-norm scales it."""
        layer = self._final_layer(layer)
        stop = layer + (1 if mlp_input and self._mid_at(layer) else 0)
        renorms = self._renorms(layer, mlp_input)  # steps renormalising the stream (MiniMax): carried through
        heads, labels = self.stack_head_results(stop, pos_slice=pos_slice, return_labels=True)
        parts, mlp_labels, bias = [self._carried_heads(heads, labels, renorms, pos_slice)], [], None
        for l in range(stop):
            for w in self.model.blocks[l].writers():
                if w.kind == "mlp" and l == layer:
                    continue  # mlp_input: block `layer`'s writers before its MLP
                with_bias = w.kind != "mlp"  # heads leave their projection's bias out
                mlp_parts = []
                if w.kind == "mlp" and not expand_neurons:
                    mlp_parts.append(slice_pos(self.cache_dict[w.out_hook.name], pos_slice)[None])
                    mlp_labels.append(f"{l}_mlp_out")
                elif w.kind == "mlp" and isinstance(w.module, ExpertMixture):
                    expert_parts, names = self._expert_parts(l, w)
                    mlp_parts += [slice_pos(p, pos_slice) for p in expert_parts]
                    mlp_labels += names
                elif w.kind != "mlp" and not any(site.module is w.module for site in model_map(self.model).layer_sites(l)):
                    mlp_parts.append(slice_pos(self.cache_dict[w.out_hook.name], pos_slice)[None])  # no units: whole
                    mlp_labels.append(f"{l}_{w.kind}_out")  # (Qwen4-Exp's per-layer embeddings)
                    with_bias = False
                elif w.kind == "mlp":
                    neurons, names = self.stack_neuron_results(l + 1, pos_slice=pos_slice, return_labels=True)
                    keep = [i for i, n in enumerate(names) if n.startswith(label(l, "N"))]
                    mlp_parts.append(neurons[keep])
                    mlp_labels += [names[i] for i in keep]
                    with_bias = True
                parts += [self._carried(p, (l, w.step), renorms, pos_slice) for p in mlp_parts]
                if with_bias:
                    with onloaded(self.model, w.module):
                        b = w.module.output_bias()
                        b = None if b is None else b.detach().to(heads.device)
                    if b is not None:
                        b = self._carried(self._to_resid(w, b), (l, w.step), renorms)
                        bias = b if bias is None else bias + b
        labels = labels + mlp_labels
        for key in ("hook_embed", "hook_pos_embed"):
            if key in self.cache_dict:
                parts.append(self._carried(slice_pos(self.cache_dict[key], pos_slice)[None], (-1, 0), renorms,
                                           pos_slice))
                labels.append(key[len("hook_"):])
        if bias is None:
            bias = heads.new_zeros(heads.shape[-1])
        elif bias.ndim > 1:  # per position (post-normed biases)
            bias = slice_pos(bias, pos_slice)
        parts.append(bias.to(heads).expand((1, *heads.shape[1:])))
        labels.append("bias")
        stack = _stack([p.to(heads.device) for p in parts], cat=True)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def logit_attrs(self, residual_stack: Tensor, tokens: Any, incorrect_tokens: Any = None,
                    pos_slice: SliceInput = None, batch_slice: SliceInput = None,
                    has_batch_dim: bool = True) -> Tensor:
        """Each component's contribution to the logit of `tokens` (minus `incorrect_tokens`), after the
        final norm's scale and the logit multiplier (Granite's 1 / logits_scaling, Falcon-H1's
        lm_head_multiplier): [component, ...]; they sum to the logit before a final soft-cap (Gemma 2's,
        not linear) minus the final LayerNorm's bias term (GPT-2's ln_final.bias · W_U[token]: no
        component's). Tokens: an id, a str (one token), or a tensor of ids."""
        directions = self._token_directions(tokens)
        if incorrect_tokens is not None:
            wrong = self._token_directions(incorrect_tokens, "incorrect_tokens")
            if wrong.shape != directions.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape: "
                                 f"{tuple(directions.shape[:-1])} vs {tuple(wrong.shape[:-1])}")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        try:
            torch.broadcast_shapes(directions.shape[:-1], scaled.shape[1:-1])
        except RuntimeError:
            raise ValueError(f"logit_attrs: tokens of shape {tuple(directions.shape[:-1])} do not match the stack's "
                             f"{'[batch pos]' if has_batch_dim else '[pos]'} = {tuple(scaled.shape[1:-1])}") from None
        return (scaled * directions).sum(-1) * self.model.unembed.scale

    def _token_directions(self, tokens: Any, name: str = "tokens") -> Tensor:
        if isinstance(tokens, str):
            tokens = self.model.to_single_token(tokens)
        ids = token_ids(tokens, self.model.cfg.d_vocab, f"logit_attrs: {name}").to(self.model.unembed.weight.device)
        return self.model.unembed.weight[ids]  # W_U[:, token] as rows: [..., d_model]
