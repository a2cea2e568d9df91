"""The residual block every SSM layer uses, resid + mixer(norm(resid)), and the pure-SSM language model.

Hooks: blocks.{l}.hook_resid_pre, blocks.{l}.ln1.hook_normalized, blocks.{l}.mixer.*,
blocks.{l}.hook_mixer_out, blocks.{l}.hook_resid_post. The mixer is any module called as
`mixer(x, ctx)` on the normalised residual [batch pos d_model].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context, HookedModel
from hooked.models.norms import RMSNorm


class SSMBlock(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.ln1 = norm
        self.mixer = mixer
        self.hook_resid_pre = HookPoint("batch pos d_model")
        self.hook_mixer_out = HookPoint("batch pos d_model")
        self.hook_resid_post = HookPoint("batch pos d_model")

    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        mixer_out = self.hook_mixer_out(self.mixer(self.ln1(resid), ctx))
        return self.hook_resid_post(resid + mixer_out)


class SSMLanguageModel(HookedModel):
    """embed -> n_layers x SSMBlock(RMSNorm, mixer) -> RMSNorm -> unembed (tied when cfg.tied).

    Mamba-1 and Mamba-2 are this model with their own mixer: `make_mixer(cfg)` builds one layer's.
    """

    def __init__(self, cfg: Any, make_mixer: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList(SSMBlock(RMSNorm(cfg.d_model, cfg.eps), make_mixer(cfg)) for _ in range(cfg.n_layers))
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tied:
            self.unembed.weight = self.embed.weight
        self.hook_embed = HookPoint("batch pos d_model")
        self.setup()

    def embed_input(self, tokens: Int[Tensor, "batch pos"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_embed(self.embed(tokens))
