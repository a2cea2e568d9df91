"""A gated depthwise causal conv as attention: LFM2's y = C * conv(B x) written as y_j = sum_i K[j, i] (B x)_i.

Glossary: batch b, pos l, channels c, width w; rows q_pos = targets j, columns k_pos = sources i (DESIGN.md
section 4's convention, as hook_pattern and the SSM kernels).
    K[b, c, j, i] = C[b, j, c] * weight[c, w - 1 - (j - i)]   for 0 <= j - i < w, else 0
so C * (conv(u) + bias) = K u + C * bias: the bias (like the SSMs' D skip) is not a kernel term.
Every function builds only the entries asked for: rows [b c r l], columns [b c l n], or all [b c l l].
"""

import torch
from jaxtyping import Float, Int
from torch import Tensor


def _taps(lag: Int[Tensor, "*grid"], weight: Float[Tensor, "channels width"]) -> Float[Tensor, "channels *grid"]:
    """weight[c, w - 1 - lag] where 0 <= lag < w, else 0."""
    width = weight.shape[1]
    inside = (lag >= 0) & (lag < width)
    return weight[:, (width - 1 - lag).clamp(0, width - 1)] * inside


def conv_kernel_rows(
    C: Float[Tensor, "batch pos channels"], weight: Float[Tensor, "channels width"], rows: Int[Tensor, "row"]
) -> Float[Tensor, "batch channels row k_pos"]:
    """K[:, :, rows, :] (module docstring)."""
    lag = rows[:, None] - torch.arange(C.shape[1], device=C.device)[None]  # [r l]: j - i
    return C[:, rows].mT[..., None] * _taps(lag, weight.to(C.dtype))


def conv_kernel_cols(
    C: Float[Tensor, "batch pos channels"], weight: Float[Tensor, "channels width"], cols: Int[Tensor, "col"]
) -> Float[Tensor, "batch channels q_pos col"]:
    """K[:, :, :, cols] (module docstring)."""
    lag = torch.arange(C.shape[1], device=C.device)[:, None] - cols[None]  # [l n]: j - i
    return C.mT[..., None] * _taps(lag, weight.to(C.dtype))


def conv_kernel(C: Float[Tensor, "batch pos channels"],
                weight: Float[Tensor, "channels width"]) -> Float[Tensor, "batch channels q_pos k_pos"]:
    """The whole K (module docstring): memory batch * channels * pos^2."""
    return conv_kernel_rows(C, weight, torch.arange(C.shape[1], device=C.device))
