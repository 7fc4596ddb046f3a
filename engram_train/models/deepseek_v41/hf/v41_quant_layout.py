"""Which DeepSeek-V4.1 tensor the released folder stores in which format, and the two seams
export and import call: `quantize_for_release` and `dequantize_from_release`.

Names are the released ones (NeMo Automodel's ``DeepseekV41StateDictAdapter.to_hf``: routed
experts split per expert, ``[out, in]``). The quantized set is NeMo's: ``fp8_block`` for
``attn.{wq_a,wq_b,wkv,wo_a,wo_b}``, ``attn.indexer.wq_b``, ``ffn.shared_experts.w{1,2,3}`` and
``engram.wkv`` (and the DSpark draft's ``mtp.<i>.attn.*``, ``main_proj`` and shared experts),
``fp4_rows`` for ``ffn.experts.<j>.w{1,2,3}``, ``fp8_rows`` for the Engram tables
``engram.embed``. float32: the mHC mappings (``hc_{attn,ffn}_{fn,base,scale}``), the attention
sinks, the router's biases (``ffn.gate.bias``, ``bias_vl``) and, as NeMo's model holds and its
export keeps them, the compressors' ``wkv``/``wgate``, the output head and the draft's
confidence head; everything else bf16. A ``.scale`` next to a quantized weight is ``e8m0``.

An import reads either layout: a quantized name stored as FP8/int8 is decoded with its scale, a
floating one (the unquantized export) is read as it is.
"""

from __future__ import annotations

import re

import torch

from engram_train.models.deepseek_v41.hf.v41_quant import (
    E8M0_BIAS,
    FP8_ZERO_BLOCK_EXPONENT,
    QUANTIZED_FORMATS,
    SCALE_DTYPE,
    STORED_DTYPE,
    V41QuantError,
    V41QuantSourceError,
    decode,
    dtype_of,
    encode,
    logical_shape,
    scale_name,
    scale_shape,
    shape_of,
)

FORMATS = QUANTIZED_FORMATS + ("float32", "bf16", "e8m0")
# config.json's declaration of the layout (NeMo loads a folder through its dequantizing path
# when ``quantization_config.quant_method`` is set)
RELEASE_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                               "weight_block_size": [32, 32], "activation_scheme": "dynamic"}
_FP8_BLOCK = re.compile(
    r"(?:layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.shared_experts\.w[123]|engram\.wkv)"
    r"|mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|main_proj|ffn\.shared_experts\.w[123]))"
    r"\.weight")
_FP4_ROWS = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_FP8_ROWS = re.compile(r"layers\.\d+\.engram\.embed\.weight")
_FLOAT32 = re.compile(
    r"head\.weight|(?:layers|mtp)\.\d+\.(?:hc_(?:attn|ffn)_(?:fn|base|scale)|attn\.attn_sink"
    r"|ffn\.gate\.(?:bias|bias_vl)|attn\.(?:indexer\.)?compressor\.(?:wkv|wgate)\.weight"
    r"|confidence_head\.proj\.weight)")
_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def stored_format(name: str) -> str:
    """The released format of tensor `name`: ``fp8_block``, ``fp4_rows``, ``fp8_rows``
    (quantized, with ``<name>.scale``), ``float32``, ``bf16``, or ``e8m0`` for the scale of a
    quantized weight."""
    if name.endswith(".scale"):
        weight = name.removesuffix(".scale") + ".weight"
        if stored_format(weight) in QUANTIZED_FORMATS:
            return "e8m0"
    for fmt, pattern in (("fp8_block", _FP8_BLOCK), ("fp4_rows", _FP4_ROWS),
                         ("fp8_rows", _FP8_ROWS), ("float32", _FLOAT32)):
        if pattern.fullmatch(name):
            return fmt
    return "bf16"


def quantize_for_release(name: str, tensor: torch.Tensor, *,
                         quantized: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The released folder's tensors for model tensor `name` (released name, floating values):
    ``[(name, codes), (name.scale, scales)]`` for a quantized format (`quantized`; otherwise
    bf16), ``[(name, float32 or bf16 copy)]`` for the rest."""
    if not tensor.is_floating_point():
        raise V41QuantError(f"{name}: the export takes floating tensors, got {tensor.dtype}")
    fmt = stored_format(name)
    if fmt == "e8m0":
        raise V41QuantError(f"{name}: a scale is written with its weight, not on its own")
    if fmt in QUANTIZED_FORMATS and quantized:
        if tensor.is_meta:  # the folder's layout planned from shapes
            if tensor.ndim != 2 or (fmt == "fp4_rows" and tensor.shape[1] % 2):
                raise V41QuantError(f"{name}: {fmt} stores an (even-width) matrix, not "
                                    f"{tuple(tensor.shape)}")
            rows, cols = tensor.shape
            return [(name, torch.empty((rows, cols // 2 if fmt == "fp4_rows" else cols),
                                       dtype=STORED_DTYPE[fmt], device="meta")),
                    (scale_name(name), torch.empty(scale_shape(fmt, (rows, cols)),
                                                   dtype=SCALE_DTYPE, device="meta"))]
        weight, scale = encode(fmt, tensor, name=name)
        return [(name, weight), (scale_name(name), scale)]
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    return [(name, tensor.detach().to(dtype=dtype, copy=True))]


def release_shape(name: str, stored) -> tuple[int, ...]:
    """The logical shape of stored tensor `stored` (a tensor or safetensors slice): a packed
    FP4 expert has twice its stored columns."""
    shape = shape_of(stored)
    if dtype_of(stored) == torch.int8 and stored_format(name) == "fp4_rows" and len(shape) == 2:
        return logical_shape("fp4_rows", shape)
    return shape


def quantized_format(name: str, dtype) -> str:
    """The quantized format of `name` stored as `dtype` (FP8 or int8); a mismatch refused."""
    fmt = stored_format(name)
    if fmt not in QUANTIZED_FORMATS:
        raise V41QuantSourceError(f"{name}: stored as {dtype}, but the release stores this "
                                  f"tensor as {fmt} (unquantized)")
    if STORED_DTYPE[fmt] != dtype:
        raise V41QuantSourceError(f"{name}: stored as {dtype}; the released {fmt} layout "
                                  f"stores {STORED_DTYPE[fmt]}")
    return fmt


def refuse_unfloating(name: str, dtype, has_scale: bool) -> None:
    """Refuse an unquantized tensor stored in a dtype no V4.1 tensor uses, or with a scale."""
    if dtype not in _FLOATING:
        raise V41QuantSourceError(f"{name}: stored as {dtype}, which no V4.1 tensor uses "
                                  "(FP8 E4M3, packed int8 FP4, bf16 or float32)")
    if has_scale:
        raise V41QuantSourceError(f"{scale_name(name)}: a scale next to the unquantized "
                                  f"{dtype} weight {name}")


def dequantize_from_release(name: str, weight, scale=None, *, rows=None, cols=None,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Slice ``[rows, cols]`` (``(start, stop)`` pairs, default whole; matrices only when
    given) of released tensor `name` in `dtype`: a quantized one decoded with its `scale`
    (tensors or safetensors slice objects), a floating one read as stored."""
    stored = dtype_of(weight)
    if stored in (torch.float8_e4m3fn, torch.int8):
        fmt = quantized_format(name, stored)
        return decode(fmt, weight, scale, name=name, rows=rows, cols=cols, dtype=dtype)
    refuse_unfloating(name, stored, scale is not None)
    if rows is None and cols is None:
        value = weight[...] if isinstance(weight, torch.Tensor) else weight[:]
    else:
        shape = shape_of(weight)
        if len(shape) != 2:
            raise V41QuantError(f"{name}: a row/column slice of a {len(shape)}-D tensor")
        (r0, r1), (c0, c1) = rows or (0, shape[0]), cols or (0, shape[1])
        value = weight[r0:r1, c0:c1]
    return value.to(dtype=dtype, copy=True)


def release_table_scales(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The released ``.scale`` of the rows of an fp8 Engram table as the trainer keeps them
    (``engram/fp8_table.py``: float8 codes ``[n, D]``, uint8 E8M0 bytes ``[n, blocks]``): the
    same bytes (both pick the smallest power of two at or above amax / 448 per row and 32
    columns, clamped to E8M0's range), except that a block whose codes are all zero gets the
    release's zero-block scale 2^-22 (the trainer's is 2^-127; the values, zero, are the same)."""
    from engram_train.engram.fp8_table import _blocks

    zero = (_blocks(codes.float()) == 0).all(dim=-1)
    stored = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    floor = torch.full_like(stored, FP8_ZERO_BLOCK_EXPONENT + E8M0_BIAS)
    return torch.where(zero, floor, stored).view(SCALE_DTYPE)


def release_weight_names(names) -> list[str]:
    """The folder's tensor names less the scales, each scale checked to have its quantized
    weight (a scale with none is refused naming it)."""
    present = set(names)
    kept = []
    for name in names:
        if stored_format(name) != "e8m0":
            kept.append(name)
        elif name.removesuffix(".scale") + ".weight" not in present:
            raise V41QuantSourceError(f"{name}: a scale without its weight "
                                      f"{name.removesuffix('.scale')}.weight")
    return kept
