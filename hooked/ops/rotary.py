"""Rotary position embeddings (RoPE) as pure functions, in Hugging Face's rotate_half convention.

Glossary
    d_rot      rotated width of one head (= d_head for Llama); `half` = d_rot // 2 frequencies
    theta      the RoPE base (`rope_theta`), 10000 in the original paper
    inv_freq   [half] angular frequency of each pair of dimensions, theta^(-2i / d_rot)
    scaling    HF `rope_parameters` beyond theta: {"rope_type": "default" | "linear" | "llama3" | "yarn", ...}
    attention_factor  what multiplies cos and sin (YaRN's mscale, 0.1 ln(factor) + 1; 1 for the others)
    cos, sin   [batch pos d_rot] the rotation of each position, each frequency written twice
               ([f_0 .. f_{half-1}, f_0 .. f_{half-1}]), as HF's `emb = cat(freqs, freqs)`
    rotate_half  (x1, x2) -> (-x2, x1) on the two halves of the last axis: dimension i is paired with
               i + half (not with its neighbour, as in the RoFormer paper); HF Llama checkpoints
               are stored for this pairing

    apply_rotary(x) = x * cos + rotate_half(x) * sin

Numerics follow HF: frequencies and angles are computed in float32 (float64 for float64 models),
then cos/sin are cast to the activations' dtype before rotating. Nothing here is a module or a
buffer: models built on the meta device get their tables on first use, from `Rotary(...)`'s fields.
A small cache keeps one cos/sin table per (spec, length, device, dtype).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(d_rot: int, theta: float, scaling: Mapping[str, Any] | None = None,
                  dtype: torch.dtype = torch.float32) -> Float[Tensor, "half"]:
    """The inverse frequencies of HF's rope variants "default", "linear", "llama3" and "yarn" (on the CPU).

    "linear" divides every frequency by `factor`. "llama3" (Llama 3.1) leaves high frequencies
    (wavelength < original_max_position_embeddings / high_freq_factor) alone, divides low ones
    (wavelength > original / low_freq_factor) by `factor`, and interpolates in between. "yarn"
    (GPT-OSS) blends the plain and the divided frequencies along a linear ramp between the dimensions
    that turn beta_fast and beta_slow times over original_max_position_embeddings.
    """
    if d_rot % 2:
        raise ValueError(f"rotary width must be even, got {d_rot}")
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponent = torch.arange(0, d_rot, 2, dtype=torch.int64).to(dtype) / d_rot
    inv_freq = 1.0 / (theta ** exponent)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, d_rot, theta, scaling)
    return inv_freq


def _yarn_scale(inv_freq: Float[Tensor, "half"], d_rot: int, theta: float,
                scaling: Mapping[str, Any]) -> Float[Tensor, "half"]:
    """YaRN's frequencies as HF's _compute_yarn_parameters (factor given; truncate default True)."""
    if scaling.get("original_max_position_embeddings") is None or scaling.get("factor") is None:
        raise ValueError(f"yarn rope needs factor and original_max_position_embeddings, got {dict(scaling)}")
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)  # JSON may say 32

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_context
        return d_rot * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_rot - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d_rot // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.dtype)
    keep = 1 - ramp  # 1: the plain frequency (extrapolation), 0: divided by factor (interpolation)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What multiplies cos and sin: YaRN's attention_factor (given, or from factor / mscale as HF
    derives it); 1.0 for the other rope types."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def _llama3_scale(inv_freq: Float[Tensor, "half"], scaling: Mapping[str, Any]) -> Float[Tensor, "half"]:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: Float[Tensor, "*batch d_rot"]) -> Float[Tensor, "*batch d_rot"]:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids: Int[Tensor, "batch pos"], inv_freq: Float[Tensor, "half"],
                 dtype: torch.dtype, attention_factor: float = 1.0
                 ) -> tuple[Float[Tensor, "batch pos d_rot"], Float[Tensor, "batch pos d_rot"]]:
    """cos and sin of every position's angles (angle = position * inv_freq), each frequency twice,
    times attention_factor (YaRN's; before the cast, as HF)."""
    freqs = position_ids[..., None].to(inv_freq.dtype) * inv_freq.to(position_ids.device)  # [batch pos half]
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor != 1.0:
        return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Float[Tensor, "batch pos heads d_head"], cos: Float[Tensor, "batch pos d_rot"],
                 sin: Float[Tensor, "batch pos d_rot"]) -> Float[Tensor, "batch pos heads d_head"]:
    """Rotate queries or keys: x * cos + rotate_half(x) * sin, the same rotation for every head.

    Partial rotary (d_rot < d_head, HF's partial_rotary_factor, e.g. Bamba's 0.5): the first d_rot
    features of each head rotate, the rest pass unchanged, as HF's apply_rotary_pos_emb does.
    """
    d_rot = cos.shape[-1]
    if d_rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :d_rot], cos, sin), x[..., d_rot:]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class Rotary:
    """What a rotary attention layer needs: d_rot, theta and the HF scaling dict (hashable copy).

    Calling it returns the (cos, sin) of `position_ids`, looked up in a cached table of positions
    0..pos-1 (position ids count real tokens, so they never exceed the sequence length, except
    while decoding with a state, where the table grows to the next power of two).
    """

    d_rot: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] = field(default=())

    @staticmethod
    def of(d_rot: int, theta: float, scaling: Mapping[str, Any] | None) -> "Rotary":
        items = tuple(sorted((k, v) for k, v in (scaling or {}).items() if k != "rope_theta"))
        rope = Rotary(d_rot, float(theta), items)
        rope_inv_freq(d_rot, theta, dict(items))  # fail at build time on an unsupported rope type
        return rope

    def __call__(self, position_ids: Int[Tensor, "batch pos"], dtype: torch.dtype,
                 max_position: int | None = None) -> tuple[Float[Tensor, "batch pos d_rot"],
                                                           Float[Tensor, "batch pos d_rot"]]:
        """(cos, sin) of position_ids. max_position: a bound on them the caller knows on the host (while
        decoding, the state's length + pos - 1), so the table is sized without reading the device;
        None: read their max (one host read, a wait for the GPU, per call)."""
        length = position_ids.shape[1]
        if max_position is None and position_ids.numel():
            max_position = int(position_ids.max())
        if max_position is not None and max_position >= length:  # decoding: positions past the input
            length = 1 << max_position.bit_length()  # a power of two: few tables while generating
        cos, sin = _table(self, length, position_ids.device, dtype)
        return cos[position_ids], sin[position_ids]


@functools.lru_cache(maxsize=16)
def _table(rope: Rotary, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [length d_rot] of positions 0..length-1; float32 angles (float64 for float64 models)."""
    compute = torch.promote_types(dtype, torch.float32)
    inv_freq = rope_inv_freq(rope.d_rot, rope.theta, dict(rope.scaling), dtype=compute).to(device)
    positions = torch.arange(length, device=device)[None]
    cos, sin = rope_cos_sin(positions, inv_freq, dtype, rope_attention_factor(dict(rope.scaling)))
    return cos[0], sin[0]
