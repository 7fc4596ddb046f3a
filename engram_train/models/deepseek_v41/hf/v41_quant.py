"""DeepSeek-V4.1's released quantized weights: the decoders and encoders of its three formats.

The released folder stores a quantized matrix ``<name>.weight`` with E8M0 scales
``<name>.scale`` (``torch.float8_e8m0fnu``: one exponent byte ``b``, scale ``2^(b - 127)``;
``b = 255`` is NaN and refused):

* ``fp8_block``: FP8 E4M3 ``[rows, cols]``, one scale per 32 x 32 block, scales
  ``[ceil(rows / 32), ceil(cols / 32)]`` (the attention and shared-expert projections, the
  Engram ``wkv``);
* ``fp4_rows``: FP4 E2M1 packed two per int8 ``[rows, cols / 2]`` (the even column in the low
  nibble), one scale per row and 32 columns, scales ``[rows, ceil(cols / 32)]`` (routed experts);
* ``fp8_rows``: FP8 E4M3 ``[rows, cols]``, one scale per row and 32 columns (Engram tables).

A value is ``code * scale``, computed in float32 and then cast, as NeMo Automodel's
``dequantize_checkpoint_weight`` does (bit for bit the same; E2M1's negative zero, code 8,
decodes to +0 there and here). The product is exact: 4 significant bits times a power of two.

Decoding reads a slice ``[r0:r1, c0:c1]`` of the logical matrix from a tensor or a safetensors
``get_slice`` object, only the stored rows, columns (packed bytes) and scale blocks it needs,
a bounded number of rows at a time (`CHUNK_ELEMENTS` float32 temporaries), so that an import
dequantizes a rank's shard without a float32 copy of the whole matrix.

Encoding follows the release's rules: a block's scale is the smallest power of two at or above
``amax / 448`` (FP8) resp. ``amax / 6`` (FP4), ``amax`` its largest magnitude (exact float32
division; exponents below E8M0's -127 become -127); codes round to nearest, ties to even (torch's
cast for E4M3; E2M1's grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 with ties to the even code). An all-zero
block gets the scale the release's quantizer gives it (its magnitude floor: ``amax >= 1e-4``
for FP8, ``amax >= 6 * 2^-126`` for FP4): ``2^-22`` resp. ``2^-126``; its codes are zero.
Blocks with a nonzero ``amax`` below the floor keep the tighter scale, so that re-encoding a
decoded tensor is exact: ``encode(decode(x))`` gives x's values bit for bit, and x's bytes
wherever a block's largest code is above half the format's largest (448 / 2, 6 / 2); a block
with smaller codes takes a smaller scale and proportionally larger codes, same values.
Non-finite values are refused.
"""

from __future__ import annotations

import torch

from engram_train.errors import EngramError
from engram_train.models.hf_folder import HFSourceError

BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_ZERO_BLOCK_EXPONENT = -22  # 2^ceil(log2(1e-4 / 448))
FP4_ZERO_BLOCK_EXPONENT = -126  # 2^ceil(log2(6 * 2^-126 / 6))
CHUNK_ELEMENTS = 1 << 22  # float32 temporaries of one decode/encode step
QUANTIZED_FORMATS = ("fp8_block", "fp4_rows", "fp8_rows")
STORED_DTYPE = {"fp8_block": torch.float8_e4m3fn, "fp4_rows": torch.int8,
                "fp8_rows": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float8_e8m0fnu
FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# safetensors' dtype names (a get_slice object's get_dtype()) -> torch's
SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64,
}


class V41QuantError(EngramError, ValueError):
    """A tensor the V4.1 quantized layout cannot encode or decode; the message names it."""


class V41QuantSourceError(V41QuantError, HFSourceError):
    """A stored V4.1 tensor that cannot be decoded (missing or misshapen scale, unknown dtype,
    NaN scale); the message names the tensor."""


def scale_name(name: str) -> str:
    """``layers.0.attn.wq_a.weight`` -> ``layers.0.attn.wq_a.scale``."""
    return name.removesuffix(".weight") + ".scale"


def shape_of(stored) -> tuple[int, ...]:
    """Shape of a tensor or a safetensors slice object."""
    return tuple(stored.shape) if isinstance(stored, torch.Tensor) else tuple(stored.get_shape())


def dtype_of(stored):
    """torch dtype of a tensor or a safetensors slice object (safetensors' name when unknown)."""
    if isinstance(stored, torch.Tensor):
        return stored.dtype
    name = stored.get_dtype()
    return SAFETENSORS_DTYPES.get(name, name)


def row_block(fmt: str) -> int:
    """Rows one scale covers: 32 for ``fp8_block``, 1 for the row formats."""
    return BLOCK if fmt == "fp8_block" else 1


def logical_shape(fmt: str, stored: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a stored weight of shape `stored` decodes to (FP4 unpacks two per byte)."""
    rows, cols = stored
    return rows, cols * 2 if fmt == "fp4_rows" else cols


def scale_shape(fmt: str, logical: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor's shape for a logical ``[rows, cols]`` matrix."""
    rows, cols = logical
    return -(-rows // row_block(fmt)), -(-cols // BLOCK)


def check_stored(fmt: str, name: str, weight, scale) -> tuple[int, int]:
    """Refuse a stored pair the layout does not decode (one line naming the tensor); returns
    the logical ``[rows, cols]``."""
    if fmt not in QUANTIZED_FORMATS:
        raise V41QuantSourceError(f"{name}: unknown quantized format {fmt!r} "
                                  f"(one of {', '.join(QUANTIZED_FORMATS)})")
    dtype, stored = dtype_of(weight), shape_of(weight)
    if dtype != STORED_DTYPE[fmt]:
        raise V41QuantSourceError(f"{name}: stored as {dtype}; the released {fmt} layout stores "
                                  f"{STORED_DTYPE[fmt]}")
    if len(stored) != 2:
        raise V41QuantSourceError(f"{name}: {fmt} weight of shape {stored}; it must be a matrix")
    if scale is None:
        raise V41QuantSourceError(f"{name}: {fmt} weight without its scale tensor "
                                  f"{scale_name(name)}; the folder is incomplete")
    logical = logical_shape(fmt, stored)
    expected = scale_shape(fmt, logical)
    if dtype_of(scale) != SCALE_DTYPE:
        raise V41QuantSourceError(f"{scale_name(name)}: scales stored as {dtype_of(scale)}; the "
                                  f"release stores {SCALE_DTYPE}")
    if shape_of(scale) != expected:
        raise V41QuantSourceError(f"{scale_name(name)}: scales of shape {shape_of(scale)}; the "
                                  f"{fmt} weight {stored} needs {expected}")
    return logical


def _span(span, size: int, name: str, what: str) -> tuple[int, int]:
    start, stop = (0, size) if span is None else (int(span[0]), int(span[1]))
    if not 0 <= start <= stop <= size:
        raise V41QuantError(f"{name}: {what} {start}:{stop} outside the matrix's {size}")
    return start, stop


def _fp4_pairs(device) -> torch.Tensor:
    """Packed byte -> its two values [256, 2] (low nibble first) in float32; code 8, E2M1's
    negative zero, -> +0 as NeMo decodes it."""
    table = torch.tensor(FP4_LEVELS + (0.0,) + tuple(-v for v in FP4_LEVELS[1:]),
                         dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([table[byte & 15], table[byte >> 4]], dim=1)


def _codes(fmt: str, weight, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Codes of the logical block ``[rows, cols]`` (cols even for FP4) as float32, read from
    `weight` alone."""
    (a, b), (c0, c1) = rows, cols
    if fmt != "fp4_rows":
        return weight[a:b, c0:c1].float()
    raw = weight[a:b, c0 // 2: c1 // 2].contiguous().view(torch.uint8)
    return _fp4_pairs(raw.device)[raw.long()].flatten(1)


def _scales(name: str, scale, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """The float32 scales ``scale[rows, cols]``; the NaN code refused."""
    block = scale[rows[0]:rows[1], cols[0]:cols[1]]
    if (block.view(torch.uint8) == E8M0_NAN).any():
        raise V41QuantSourceError(f"{scale_name(name)}: a scale holds E8M0's NaN code 0xFF "
                                  "(the folder is damaged)")
    return block.float()


def _blocks(values: torch.Tensor, rb: int) -> torch.Tensor:
    """float32 ``[rows, cols]`` zero-padded to whole blocks, viewed ``[R, rb, C, 32]``."""
    rows, cols = values.shape
    if rows % rb or cols % BLOCK:
        values = torch.nn.functional.pad(values, (0, -cols % BLOCK, 0, -rows % rb))
    return values.view(values.shape[0] // rb, rb, values.shape[1] // BLOCK, BLOCK)


def decode(fmt: str, weight, scale, *, name: str, rows=None, cols=None,
           dtype: torch.dtype = torch.float32,
           chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Slice ``[rows[0]:rows[1], cols[0]:cols[1]]`` (default: all) of the logical matrix that
    stored `weight` and `scale` (tensors or safetensors ``get_slice`` objects) hold, in
    `dtype`; `name` (the weight's) goes into every refusal. Reads the scale blocks the slice
    touches and their stored codes, about `chunk_elements` values at a time."""
    logical = check_stored(fmt, name, weight, scale)
    r0, r1 = _span(rows, logical[0], name, "rows")
    c0, c1 = _span(cols, logical[1], name, "columns")
    out = torch.empty((r1 - r0, c1 - c0), dtype=dtype)
    if not out.numel():
        return out
    rb = row_block(fmt)
    sc0, sc1 = c0 // BLOCK, -(-c1 // BLOCK)  # the scale columns, then their stored columns
    ca, cz = sc0 * BLOCK, min(sc1 * BLOCK, logical[1])
    step = max(rb, chunk_elements // (cz - ca) // rb * rb)
    for a in range(r0 - r0 % rb, r1, step):  # whole row blocks
        sa, sb = a // rb, -(-min(r1, a + step) // rb)
        ra, rz = sa * rb, min(sb * rb, logical[0])
        values = _blocks(_codes(fmt, weight, (ra, rz), (ca, cz)), rb)
        values.mul_(_scales(name, scale, (sa, sb), (sc0, sc1))[:, None, :, None])
        lo, hi = max(r0, ra), min(r1, rz)
        values = values.flatten(2).flatten(0, 1)
        out[lo - r0: hi - r0].copy_(values[lo - ra: hi - ra, c0 - ca: c1 - ca])
    return out


def scale_codes(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """E8M0 bytes (uint8) of the blocks' scales: the smallest power of two at or above
    ``amax / 448`` (FP8) resp. ``amax / 6`` (FP4); an all-zero block the release's floor."""
    fp4 = fmt == "fp4_rows"
    mantissa, exponent = torch.frexp(amax / (FP4_MAX if fp4 else FP8_MAX))
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two
    zero = FP4_ZERO_BLOCK_EXPONENT if fp4 else FP8_ZERO_BLOCK_EXPONENT
    exponent = torch.where(amax == 0, torch.full_like(exponent, zero), exponent)
    return (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def fp4_codes(normalized: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 values in [-6, 6]: nearest grid point, ties to the
    even code; anything rounding to zero is code 0. Below 1 the grid steps by 0.5 (codes 0, 1,
    2 count the steps); from 1 up it is float32 rounded to one mantissa bit, ties to even
    (code 2 + 2 x exponent + that bit)."""
    magnitude = normalized.abs()
    bits = magnitude.view(torch.int32)
    codes = (bits >> 22).bitwise_and_(1).add_(bits).add_((1 << 21) - 1)  # round half to even
    codes.bitwise_right_shift_(22).sub_(2 * 127 - 2)  # exponent, one mantissa bit; 1.0 -> 2
    twice = magnitude.mul_(2)  # (bits is read)
    small = torch.round(twice).to(torch.int32)  # round half to even
    codes = torch.where(twice < 2, small, codes).to(torch.uint8)
    negative = (normalized < 0).logical_and_(codes > 0)
    return codes.bitwise_or_(negative.to(torch.uint8).bitwise_left_shift_(3))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[rows, cols]`` (cols even) -> int8 ``[rows, cols / 2]``, the even
    column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)


def _encode_rows(fmt: str, values: torch.Tensor, rb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored codes, uint8 scale bytes) of float32 rows `values` (a multiple of `rb` rows or
    the matrix's last rows)."""
    rows, cols = values.shape
    blocks = _blocks(values, rb)
    codes = scale_codes(blocks.abs().amax(dim=(1, 3)), fmt)
    blocks = blocks / codes.view(SCALE_DTYPE).float()[:, None, :, None]
    normalized = blocks.flatten(2).flatten(0, 1)[:rows, :cols]
    if fmt == "fp4_rows":
        return pack_fp4(fp4_codes(normalized.clamp(-FP4_MAX, FP4_MAX))), codes
    return normalized.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), codes


def encode(fmt: str, values: torch.Tensor, *, name: str,
           chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) of the floating matrix `values` in the released `fmt`, a bounded number
    of rows at a time; non-finite values and odd FP4 widths refused naming `name`."""
    if fmt not in QUANTIZED_FORMATS:
        raise V41QuantError(f"{name}: unknown quantized format {fmt!r}")
    if values.ndim != 2 or not values.is_floating_point():
        raise V41QuantError(f"{name}: {fmt} encodes a floating matrix, got {values.dtype} "
                            f"{tuple(values.shape)}")
    rows, cols = values.shape
    if fmt == "fp4_rows" and cols % 2:
        raise V41QuantError(f"{name}: FP4 packs two columns per byte; {cols} columns is odd")
    rb = row_block(fmt)
    weight = torch.empty((rows, cols // 2 if fmt == "fp4_rows" else cols),
                         dtype=STORED_DTYPE[fmt], device=values.device)
    scale = torch.empty(scale_shape(fmt, (rows, cols)), dtype=torch.uint8, device=values.device)
    step = max(1, chunk_elements // max(cols, 1))
    step = max(rb, step - step % rb)
    for a in range(0, rows, step):
        chunk = values[a: a + step].float()
        if not torch.isfinite(chunk).all():
            row, col = (~torch.isfinite(chunk)).nonzero()[0].tolist()
            raise V41QuantError(f"{name}: value [{a + row}, {col}] is {chunk[row, col].item()}; "
                                "only finite values can be quantized")
        weight[a: a + chunk.shape[0]], scale[a // rb: a // rb + -(-chunk.shape[0] // rb)] = (
            _encode_rows(fmt, chunk, rb))
    return weight, scale.view(SCALE_DTYPE)
