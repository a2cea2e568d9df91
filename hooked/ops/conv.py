"""Depthwise causal convolution (the short conv of Mamba-1 and Mamba-2).

Glossary: batch b, pos l, channels c (d_inner for Mamba-1, d_inner + 2 n_groups d_state for
Mamba-2), width w (d_conv).
    out[b, t, c] = bias[c] + sum_k weight[c, k] * x[b, t - (w - 1) + k, c],   x = 0 before position 0.
"""

import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor


def causal_conv1d(
    x: Float[Tensor, "batch pos channels"],
    weight: Float[Tensor, "channels width"],
    bias: Float[Tensor, "channels"] | None = None,
) -> Float[Tensor, "batch pos channels"]:
    """Depthwise causal conv: HF's nn.Conv1d(groups=channels, padding=width-1)(x)[..., :pos].

    Args:
        x: input sequence. weight: one filter per channel (HF conv1d.weight squeezed from
            [channels 1 width]); weight[:, -1] multiplies the current position.
        bias: per channel, or None.
    Returns:
        the convolved sequence, same shape as x (no activation).
    """
    seq_len, width = x.shape[1], weight.shape[1]
    out = F.conv1d(
        rearrange(x, "b l c -> b c l"), weight[:, None, :], bias, padding=width - 1, groups=x.shape[2]
    )
    return rearrange(out[..., :seq_len], "b c l -> b l c")
