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

The pieces are views of the live tensor; a load writes into them, and the merge hands back a
tensor on the live memory (no copy).
"""

from __future__ import annotations

import os
from functools import partial

import torch

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


def _build(key, data, replica_id, flattened_range, *, global_rows: int, row_start: int,
           block: int) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if flattened_range is not None:
        raise NotImplementedError(f"{key}: flattened ranges of Engram tables are not used")
    data = data.detach()
    rows = data.shape[0]
    row_bytes = max(1, data[0].numel() * data.element_size()) if rows else 1
    step = max(1, block // row_bytes)
    pieces = []
    for start in range(0, max(rows, 1), step):
        piece = data[start:start + step]
        offset = (row_start + start,) + (0,) * (data.dim() - 1)
        pieces.append(ShardedTensor(key, piece, piece.dtype, tuple(piece.shape),
                                    (global_rows, *data.shape[1:]), offset,
                                    axis_fragmentations=None, replica_id=replica_id))
    return pieces


def _merge(pieces: list) -> torch.Tensor:
    """The loaded pieces as one tensor: on their common memory when they are consecutive
    views of it (a load into the live tensor), else concatenated."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    storage = first.untyped_storage().data_ptr()
    row_bytes = first.stride(0) * first.element_size()
    expected = first.data_ptr()
    for piece in pieces:
        if (piece.untyped_storage().data_ptr() != storage or piece.data_ptr() != expected
                or piece.stride() != first.stride() or piece.dtype != first.dtype):
            return torch.cat(pieces)
        expected += piece.shape[0] * row_bytes
    shape = (sum(p.shape[0] for p in pieces), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                   first.stride())
