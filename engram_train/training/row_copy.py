"""Copying loaded optimizer state into the live tensors without a table-sized temporary
(`copy_rows`; the table optimizer's state, ``table_optimizer_state.py``, and row-wise Adam,
``rowwise_adam.py``, load through it)."""

from __future__ import annotations

import torch

from engram_train.errors import InputError

# Loaded optimizer state is copied into the live tensors by blocks of rows of about this many
# bytes where the copy converts (dtype or device), so no table-sized temporary is made.
COPY_BLOCK_BYTES = 8 * 2**20


def copy_rows(target: torch.Tensor, source: torch.Tensor, block_bytes: int | None = None) -> None:
    """``target.copy_(source)`` (same shape) without a temporary the size of ``target``:
    nothing when ``source`` is ``target``'s own memory (a checkpoint loaded into the live
    tensor), one copy when dtype and device agree, else blocks of leading-dimension rows of
    about ``block_bytes`` (in the wider dtype; default `COPY_BLOCK_BYTES`)."""
    if source.shape != target.shape:
        raise InputError(f"loaded state of shape {tuple(source.shape)} for a tensor of shape "
                         f"{tuple(target.shape)}")
    if (source.device == target.device and source.data_ptr() == target.data_ptr()
            and source.dtype == target.dtype and source.stride() == target.stride()):
        return
    with torch.no_grad():
        if (source.dtype == target.dtype and source.device == target.device) or target.dim() == 0:
            target.copy_(source)
            return
        row = max(1, target[0].numel()) if target.numel() else 1
        width = max(source.element_size(), target.element_size())
        step = max(1, (block_bytes or COPY_BLOCK_BYTES) // (width * row))
        for start in range(0, target.shape[0], step):
            target[start:start + step].copy_(source[start:start + step])
