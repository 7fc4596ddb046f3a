"""Engram tables (and their optimizer state) in checkpoints as several row-block pieces of one
key, so that a resume reads one block at a time.

torch's ``FileSystemReader`` loads each saved piece whole (``torch.load``) before copying it
into the live tensor; a table saved as one piece per rank needs a second copy of the largest
table shard at resume. Saved as pieces of about `PIECE_BYTES` each, a resume holds one piece
beyond the steady state.

The pieces are megatron ``ShardedTensor`` s of the same key placed by global row offset (an
irregular grid, resolved by torch's checkpoint planner), so:

- a checkpoint saved as one piece per rank (before this layout, or with a large
  ``ENGRAM_TABLE_PIECE_BYTES``) loads into pieces and the other way round: the planner reads the
  overlap of every saved and requested block;
- resharding over the Engram embedding-parallel size is unchanged (the pieces tile each rank's
  global rows);
- optimizer state follows: megatron's ``make_sharded_optimizer_tensor`` builds the moments'
  pieces with the table's factory from the moment tensors.

The pieces alias the live tensor (host tensors through a storage of the piece's own size, so
the writer copies none of them); a load writes into them, and the merge hands back the live
tensor (no copy).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from functools import partial

import torch

_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Live tensors by the address of their first row, as the pieces were built from them."""

PIECE_BYTES = 64 * 2**20
"""Bytes of one saved piece (the last of a shard is smaller); ``ENGRAM_TABLE_PIECE_BYTES``
overrides it (tests write many small pieces)."""


def piece_bytes() -> int:
    return int(os.environ.get("ENGRAM_TABLE_PIECE_BYTES", PIECE_BYTES))


def row_pieces_factory(key: str, tensor: torch.Tensor, global_rows: int, row_start: int,
                       replica_id):
    """A ``ShardedTensorFactory`` for ``tensor`` (rows ``[row_start, row_start + len)`` of a
    ``global_rows``-row tensor) that saves and loads it as row-block pieces."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    build = partial(_build, global_rows=global_rows, row_start=row_start, block=piece_bytes())
    return ShardedTensorFactory(key, tensor, build, _merge, replica_id)


def as_column(factory, key: str, vector: torch.Tensor):
    """``factory`` (a table's) for a per-row vector [rows] of the table's optimizer, saved as
    [rows, 1] like the table's rows (the live vector is what a load hands back)."""
    from dataclasses import replace

    build = partial(factory.build_fn.func, **{**factory.build_fn.keywords, "column": True})
    return replace(factory, key=key, data=vector, build_fn=build)


def _build(key, data, replica_id, flattened_range, *, global_rows: int, row_start: int,
           block: int, column: bool = False) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if flattened_range is not None:
        raise NotImplementedError(f"{key}: flattened ranges of Engram tables are not used")
    whole, data = data, data.detach()
    if column:  # a per-row vector, saved as [rows, 1]
        data = data.view(-1, 1)
    rows = data.shape[0]
    row_bytes = max(1, data[0].numel() * data.element_size()) if rows else 1
    step = max(1, block // row_bytes)
    pieces = []
    for start in range(0, max(rows, 1), step):
        piece = _own_storage(data[start:start + step])
        offset = (row_start + start,) + (0,) * (data.dim() - 1)
        pieces.append(ShardedTensor(key, piece, piece.dtype, tuple(piece.shape),
                                    (global_rows, *data.shape[1:]), offset,
                                    axis_fragmentations=None, replica_id=replica_id))
    if data.numel():  # for _merge (a load hands back other tensor objects on the same memory)
        _LIVE[data.data_ptr()] = whole
    return pieces


def _own_storage(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (a row block of a host tensor) as a tensor on the same memory whose storage is
    exactly the block: megatron's writer clones every view of a larger storage before writing
    (all of them at once: a second copy of every table at save); device tensors are copied to
    the host by the writer anyway."""
    if piece.device.type != "cpu" or piece.numel() == 0 or (
            piece.untyped_storage().nbytes() == piece.nbytes):
        return piece
    buffer = (ctypes.c_char * piece.nbytes).from_address(piece.data_ptr())
    alias = torch.frombuffer(buffer, dtype=torch.uint8).view(piece.dtype).view(piece.shape)
    alias._engram_base = piece  # keeps the live memory alive while the alias is
    return alias


def _merge(pieces: list) -> torch.Tensor:
    """The loaded pieces as one tensor: the live tensor they tile when the load wrote into
    them (a resume), else concatenated."""
    whole = _LIVE.get(pieces[0].data_ptr())
    if whole is not None and whole.is_contiguous() and whole.numel() == sum(
            p.numel() for p in pieces):
        expected = whole.data_ptr()
        row_bytes = pieces[0][0].numel() * whole.element_size() if pieces[0].numel() else 0
        for piece in pieces:
            if piece.data_ptr() != expected or piece.dtype != whole.dtype:
                break
            expected += piece.shape[0] * row_bytes
        else:
            return whole
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
