"""Engram tables stored as DeepSeek-V4.1's release stores them (``engram_table_dtype: fp8_e4m3``).

A table row is split in blocks of ``SCALE_BLOCK`` (32) columns (a row narrower than 32 is one
block). Each block keeps its values as FP8 E4M3 (``torch.float8_e4m3fn``, largest finite value
448) and one E8M0 scale: a uint8 exponent byte ``b``, scale ``2^(b - 127)``, the smallest power
of two at or above ``amax / 448`` (``amax`` the block's largest magnitude; an all-zero block
gets ``b = 0``). A value is ``fp8 * scale``: 1 byte plus 1/32 of a byte per parameter (1/D for a
row of D < 32 values).

The values are rounded to the E4M3 grid either to nearest even (``quantize_rows`` without
``bits``: the init, a conversion) or stochastically (``bits``, int32 in [0, 2^16) per element,
the counter-based bits the table optimizer also uses for bf16 tables,
``training/stochastic_rounding.py``): the magnitude is rounded up with probability (the part
below the grid step) / (the step), to 2^-16, so the expected stored value is the value.

The table itself is the ``weight`` parameter (float8) and its scales a uint8 tensor
[rows, blocks] hung on it as ``weight.engram_scale`` (also the table module's ``weight_scale``
buffer, saved next to the rows). Lookups dequantize the rows they gather (``dequantize_rows``,
exact in bfloat16: 4 significant bits times a power of two).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_ATTR = "engram_scale"
SCALE_BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
_E4M3_MIN_EXP = -6  # smallest normal exponent; below it the grid step is 2^-9
_MANTISSA_BITS = 3


def is_fp8_table(weight: torch.Tensor) -> bool:
    return weight.dtype == FP8_DTYPE


def scale_blocks(dim: int) -> int:
    """Scale bytes per row of ``dim`` values: one per started block of 32 columns."""
    return -(-int(dim) // SCALE_BLOCK)


def table_scale(weight: torch.Tensor) -> torch.Tensor:
    """The uint8 E8M0 scales [rows, blocks] of an fp8 table parameter."""
    scale = getattr(weight, SCALE_ATTR, None)
    if scale is None:
        raise RuntimeError("an fp8 Engram table without its E8M0 scales (weight.engram_scale)")
    return scale


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """[n, D] -> [n, blocks, width] (D padded with zeros to a whole number of blocks)."""
    n, dim = values.shape
    blocks = scale_blocks(dim)
    width = min(dim, SCALE_BLOCK)
    pad = blocks * width - dim
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    return values.reshape(n, blocks, width)


def _block_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """int32 [n, blocks] of float32 blocks [n, blocks, width]: the smallest e with
    amax <= 448 x 2^e (exact: amax = m 2^E with m in [0.5, 1), and 448 = 0.875 x 2^9), clamped
    to E8M0's [-127, 127]; -127 for an all-zero block."""
    amax = blocks.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp_(-E8M0_BIAS, E8M0_BIAS)


def e8m0_exponents(values: torch.Tensor) -> torch.Tensor:
    """int32 [n, blocks]: per block of rows [n, D], the exponent of its E8M0 scale."""
    return _block_exponents(_blocks(values.detach().float()))


def _stochastic_e4m3(q: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 ``q`` (|q| <= 448) rounded to the E4M3 grid, the magnitude up with probability
    (fraction below the grid step) to 2^-16, decided by ``bits``: up iff
    fraction x 2^16 >= 2^16 - bits, which is floor(units + bits / 2^16) computed exactly in
    float32 (``units`` is the magnitude in grid steps, < 16; every quantity here is exact)."""
    magnitude = q.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
    step_exp = (exponent - 1).clamp_(min=_E4M3_MIN_EXP) - _MANTISSA_BITS
    step = torch.ldexp(torch.ones_like(magnitude), step_exp.to(magnitude.dtype))
    units = magnitude / step  # exact: a power-of-two division
    whole = torch.floor(units)
    up = (units - whole).mul_(65536.0) >= (65536 - bits).to(magnitude.dtype)
    rounded = (whole + up.to(magnitude.dtype)).mul_(step)
    return torch.copysign(rounded, q).clamp_(-E4M3_MAX, E4M3_MAX)


def quantize_rows(values: torch.Tensor, bits: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [n, D] -> (float8_e4m3fn [n, D], uint8 E8M0 scales [n, blocks]); rounded to
    nearest even without ``bits``, stochastically with them (int32 [n, D] in [0, 2^16))."""
    if values.dim() != 2:
        raise ValueError(f"expected rows [n, D], got shape {tuple(values.shape)}")
    n, dim = values.shape
    blocks = _blocks(values.detach().float())
    e = _block_exponents(blocks)
    scaled = torch.ldexp(blocks, (-e).unsqueeze(-1).to(blocks.dtype))  # exact
    if bits is not None:
        scaled = _stochastic_e4m3(scaled, _blocks(bits))
    scaled = scaled.reshape(n, -1)[:, :dim]
    q = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)  # RNE; exact on the grid
    return q, (e + E8M0_BIAS).to(torch.uint8)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(float8 [n, D], uint8 E8M0 [n, blocks]) -> values [n, D] in ``dtype`` (exact in bfloat16
    and float32 for the exponents a table holds)."""
    n, dim = q.shape
    blocks = _blocks(q.to(torch.float32))
    exponent = (scale.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).to(torch.float32)
    return torch.ldexp(blocks, exponent).reshape(n, -1)[:, :dim].to(dtype)


@torch.no_grad()
def store_rows(weight: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
               bits: torch.Tensor | None = None) -> None:
    """Quantize float rows ``values`` [n, D] into shard-local ``rows`` of an fp8 table and its
    scales (``bits``: stochastic rounding, as ``quantize_rows``)."""
    q, scale = quantize_rows(values, bits)
    data = weight.data.view(torch.uint8)  # index_copy_ has no float8 kernel on every device
    data.index_copy_(0, rows, q.view(torch.uint8).to(data.device))
    table_scale(weight).index_copy_(0, rows, scale.to(data.device))


def read_fp8_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dequantized rows [n, D] (bfloat16) of a device-resident fp8 table."""
    q = weight.detach().view(torch.uint8).index_select(0, rows)
    scale = table_scale(weight).index_select(0, rows)
    return dequantize_rows(q.view(FP8_DTYPE), scale)
