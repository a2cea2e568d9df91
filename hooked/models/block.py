"""The one residual block every family is made of: steps that each add a sublayer's output to the stream.

Glossary
    kind        what a sublayer is, and so its module and hook names: "attn" (attention.py),
                "mixer" (an SSM mixer: mamba.py, mamba2.py) or "mlp" (mlp.py's MLPs, moe.py)
    Sublayer    a serial step:  resid = resid + scale * post_norm(module(norm(resid [+ side])))
    Parallel    branches that read one normalised input and add their sum:
                resid = resid + (out_1 * b_1(in_1 * x) + out_2 * b_2(in_2 * x)),  x = norm(resid)
                (Falcon-H1: an SSM mixer beside attention); or each branch its own norm of the same
                residual: resid = resid + b_1(norm_1(resid)) + b_2(norm_2(resid)) (GPT-NeoX)
    Side        an extra input of a step, computed from the residual and the token embedding and
                added to what the step's norm reads, never to the stream (Zamba2's shared
                transformer: side = linear(shared([resid, embedding])))
    scale       a multiplier on a step's output before it is added (Granite's residual_multiplier,
                Falcon-H1's muP branch scales); 1 elsewhere

Step i (counting from 1) owns `ln{i}` (its norm) and `ln{i}_post` (a post-norm: Gemma 2/3's
sandwich norms); the sublayer is registered under its kind. Hooks, all [batch pos d_model]:

    hook_resid_pre
    step:      hook_{kind}_in (what the norm reads: the residual, plus the side input if any),
               ln{i}.*, {kind}.*, [ln{i}_post.*], hook_{kind}_out (what is added: scaled, post-normed)
    parallel:  ln{i}.*, then per branch {kind}.*, hook_{kind}_out (its scaled output, before the sum);
               branches with their own norms: per branch hook_{kind}_in, ln{j}.* (j = 1, 2, .. in branch
               order; such a step is the block's only step), {kind}.*, hook_{kind}_out
    side:      {side}.* and hook_{side}_out, before the step's hook_{kind}_in
    hook_resid_mid between two steps, hook_resid_post at the end.

`hook_{kind}_out` is exactly what the step adds to the residual, so zeroing it removes the sublayer
(or the branch) exactly, and the writers of a block sum to resid_post - resid_pre.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context

KINDS = ("attn", "mixer", "mlp")


@dataclass(frozen=True)
class Side:
    """An input computed beside the stream: `proj(module(resid, ctx.embedding, ctx))`, registered as
    `{name}` and `{proj_name}`, hooked as `hook_{name}_out`."""

    name: str
    module: nn.Module
    proj: nn.Module
    proj_name: str = "linear"


@dataclass(frozen=True)
class Sublayer:
    kind: str
    norm: nn.Module
    module: nn.Module
    post_norm: nn.Module | None = None
    scale: float = 1.0
    side: Side | None = None


@dataclass(frozen=True)
class Branch:
    kind: str
    module: nn.Module
    in_scale: float = 1.0
    out_scale: float = 1.0
    norm: nn.Module | None = None  # the branch's own norm of the residual (GPT-NeoX); None: the step's


@dataclass(frozen=True)
class Parallel:
    norm: nn.Module | None  # None when every branch has its own norm
    branches: tuple[Branch, ...]

    def __post_init__(self) -> None:
        own = [b.norm is not None for b in self.branches]
        if self.norm is None and not all(own) or self.norm is not None and any(own):
            raise ValueError("a parallel step has one shared norm or a norm per branch, not both or neither")


Step = Sublayer | Parallel


@dataclass(frozen=True)
class Writer:
    """One thing a block adds to the residual: its kind, its module, and the hook holding exactly the
    added tensor (multipliers and post-norms applied). Analyses read these, never names."""

    kind: str
    module: nn.Module
    out_hook: HookPoint
    norm: nn.Module  # the norm whose output the module reads (fold_ln folds it into the module)
    in_scale: float = 1.0  # what multiplies the norm's output before the module reads it
    scale: float = 1.0  # what multiplies the module's output (post-norm aside)
    post_norm: nn.Module | None = None
    step: int = 1  # the block step it belongs to: the branches of one parallel step share it


class ResidualBlock(nn.Module):
    """hook_resid_pre -> one or two steps (serial sublayers or parallel branches) -> hook_resid_post."""

    def __init__(self, steps: Sequence[Step]) -> None:
        super().__init__()
        if not 1 <= len(steps) <= 2:
            raise ValueError(f"a block has one or two steps, got {len(steps)}")
        self.hook_resid_pre = HookPoint("batch pos d_model")
        self._plan: list[tuple] = []
        for i, step in enumerate(steps, start=1):
            if i == 2:
                self.hook_resid_mid = HookPoint("batch pos d_model")
            self._plan.append(self._register(i, step))
        self.hook_resid_post = HookPoint("batch pos d_model")

    def _register(self, i: int, step: Step) -> tuple:
        if isinstance(step, Sublayer):
            kinds: tuple[str, ...] = (step.kind,)
        else:
            kinds = tuple(b.kind for b in step.branches)
        bad = [k for k in kinds if k not in KINDS or hasattr(self, k)]
        if bad or len(set(kinds)) != len(kinds):
            raise ValueError(f"step {i}: sublayer kinds must be distinct ones of {KINDS} within a block, got {kinds}")
        if isinstance(step, Parallel):
            if step.norm is not None:
                self.add_module(f"ln{i}", step.norm)
            elif i != 1:
                raise ValueError("a parallel step with a norm per branch must be the block's only step")
            for j, b in enumerate(step.branches, start=1):
                if b.norm is not None:
                    self.add_module(f"hook_{b.kind}_in", HookPoint("batch pos d_model"))
                    self.add_module(f"ln{j}", b.norm)
                self.add_module(b.kind, b.module)
                self.add_module(f"hook_{b.kind}_out", HookPoint("batch pos d_model"))
            return ("parallel", i, step)
        if step.side is not None:
            self.add_module(step.side.name, step.side.module)
            self.add_module(step.side.proj_name, step.side.proj)
            self.add_module(f"hook_{step.side.name}_out", HookPoint("batch pos d_model"))
            self.reads_embedding = True
        self.add_module(f"hook_{step.kind}_in", HookPoint("batch pos d_model"))
        self.add_module(f"ln{i}", step.norm)
        self.add_module(step.kind, step.module)
        self.add_module(f"ln{i}_post", step.post_norm)  # None without a post-norm
        self.add_module(f"hook_{step.kind}_out", HookPoint("batch pos d_model"))
        return ("serial", i, step)

    reads_embedding = False  # True when a step's side input reads the token embedding (ctx.embedding)

    # ------------------------------------------------------------------------------- protocol
    def writers(self) -> Iterator[Writer]:
        """What this block adds to the residual, in forward order."""
        for how, i, step in self._plan:
            norm = getattr(self, f"ln{i}", None)
            if how == "parallel":
                for b in step.branches:
                    yield Writer(b.kind, getattr(self, b.kind), getattr(self, f"hook_{b.kind}_out"),
                                 norm if b.norm is None else b.norm, b.in_scale, b.out_scale, step=i)
            else:
                yield Writer(step.kind, getattr(self, step.kind), getattr(self, f"hook_{step.kind}_out"), norm,
                             1.0, step.scale, getattr(self, f"ln{i}_post"), step=i)

    def sides(self) -> Iterator[tuple[Side, HookPoint, str]]:
        """(side, the hook of what it adds to its step's input, that step's kind) of every side input."""
        for how, _, step in self._plan:
            if how == "serial" and step.side is not None:
                yield step.side, getattr(self, f"hook_{step.side.name}_out"), step.kind

    def norm_readers(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """(norm, the linear maps reading its output) of every norm in the block that reads the stream or
        a side input (weight processing folds each norm into its readers)."""
        pairs = [(w.norm, w.module.input_linears()) for w in self.writers()]
        for how, _, step in self._plan:
            if how == "serial" and step.side is not None:
                pairs += getattr(self, step.side.name).norm_readers()
        return pairs

    def stream_norms(self) -> list[tuple[int, nn.Module, float]]:
        """(step, norm, alpha) of every step that renormalises the stream itself, resid = alpha * norm(resid) +
        ... (norm_residual.py); none here. Decompositions carry earlier components through these."""
        return []

    @property
    def mlp_reads_mid(self) -> bool:
        """False when the MLP is a branch of a parallel step (GPT-NeoX): it reads the block's input, and
        the block has no resid_mid. Analyses decomposing "the MLP's input" read this."""
        return not any(how == "parallel" and any(b.kind == "mlp" for b in step.branches) for how, _, step in self._plan)

    @property
    def kind(self) -> str:
        """The kind of the block's first sublayer: what the layer is ("attn", "mixer" or "mlp")."""
        return next(self.writers()).kind

    def sublayer(self, kind: str) -> nn.Module | None:
        """The sublayer of `kind` ("attn", "mixer", "mlp") in this block, or None."""
        return next((w.module for w in self.writers() if w.kind == kind), None)

    # -------------------------------------------------------------------------------- forward
    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        for n, (how, i, step) in enumerate(self._plan):
            if n == 1:
                resid = self.hook_resid_mid(resid)
            added = self._parallel(resid, i, step, ctx) if how == "parallel" else self._serial(resid, i, step, ctx)
            resid = resid + added
        return self.hook_resid_post(resid)

    def _serial(self, resid: Tensor, i: int, step: Sublayer, ctx: Context) -> Tensor:
        x = resid
        if step.side is not None:
            side = step.side
            if ctx.embedding is None:
                raise ValueError(f"{self.hook_resid_pre.name.rsplit('.', 1)[0]} is a hybrid layer: its {side.name} "
                                 "block reads the token embedding; with start_at_layer, pass tokens=")
            extra = getattr(self, side.proj_name)(getattr(self, side.name)(resid, ctx.embedding, ctx))
            x = x + getattr(self, f"hook_{side.name}_out")(extra)
        x = getattr(self, f"hook_{step.kind}_in")(x)
        out = getattr(self, step.kind)(getattr(self, f"ln{i}")(x), ctx)
        post = getattr(self, f"ln{i}_post")
        if post is not None:
            out = post(out)
        if step.scale != 1.0:
            out = out * step.scale
        return getattr(self, f"hook_{step.kind}_out")(out)

    def _parallel(self, resid: Tensor, i: int, step: Parallel, ctx: Context) -> Tensor:
        x = getattr(self, f"ln{i}")(resid) if step.norm is not None else None
        total = None
        for j, b in enumerate(step.branches, start=1):
            if b.norm is not None:  # its own norm of the residual
                x = getattr(self, f"ln{j}")(getattr(self, f"hook_{b.kind}_in")(resid))
            out = getattr(self, b.kind)(x if b.in_scale == 1.0 else x * b.in_scale, ctx)
            out = getattr(self, f"hook_{b.kind}_out")(out if b.out_scale == 1.0 else out * b.out_scale)
            total = out if total is None else total + out
        return total

    def extra_repr(self) -> str:
        parts = []
        for how, i, step in self._plan:
            if how == "parallel":
                parts.append("(" + " + ".join(f"{b.out_scale:g}*{b.kind}({b.in_scale:g}*x)" for b in step.branches)
                             + ")")
            else:
                scale = f"{step.scale:g}*" if step.scale != 1.0 else ""
                parts.append(f"{scale}{step.kind}")
        return "resid + " + ", then + ".join(parts)
