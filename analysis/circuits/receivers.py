"""The graph's receivers: what reads the residual stream, how its input gradient is taken, how it is patched.

Glossary
    site         the input of a norm that receivers read through (`NormSite`): a serial step's
                 `hook_{kind}_in`, a parallel step's residual, the final residual. Captured per run by a
                 forward pre-hook on the norm module.
    rows         a receiver that is a set of output rows of its sublayer's input linears (`RowsReceiver`):
                 attention heads' q, k, v ("L1H0.q"; k and v by key-value head), Mamba-2 heads' own
                 inputs ("L1H0.x": their x, z and dt rows) and their group's B and C ("L1Hg0.B"). Each row
                 set can read a different residual: in a patched run, rows r of the linear's output are
                 recomputed from norm(x + delta_r) (the module's other rows keep theirs).
    module       a receiver that is a whole sublayer (MLPs, mixtures of experts, Mamba-1 mixers): its input
                 is replaced by norm(x + delta) times the branch's input scale.
    side         a side block (Zamba2's shared transformer): its residual input and the token embedding
                 it reads are two slots, patched separately.
    logits       the final norm's input.
    gradient     of the metric with respect to the residual as this receiver alone reads it: the gradient
                 at the receiver's own tensors (a copy of the linear's output, of the module's input, of
                 the side block's arguments) pulled back through the norm with the run's own autograd
                 graph (one batched vector-Jacobian product per linear)

Assumption (checked in patched runs): a sublayer's input linears read its input times a constant
(Falcon-H1's in_multiplier), as weight processing's fold_ln assumes; they are affine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hooked.models.heads_norm import HeadsRMSNorm
from hooked.models.mamba2 import Mamba2Mixer
from hooked.models.model_map import label
from hooked.models.protocol import TokenMixer

TorchHooks = list[tuple[nn.Module, str, Callable[..., Any]]]  # (module, "pre" | "fwd", fn)
Delta = Callable[["ReceiverGroup"], tuple[Tensor | None, Tensor | None, Tensor | None]]
# -> (delta [n B p d] or None, the embedding slot's delta, which receivers are patched [n] bool)


def row_parts(module: Any, layer: int, tag: str) -> list[tuple[str, nn.Module, Tensor]] | None:
    """(label, linear, rows) of every receiver inside `module`, or None when it is read whole. The one place
    that knows the row layout of an input projection."""
    mixing = module.mixing() if isinstance(module, TokenMixer) else None
    if mixing is not None and mixing.scores is not None and _plain_qkv(module):  # attention's q, k, v rows
        q, k, v = module.input_linears()
        n, n_kv, d = module.hook_q.sizes["n_heads"], module.hook_k.sizes["n_kv_heads"], module.hook_q.sizes["d_head"]
        return ([(f"{label(layer, tag, h)}.q", q, _span(h * d, d)) for h in range(n)]
                + [(f"{label(layer, tag, h)}.{name}", lin, _span(h * d, d)) for name, lin in (("k", k), ("v", v))
                   for h in range(n_kv)])
    if isinstance(module, Mamba2Mixer):  # in_proj writes z, x B C, dt (where each starts: in_proj_starts)
        (lin,) = module.input_linears()
        p, di, gn = module.d_head, module.d_inner, module.d_state
        at = module.in_proj_starts()
        z0, x0, dt0 = at["z"], at["xBC"], at["dt"]
        own = [(f"{label(layer, tag, h)}.x", lin, torch.cat([_span(z0 + h * p, p), _span(x0 + h * p, p),
                                                            _span(dt0 + h, 1)]))
               for h in range(module.n_heads)]
        groups = [(f"{label(layer, tag)}g{g}.{name}", lin, _span(x0 + di + off * module.n_groups * gn + g * gn, gn))
                  for off, name in ((0, "B"), (1, "C")) for g in range(module.n_groups)]
        return own + groups
    return None


def row_units(module: Any) -> list[tuple[int, ...]]:
    """The units (heads) whose write reads each of `row_parts`' receivers, in its order: a query head its
    own head, a key or value head the query heads it serves (each kv head serves `n_heads // n_kv_heads`
    consecutive heads, attention.repeat_kv); a Mamba-2 head's x (with its z and dt) the heads whose
    channels its gated norm normalises together with its own (gated_norm.py's group_size: one statistic
    per group of heads, so each head's write depends on the others' inputs), a group's B and C those of
    the heads reading that group (head h reads group h // (n_heads // n_groups), mamba2.py)."""
    if isinstance(module, Mamba2Mixer):
        n, p, per = module.n_heads, module.d_head, module.n_heads // module.n_groups
        size = getattr(module.norm, "group_size", None)  # None: a gate without a norm (each head alone)

        def together(h: int) -> set[int]:
            if size is None:
                return {h}
            norms = range(h * p // size, ((h + 1) * p - 1) // size + 1)
            return {j for k in norms for j in range(k * size // p, ((k + 1) * size - 1) // p + 1)}

        own = [tuple(sorted(together(h))) for h in range(n)]
        groups = [tuple(sorted(set().union(*(together(h) for h in range(g * per, (g + 1) * per)))))
                  for g in range(module.n_groups)]
        return own + groups + groups
    n, n_kv = module.hook_q.sizes["n_heads"], module.hook_k.sizes["n_kv_heads"]
    if isinstance(getattr(module, "q_norm", None), HeadsRMSNorm):  # one statistic over every head's q (k)
        return [tuple(range(n))] * (n + 2 * n_kv)
    per = n // n_kv
    served = [tuple(range(j * per, (j + 1) * per)) for j in range(n_kv)]
    return [(h,) for h in range(n)] + served + served


def _plain_qkv(module: Any) -> bool:
    """Whether the attention's inputs are three plain projections q [n_heads d_head], k and v [n_kv_heads
    d_head] (rows per head); a gated query (Qwen3-Next), latent attention (Kimi) is read whole instead."""
    linears = module.input_linears()
    if len(linears) != 3 or not all(type(lin) is nn.Linear for lin in linears):
        return False
    sizes = module.hook_q.sizes
    n, d = sizes.get("n_heads"), sizes.get("d_head")
    n_kv = module.hook_k.sizes.get("n_kv_heads")
    if None in (n, d, n_kv):
        return False
    return [lin.out_features for lin in linears] == [n * d, n_kv * d, n_kv * d]


def _span(start: int, n: int) -> Tensor:
    return torch.arange(start, start + n)


class NormSite:
    """The input x of one norm (what its receivers read), captured per run.

    `read(delta)` is what the norm would output on x + delta: exactly (a fresh norm of it), or, when the run
    is `frozen`, linearised at this run's scale (TransformerLens's direct path patching): N(x) plus the norm
    of delta with the scale of x (hook_scale), bias left out."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm
        self.x: Tensor | None = None
        self.out: Tensor | None = None  # the norm's output in a gradient run
        self.scale: Tensor | None = None
        self.frozen = False

    def hooks(self, grad: bool) -> TorchHooks:
        def pre(module: nn.Module, args: tuple) -> tuple | None:
            x = args[0]
            if grad:  # a copy only the norm reads: the graph from here is this site's readers'
                x = x.clone()
                self.x = x
                return (x, *args[1:])
            self.x = x
            return None

        def post(module: nn.Module, args: tuple, out: Tensor) -> None:
            self.out = out

        return [(self.norm, "pre", pre)] + ([(self.norm, "fwd", post)] if grad else [])

    def pull_(self, reader_input: Tensor, grads: Tensor) -> Tensor:
        """d metric / d x for a stack of gradients at `reader_input` [n *x.shape] (a tensor computed from x in
        this gradient run). When the reader reads the norm's output itself and the norm is plain (its hook
        points unhooked, an `input_grads_` that is not None), the norm's closed form, written over `grads`; otherwise
        autograd through whatever lies between (one batched product)."""
        points = [getattr(self.norm, name, None) for name in ("hook_scale", "hook_normalized")]
        hooked = any(p is not None and p.has_hooks for p in points)
        if reader_input is self.out and not hooked:
            with torch.no_grad():
                pulled = self.norm.input_grads_(self.x, grads)  # None: no closed form (hooked.models.norms.Norm)
            if pulled is not None:
                return pulled
        return _vjp(reader_input, self.x, grads)

    def points(self) -> list[tuple[Any, Callable]]:
        """Hook points a frozen run needs (the norm's scale)."""
        if not self.frozen:
            return []

        def on_scale(s: Tensor, hook: Any) -> None:
            self.scale = s

        return [(self.norm.hook_scale, on_scale)]

    def read(self, delta: Tensor) -> Tensor:
        """The norm's output on x + delta for each delta [n batch pos d] -> [n batch pos d]. The norm runs
        through its forward: its hook points fire, the module hooks do not."""
        if self.frozen:
            base = self.norm.forward(self.x)
            return base[None] + self.norm.normalize_with_scale(delta, self.scale).to(base.dtype)
        return self.norm.forward((self.x[None] + delta).flatten(0, 1)).unflatten(0, delta.shape[:2])


class ReceiverGroup:
    labels: list[str]
    stage: int  # the step whose input it reads (n_steps: the logits)
    layer: int
    site: NormSite | None = None
    two_slots: bool = False  # a side block: residual and embedding

    def grad_hooks(self) -> TorchHooks:
        raise NotImplementedError

    def grad_tensors(self) -> list[Tensor]:
        """This run's tensors whose gradients `resid_grads` reads."""
        raise NotImplementedError

    def resid_grads(self, grads: list[Tensor | None], out: Tensor) -> Tensor | None:
        """Write d metric / d residual as each receiver reads it into out [n b p d], zeros where the metric
        does not reach it (out is uninitialised on entry: one buffer for every receiver, so no copy joins
        them); return the embedding slot's or None."""
        raise NotImplementedError

    def patch_hooks(self, delta: Delta) -> TorchHooks:
        raise NotImplementedError


def _vjp(outputs: Tensor, inputs: Tensor, grads: Tensor) -> Tensor:
    """Vector-Jacobian products of a batch of output gradients [n, *outputs.shape] -> [n, *inputs.shape]."""
    try:
        (out,) = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, is_grads_batched=True)
        return out
    except RuntimeError:  # an op without a batching rule: one product at a time
        return torch.stack([torch.autograd.grad(outputs, inputs, g, retain_graph=True)[0] for g in grads])


def _zeros_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


class RowsReceiver(ReceiverGroup):
    def __init__(self, site: NormSite, in_scale: float, module: nn.Module, parts: list[tuple[str, nn.Module, Tensor]],
                 layer: int, stage: int) -> None:
        self.site, self.in_scale, self.module, self.layer, self.stage = site, in_scale, module, layer, stage
        self.labels = [label for label, _, _ in parts]
        self.linears: list[nn.Module] = []
        self.rows: list[list[tuple[int, Tensor]]] = []  # per linear: (part index, rows)
        for i, (_, lin, rows) in enumerate(parts):
            if lin not in self.linears:
                self.linears.append(lin)
                self.rows.append([])
            self.rows[self.linears.index(lin)].append((i, rows))
        self._outs: list[Tensor] = []
        self._ins: list[Tensor | None] = []  # each linear's input in a gradient run

    # ------------------------------------------------------------------ gradients
    def grad_hooks(self) -> TorchHooks:
        self._outs = [None] * len(self.linears)
        self._ins: list[Tensor | None] = [None] * len(self.linears)

        def make(k: int) -> Callable[..., Tensor]:
            def fwd(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
                out = out.clone()
                self._outs[k], self._ins[k] = out, args[0]
                return out
            return fwd

        return [(lin, "fwd", make(k)) for k, lin in enumerate(self.linears)]

    def grad_tensors(self) -> list[Tensor]:
        return list(self._outs)

    def resid_grads(self, grads: list[Tensor | None], out: Tensor) -> None:
        x = self.site.x
        by_input: dict[int, tuple[Tensor, list[int]]] = {}  # linears reading one tensor: pulled back at once
        for lin, y, u, g, parts in zip(self.linears, self._outs, self._ins, grads, self.rows):
            if g is None:
                out[[i for i, _ in parts]] = 0
                continue
            if type(lin) is nn.Linear:  # each part's rows back to the linear's input, into out
                _, idx = by_input.setdefault(id(u), (u, []))
                idx += _rows_back(lin.weight, g, parts, out)
                continue
            masked = g.new_zeros((len(parts), *g.shape))
            for j, (_, rows) in enumerate(parts):
                rows = rows.to(g.device)
                masked[j, ..., rows] = g[..., rows]
            pulled = _vjp(y, x, masked)
            for j, (i, _) in enumerate(parts):
                out[i] = pulled[j]
        for u, idx in by_input.values():  # then through the norm, every part at once
            lo, hi = min(idx), max(idx) + 1
            if sorted(idx) == list(range(lo, hi)):
                out[lo:hi] = self.site.pull_(u, out[lo:hi])
            else:
                out[idx] = self.site.pull_(u, out[idx])
        return None

    # ------------------------------------------------------------------- patching
    def patch_hooks(self, delta: Delta) -> TorchHooks:
        seen: dict[str, Tensor] = {}

        def pre(module: nn.Module, args: tuple) -> None:
            seen["in"] = args[0]

        def make(parts: list[tuple[int, Tensor]]) -> Callable[..., Tensor | None]:
            def fwd(lin: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
                d, _, active = delta(self)
                if d is None:
                    return None
                live = [(i, rows) for i, rows in parts if bool(active[i])]
                if not live:
                    return None
                u, m = args[0], seen["in"]
                c = 1.0 if u is m else _constant(u, m, lin)
                normed = self.site.read(d[[i for i, _ in live]]) * self.in_scale  # [n b p d]
                inputs = u + c * (normed - m)
                out = out.clone()
                for j, (_, rows) in enumerate(live):
                    rows = rows.to(out.device)
                    out[..., rows] = _rows_of(lin, inputs[j], rows)
                return out
            return fwd

        return [(self.module, "pre", pre)] + [(lin, "fwd", make(parts)) for lin, parts in zip(self.linears, self.rows)]


def _rows_back(weight: Tensor, g: Tensor, parts: list[tuple[int, Tensor]], out: Tensor) -> list[int]:
    """out[i] = g[..., rows_i] @ weight[rows_i] for every part (i, rows_i): the gradient at a linear's input
    when only those output rows are read. Parts with as many rows share one batched product. Returns the i."""
    by_size: dict[int, list[tuple[int, Tensor]]] = {}
    for i, rows in parts:
        by_size.setdefault(len(rows), []).append((i, rows.to(g.device)))
    flat = g.reshape(-1, g.shape[-1])
    for size, same in by_size.items():
        idx = torch.cat([rows for _, rows in same])
        gs = flat.index_select(1, idx).view(flat.shape[0], len(same), size).transpose(0, 1)  # [n M r]
        ws = weight.detach().index_select(0, idx).view(len(same), size, weight.shape[1]).to(g.dtype)  # [n r d]
        number = [i for i, _ in same]
        lo = number[0]
        if number == list(range(lo, lo + len(same))):
            torch.bmm(gs, ws, out=out[lo:lo + len(same)].view(len(same), flat.shape[0], -1))
        else:
            out[number] = torch.bmm(gs, ws).view(len(same), *out.shape[1:])
    return [i for i, _ in parts]


def _rows_of(lin: nn.Module, u: Tensor, rows: Tensor) -> Tensor:
    """lin(u)[..., rows]: only those rows of a plain nn.Linear, the whole map otherwise (module hooks skipped)."""
    if type(lin) is nn.Linear:
        return torch.nn.functional.linear(u, lin.weight[rows], None if lin.bias is None else lin.bias[rows])
    return lin.forward(u)[..., rows]


def _constant(u: Tensor, m: Tensor, lin: nn.Module) -> float | Tensor:
    """c with u = c * m (a linear's input as a constant times its module's input), checked. A mixer that
    zeroes its padded positions (attention_mask) reads u = c * m * keep: then c * keep [batch pos 1], so a
    patch adds nothing where the mixer reads nothing."""
    keep = u.ne(0).any(-1, keepdim=True) | m.eq(0).all(-1, keepdim=True)  # rows the module zeroed: padding
    c = float((u * m).sum() / (m * m * keep).sum().clamp(min=torch.finfo(m.dtype).tiny))
    if not torch.allclose(u, c * m * keep, rtol=1e-4, atol=1e-6 * float(u.abs().max())):
        raise ValueError(f"{type(lin).__name__} reads something other than a constant times its module's input: "
                         "circuits cannot patch its rows")
    return c if bool(keep.all()) else c * keep.to(m.dtype)


class _WholeInput(ReceiverGroup):
    """A receiver that reads one module's first argument whole (a sublayer, the final norm): its gradient is
    taken at a copy of that argument; a patched run replaces the argument (`_patched`)."""

    module: nn.Module
    _in: Tensor | None = None
    _read: Tensor | None = None  # the argument as it came (a norm's output, or a multiple of it)

    def grad_hooks(self) -> TorchHooks:
        def pre(module: nn.Module, args: tuple) -> tuple:
            self._read = args[0]
            self._in = args[0].clone()
            return (self._in, *args[1:])

        return [(self.module, "pre", pre)]

    def grad_tensors(self) -> list[Tensor]:
        return [self._in]

    def _patched(self, x: Tensor, delta: Tensor) -> Tensor:
        """The argument a patched run gives the module, from its own and delta [1 b p d]."""
        raise NotImplementedError

    def patch_hooks(self, delta: Delta) -> TorchHooks:
        def pre(module: nn.Module, args: tuple) -> tuple | None:
            d, _, _ = delta(self)
            if d is None:
                return None
            return (self._patched(args[0], d), *args[1:])

        return [(self.module, "pre", pre)]


class ModuleReceiver(_WholeInput):
    def __init__(self, site: NormSite, in_scale: float, module: nn.Module, label: str, layer: int, stage: int) -> None:
        self.site, self.in_scale, self.module, self.labels, self.layer, self.stage = (
            site, in_scale, module, [label], layer, stage)

    def resid_grads(self, grads: list[Tensor | None], out: Tensor) -> None:
        if grads[0] is None:
            out.zero_()
        else:
            # the module's input gradient pulled back through its norm to the stream (a read may be narrower than
            # the stream: Qwen4-Exp's hyper-connections, hooked/models/hyper_residual.py)
            out[0:1] = self.site.pull_(self._read, grads[0][None].clone())
        return None

    def _patched(self, x: Tensor, delta: Tensor) -> Tensor:
        return self.site.read(delta)[0] * self.in_scale


class SideReceiver(ReceiverGroup):
    """A side block: reads (resid, embedding, ctx)."""

    two_slots = True

    def __init__(self, module: nn.Module, label: str, layer: int, stage: int) -> None:
        self.module, self.labels, self.layer, self.stage = module, [label], layer, stage
        self._args: tuple[Tensor, Tensor] | None = None

    def grad_hooks(self) -> TorchHooks:
        def pre(module: nn.Module, args: tuple) -> tuple:
            resid, emb = args[0].clone(), args[1].clone()
            self._args = (resid, emb)
            return (resid, emb, *args[2:])

        return [(self.module, "pre", pre)]

    def grad_tensors(self) -> list[Tensor]:
        return list(self._args)

    def resid_grads(self, grads: list[Tensor | None], out: Tensor) -> Tensor:
        out[0] = _zeros_none(grads[0], out[0])
        return _zeros_none(grads[1], self._args[1])[None]

    def patch_hooks(self, delta: Delta) -> TorchHooks:
        def pre(module: nn.Module, args: tuple) -> tuple | None:
            d, d_emb, _ = delta(self)
            if d is None:
                return None
            return (args[0] + d[0], args[1] + d_emb[0], *args[2:])

        return [(self.module, "pre", pre)]


class LogitsReceiver(_WholeInput):
    def __init__(self, final_norm: nn.Module, stage: int, layer: int) -> None:
        self.module, self.labels, self.stage, self.layer = final_norm, ["logits"], stage, layer

    def resid_grads(self, grads: list[Tensor | None], out: Tensor) -> None:
        out[0] = _zeros_none(grads[0], out[0])
        return None

    def _patched(self, x: Tensor, delta: Tensor) -> Tensor:
        return x + delta[0]
