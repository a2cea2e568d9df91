"""The residual block every SSM layer uses: resid + mixer(norm(resid)).

Hooks: blocks.{l}.hook_resid_pre, blocks.{l}.ln1.hook_normalized, blocks.{l}.mixer.*,
blocks.{l}.hook_mixer_out, blocks.{l}.hook_resid_post. The mixer is any module called as
`mixer(x, ctx)` on the normalised residual [batch pos d_model].
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn

from hooked.hook_points import HookPoint
from hooked.models.base import Context


class SSMBlock(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.ln1 = norm
        self.mixer = mixer
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_mixer_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def forward(self, resid: Float[Tensor, "batch pos d_model"], ctx: Context) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        mixer_out = self.hook_mixer_out(self.mixer(self.ln1(resid), ctx))
        return self.hook_resid_post(resid + mixer_out)
