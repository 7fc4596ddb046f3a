"""A DeepSeek-V4.1 folder read for import, quantized (the release's layout) or not.

`V41Folder` is `models/hf_folder.HFFolder` with V4.1's storage: its names are the folder's
less the ``.scale`` tensors (a scale without its weight refused), a packed FP4 expert has its
logical shape (twice the stored columns), and `read_block` dequantizes only the stored blocks
a rank's slice needs (``v41_quant_layout.dequantize_from_release`` on safetensors
``get_slice`` objects: the FP8/FP4 codes and E8M0 scale blocks of the slice, decoded a bounded
number of rows at a time; floating tensors are read as stored). `check` reads every header once before the
model is built: a quantized weight without its scale, a scale of the wrong shape or dtype and a
dtype no V4.1 tensor uses are refused in one line naming the tensor; a weight whose E8M0 scales
are all byte 0 (2^-127: the whole weight decodes to about 0) is named in `warnings`.
"""

from __future__ import annotations

import torch

from engram_train.models.hf_folder import HFFolder
from engram_train.models.deepseek_v41.hf.v41_quant import (
    E8M0_NAN,
    V41QuantSourceError,
    check_stored,
    dtype_of,
    scale_name,
)
from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
    dequantize_from_release,
    quantized_format,
    release_shape,
    release_weight_names,
    refuse_unfloating,
)


class V41Folder(HFFolder):
    """The tensors of a V4.1 folder (module docstring), in float32, read one block at a time."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self._names = release_weight_names(list(self.files))
        self.warnings: list[str] = []

    def names(self) -> list[str]:
        return list(self._names)

    def _slice(self, name: str):
        return self._handle(self.files[name]).get_slice(name)

    def _scale(self, name: str):
        scale = scale_name(name)
        return self._slice(scale) if scale in self.files else None

    def check(self, skip=()) -> int:
        """Refuse a tensor the import cannot decode (module docstring), headers only; returns
        how many are quantized."""
        quantized = 0
        for name in self._names:
            if name in skip:
                continue
            weight = self._slice(name)
            dtype = dtype_of(weight)
            if dtype in (torch.float8_e4m3fn, torch.int8):
                check_stored(quantized_format(name, dtype), name, weight, self._scale(name))
                quantized += 1
                if self._scales_all_zero(name):
                    self.warnings.append(
                        f"{name}: every E8M0 scale in {scale_name(name)} is byte 0 (2^-127), so "
                        "the whole weight decodes to about 0; the folder's scales look damaged "
                        "(restore them from the model's source)")
            else:
                refuse_unfloating(name, dtype, self._scale(name) is not None)
        return quantized

    def _scales_all_zero(self, name: str) -> bool:
        """Whether every E8M0 byte of `name`'s scale is 0, read a bounded block of rows at a
        time and stopped at the first other byte (at once for a healthy weight)."""
        scale = self._scale(name)
        shape = scale.get_shape()
        if not shape:
            return int(scale[:].view(torch.uint8)) == 0
        width = 1
        for n in shape[1:]:
            width *= int(n)
        step = max(1, (1 << 22) // max(1, width))
        for lo in range(0, int(shape[0]), step):
            if bool((scale[lo:lo + step].view(torch.uint8) != 0).any()):
                return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return release_shape(name, self._slice(name))

    def read_block(self, name: str, start, size) -> torch.Tensor:
        """``tensor[start : start + size]`` of the logical tensor in float32; quantized blocks
        decoded from their codes and scales alone."""
        weight = self._slice(name)
        if len(start) == 2:
            (r0, c0), (rows, cols) = start, size
            return dequantize_from_release(name, weight, self._scale(name),
                                           rows=(r0, r0 + rows), cols=(c0, c0 + cols))
        refuse_unfloating(name, dtype_of(weight), self._scale(name) is not None)
        box = tuple(slice(int(a), int(a) + int(n)) for a, n in zip(start, size))
        return (weight[box] if box else weight[:]).float()

    def read_table_rows(self, name: str, start: int, rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, start + rows)`` of Engram table `name` as an fp8 table keeps them
        (``engram/fp8_table.py``: float8 codes, uint8 E8M0 bytes per row and 32 columns): the
        stored codes and scales of the released layout as they are, a floating table
        quantized (round to nearest even)."""
        from engram_train.engram.fp8_table import quantize_rows

        weight, scale = self._slice(name), self._scale(name)
        if dtype_of(weight) != torch.float8_e4m3fn:
            return quantize_rows(self.read_block(name, (start, 0), (rows, self.shape(name)[1])))
        check_stored(quantized_format(name, dtype_of(weight)), name, weight, scale)
        codes = weight[start:start + rows]
        stored = scale[start:start + rows]
        if (stored.view(torch.uint8) == E8M0_NAN).any():
            raise V41QuantSourceError(f"{scale_name(name)}: a scale holds E8M0's NaN code 0xFF "
                                      "(the folder is damaged)")
        return codes, stored.view(torch.uint8)

    def read(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.read_block(name, (0,) * len(shape), shape)
