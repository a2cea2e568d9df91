"""The pre-norm residual block the hybrid families share, and their language model.

Glossary
    kind        what a sublayer is, and so its module and hook names: "attn" (attention.py),
                "mixer" (an SSM mixer, mamba.py / mamba2.py) or "mlp" (mlp.py's MLPs or moe.py)
    residual_multiplier  Granite's scale on every sublayer's output before it is added (1 elsewhere)
    embedding_multiplier, logit_multiplier   Granite / Falcon-H1 scales on the embedding and logits

A DecoderBlock has one or two sublayers, each `resid = resid + m * sublayer(norm(resid))`:
    first:   ln1, then `attn` or `mixer` or `mlp` (NemotronH's MLP-only and MoE-only layers)
    second:  ln2, then `mlp` (Bamba, Granite 4, Jamba; absent in NemotronH)

Hooks (all [batch pos d_model] but the sublayers' own):
    blocks.{l}.hook_resid_pre, ln1.hook_normalized, {attn|mixer|mlp}.*, hook_{attn|mixer|mlp}_out,
    and with a second sublayer hook_resid_mid, ln2.hook_normalized, mlp.*, hook_mlp_out;
    then hook_resid_post. `hook_*_out` is what the sublayer adds: its output times the residual multiplier.

A ParallelBlock (Falcon-H1) runs attention and an SSM mixer side by side on the same ln1 output:
    resid = resid + attn_out + mixer_out,  attn_out = a_out * attn(a_in * x),  mixer_out = m_out * mixer(x)
    resid = resid + mlp(ln2(resid))
with hook_attn_out and hook_mixer_out on each branch's output (multipliers applied) before the sum,
so that zeroing one of them removes that branch exactly.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context, HookedModel
from hooked.models.embed import Unembed
from hooked.models.norms import RMSNorm

KINDS = ("attn", "mixer", "mlp")


class DecoderBlock(nn.Module):
    """resid + m * first(ln1(resid)) [+ m * mlp(ln2(.))]; `first` is registered under its kind's name."""

    def __init__(self, ln1: nn.Module, first: nn.Module, kind: str, ln2: nn.Module | None = None,
                 mlp: nn.Module | None = None, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"sublayer kind must be one of {KINDS}, got {kind!r}")
        if (ln2 is None) != (mlp is None) or (mlp is not None and kind == "mlp"):
            raise ValueError("a second sublayer needs both ln2 and mlp, after an attn or mixer sublayer")
        self.kind = kind
        self.residual_multiplier = float(residual_multiplier)
        self.ln1 = ln1
        self.add_module(kind, first)
        self.hook_resid_pre = HookPoint("batch pos d_model")
        self.add_module(f"hook_{kind}_out", HookPoint())  # [batch pos d_model]
        if mlp is not None:
            self.hook_resid_mid = HookPoint("batch pos d_model")
            self.ln2, self.mlp = ln2, mlp
            self.hook_mlp_out = HookPoint("batch pos d_model")
        self.hook_resid_post = HookPoint("batch pos d_model")

    def _first(self, x: Tensor, ctx: Context) -> Tensor:
        module = getattr(self, self.kind)
        return module(x) if self.kind == "mlp" else module(x, ctx)

    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        m = self.residual_multiplier
        resid_pre = self.hook_resid_pre(resid)
        first_out = self._first(self.ln1(resid_pre), ctx)
        first_out = getattr(self, f"hook_{self.kind}_out")(first_out if m == 1.0 else first_out * m)
        resid = resid_pre + first_out
        if hasattr(self, "mlp") and self.kind != "mlp":
            resid = self.hook_resid_mid(resid)
            mlp_out = self.mlp(self.ln2(resid))
            mlp_out = self.hook_mlp_out(mlp_out if m == 1.0 else mlp_out * m)
            resid = resid + mlp_out
        return self.hook_resid_post(resid)

    def extra_repr(self) -> str:
        return f"residual_multiplier={self.residual_multiplier:g}" if self.residual_multiplier != 1.0 else ""


class HybridLM(HookedModel):
    """embed (* embedding_multiplier) -> blocks -> RMSNorm -> unembed (* logit_multiplier).

    `cfg` needs d_model, d_vocab, eps, tied; the family file builds the blocks.
    """

    def __init__(self, cfg: Any, blocks: list[nn.Module], embedding_multiplier: float = 1.0,
                 logit_multiplier: float = 1.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding_multiplier = float(embedding_multiplier)
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, tied_to=self.embed if cfg.tied else None,
                               scale=logit_multiplier)
        self.hook_embed = HookPoint("batch pos d_model")  # after the embedding multiplier
        self.setup()

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        embed = self.embed(tokens)
        if self.embedding_multiplier != 1.0:
            embed = embed * self.embedding_multiplier
        embed = self.hook_embed(embed)
        return embed


class ParallelBlock(nn.Module):
    """resid + a_out * attn(a_in * x) + m_out * mixer(x), x = ln1(resid); then + mlp(ln2(.)) (Falcon-H1).

    Hooks: blocks.{l}.hook_resid_pre, ln1.hook_normalized, mixer.*, hook_mixer_out, attn.*,
    hook_attn_out, hook_resid_mid, ln2.hook_normalized, mlp.*, hook_mlp_out, hook_resid_post.
    """

    def __init__(self, ln1: nn.Module, attn: nn.Module, mixer: nn.Module, ln2: nn.Module, mlp: nn.Module,
                 attn_in_multiplier: float = 1.0, attn_out_multiplier: float = 1.0,
                 mixer_out_multiplier: float = 1.0) -> None:
        super().__init__()
        self.ln1, self.mixer, self.attn, self.ln2, self.mlp = ln1, mixer, attn, ln2, mlp
        self.attn_in_multiplier = float(attn_in_multiplier)
        self.attn_out_multiplier = float(attn_out_multiplier)
        self.mixer_out_multiplier = float(mixer_out_multiplier)
        self.hook_resid_pre = HookPoint("batch pos d_model")
        self.hook_mixer_out = HookPoint("batch pos d_model")  # times mixer_out_multiplier
        self.hook_attn_out = HookPoint("batch pos d_model")  # times attn_out_multiplier
        self.hook_resid_mid = HookPoint("batch pos d_model")
        self.hook_mlp_out = HookPoint("batch pos d_model")
        self.hook_resid_post = HookPoint("batch pos d_model")

    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        resid_pre = self.hook_resid_pre(resid)
        x = self.ln1(resid_pre)
        mixer_out = self.mixer(x, ctx) * self.mixer_out_multiplier
        mixer_out = self.hook_mixer_out(mixer_out)
        attn_out = self.attn(x * self.attn_in_multiplier, ctx) * self.attn_out_multiplier
        attn_out = self.hook_attn_out(attn_out)
        resid_mid = resid_pre + (mixer_out + attn_out)
        resid_mid = self.hook_resid_mid(resid_mid)
        mlp_out = self.mlp(self.ln2(resid_mid))
        mlp_out = self.hook_mlp_out(mlp_out)
        resid_post = resid_mid + mlp_out
        resid_post = self.hook_resid_post(resid_post)
        return resid_post

    def extra_repr(self) -> str:
        return (f"attn_in_multiplier={self.attn_in_multiplier:g}, attn_out_multiplier={self.attn_out_multiplier:g}, "
                f"mixer_out_multiplier={self.mixer_out_multiplier:g}")
