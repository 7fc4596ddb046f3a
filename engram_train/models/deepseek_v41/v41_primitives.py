"""DeepSeek-V4.1's small pieces: its RMSNorm, its RoPE (adjacent channel pairs, two bases,
YaRN on the compressed layers only, the inverse rotation of the attention output) and the fake
quantization of the released KV caches (FP8 window KV, FP4 compressed KV and indexer).

Tensors are sequence-first: ``[s, b, ..., channels]``; RoPE angles are per position ``[s,
pairs]`` (every sequence of a batch starts at position 0).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from engram_train.errors import InputError


class DeepseekV41RMSNorm(nn.Module):
    """RMSNorm in float32 (the weight multiplied in float32 too), rounded once to the input's
    dtype; eps ``rms_norm_eps`` (1e-20 released)."""

    def __init__(self, width: int, eps: float, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(width, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


# --- RoPE ---------------------------------------------------------------------------------------


def rope_frequencies(rope_dim: int, theta: float, yarn=None, device=None) -> torch.Tensor:
    """``[rope_dim / 2]`` float32 inverse wavelengths; with `yarn` (a ``YarnScaling``) the
    frequency-only YaRN: pairs below the fast cut-off keep their frequency, pairs above the slow
    one are divided by ``factor``, a linear ramp in between."""
    exponents = torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim
    frequencies = 1.0 / (theta ** exponents)
    if yarn is None:
        return frequencies
    length = yarn.original_max_position_embeddings

    def cut(beta: float) -> float:
        return rope_dim * math.log(length / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(cut(yarn.beta_fast)), 0)
    high = min(math.ceil(cut(yarn.beta_slow)), rope_dim - 1)
    pairs = torch.arange(rope_dim // 2, device=device, dtype=torch.float32)
    ramp = ((pairs - low) / max(high - low, 1e-3)).clamp(0, 1)
    return frequencies / yarn.factor * ramp + frequencies * (1 - ramp)


def layer_frequencies(args, compressed: bool, device=None) -> torch.Tensor:
    """The frequencies of a window layer (``rope_theta``) or a compressed one
    (``compress_rope_theta`` with ``rope_scaling``)."""
    if compressed:
        return rope_frequencies(args.qk_rope_head_dim, args.compress_rope_theta,
                                args.rope_scaling, device)
    return rope_frequencies(args.qk_rope_head_dim, args.rope_theta, None, device)


def rope_angles(positions: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """``[..., pairs]`` float32 angles of integer `positions` ``[...]`` (``[s]`` or ``[s, b]``)."""
    return positions.float().unsqueeze(-1) * frequencies


def apply_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * pairs`` channels of `x` ``[s, b, (heads,) d]`` in adjacent pairs
    (channel 2i with 2i+1, as one complex number) by `angles` ``[s, pairs]`` (or ``[s, b,
    pairs]``: a position per row, as packed documents have); `inverse` rotates
    back. Computed as a complex product in float32 (the released rounding), returned in x's
    dtype; the leading channels pass through."""
    rope_dim = 2 * angles.shape[-1]
    pairs = torch.view_as_complex(x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.polar(torch.ones_like(angles), angles)
    lead = angles.shape[:-1]  # [s] or, with per-row positions (packed documents), [s, b]
    rotation = rotation.view(*lead, *([1] * (x.ndim - 1 - len(lead))), angles.shape[-1])
    if inverse:
        rotation = rotation.conj()
    rotated = torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rotated), dim=-1)


# --- fake quantization ----------------------------------------------------------------------------

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of FP4 E2M1; a value halfway between two goes to the one with an even code."""


def power_of_two_ceiling(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x, for positive normal float32 x (an E8M0 scale)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def _round_fp4(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest E2M1 value, ties to the even code."""
    levels = x.new_tensor(FP4_LEVELS)
    midpoints = (levels[1:] + levels[:-1]) / 2
    magnitude = x.abs()
    lower = torch.bucketize(magnitude, midpoints)  # midpoints[lower - 1] < m <= midpoints[lower]
    tie = magnitude == midpoints[lower.clamp_max(len(FP4_LEVELS) - 2)]
    code = lower + (tie & (lower % 2 == 1)).to(lower.dtype)
    return torch.copysign(levels[code], x)


def _quantize_blocks(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Quantize-dequantize of `x` ``[..., c]`` (c a multiple of `block`), each run of `block`
    channels with one scale; float32 arithmetic, x's dtype out."""
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    if fmt == "fp8":  # E4M3 values, E8M0 scale
        scale = power_of_two_ceiling(amax.clamp_min(1e-4) * (1 / FP8_MAX))
        values = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    elif fmt == "mxfp4":  # E2M1 values, E8M0 scale
        scale = power_of_two_ceiling(amax.clamp_min(FP4_MAX * 2.0**-126) * (1 / FP4_MAX))
        values = _round_fp4((blocks / scale).clamp(-FP4_MAX, FP4_MAX))
    else:  # nvfp4: E2M1 values, E4M3 scale
        scale = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
        values = _round_fp4((blocks / scale).clamp(-FP4_MAX, FP4_MAX))
    return (values * scale).flatten(-2).to(x.dtype)


class _FakeQuantize(torch.autograd.Function):
    """Quantize-dequantize in the forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, fmt, block):
        return _quantize_blocks(x, fmt, block)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize(x: torch.Tensor, fmt: Literal["fp8", "mxfp4", "nvfp4"], block: int,
                  enabled: bool = True) -> torch.Tensor:
    """The released caches' rounding with a straight-through gradient: ``fp8`` (window KV,
    blocks of 32), ``mxfp4`` (indexer queries and keys, 32), ``nvfp4`` (compressed KV, 16)."""
    if fmt not in ("fp8", "mxfp4", "nvfp4"):
        raise InputError(f"fake_quantize format {fmt!r}: one of 'fp8', 'mxfp4', 'nvfp4'.")
    if block < 1 or x.shape[-1] % block:
        raise InputError(f"fake_quantize: {x.shape[-1]} channels are not a multiple of the "
                         f"block of {block}.")
    if not enabled:  # the model's fake_quantize=false
        return x
    return _FakeQuantize.apply(x, fmt, int(block))
