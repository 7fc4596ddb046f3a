"""Stochastic rounding to bfloat16 with bits from a counter-based hash.

Why. A bf16 table without a float32 master loses every update smaller than half a bf16 step
under round-to-nearest (an Adam step of lr ~1e-3 on a value ~0.02 is often that small).
Rounding up with probability equal to the discarded fraction keeps the expected value exact,
so the table follows its float32 trajectory on average (as FBGEMM's 16-bit weights do).

Why a hash. The random bits of element (row, column) at step t are a pure function of
(engram_seed, layer, step, global row, column, stream): no generator state, so any split of
the rows over ranks, threads or placements, and any resume, rounds every element the same way
and the tables stay bit-identical across layouts.

The hash is a 32-bit integer mixer (two multiply-xorshift rounds) evaluated in int64 lanes
masked to 32 bits; the low 16 bits are added to the float32 bit pattern and the low half is
cut, which rounds the magnitude up with probability (discarded bits) / 2^16.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
# independent bit streams: table values, first moments, row second moments (fp8 tables)
STREAM_VALUE, STREAM_MOMENT, STREAM_ROW_MOMENT = 0, 1, 2


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 lanes holding values < 2^32 (products wrap in int64;
    their low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def rounding_bits(seed: int, layer: int, step: int, stream: int, rows: torch.Tensor,
                  num_cols: int) -> torch.Tensor:
    """int32 [len(rows), num_cols] in [0, 2^16): the bits of (seed, layer, step, stream,
    global row, column)."""
    key = _splitmix64(int(seed) & _M64)
    for part in (layer, step, stream):
        key = _splitmix64(key ^ (int(part) & _M64))
    lo, hi = key & _M32, (key >> 32) & _M32
    rows = rows.to(torch.int64)
    row_key = _mix32((rows & _M32) ^ _mix32((rows >> 32) ^ lo))
    cols = torch.arange(num_cols, dtype=torch.int64, device=rows.device)
    col_key = _mix32(cols ^ hi)
    bits = _mix32((row_key.unsqueeze(1) + col_key.unsqueeze(0)) & _M32)
    return (bits & 0xFFFF).to(torch.int32)


def stochastic_round_bf16(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 ``values`` -> bfloat16, rounded up in magnitude with probability (low 16 bits
    of the float32 pattern) / 2^16, decided by ``bits`` (int32 in [0, 2^16), same shape)."""
    pattern = values.contiguous().view(torch.int32)
    truncated = (pattern + bits).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    return truncated.view(torch.float32).to(torch.bfloat16)  # exact: low half is zero


def round_rows_bf16(values: torch.Tensor, *, seed: int, layer: int, step: int, stream: int,
                    global_rows: torch.Tensor) -> torch.Tensor:
    """Stochastically rounded bf16 copy of float32 rows [u, D] whose global row ids are
    ``global_rows`` [u]."""
    bits = rounding_bits(seed, layer, step, stream, global_rows.to(values.device), values.shape[1])
    return stochastic_round_bf16(values, bits)
