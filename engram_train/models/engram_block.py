"""EngramTransformerBlock: megatron's TransformerBlock that carries Engram hash ids.

The block hands the packed ids of the micro-batch to its layers as megatron's ``context``
argument; Engram layers read their slice by global layer id and pass it on, plain layers pass
it through untouched (their cross-attention slot is an identity in GPT specs). Everything
else (pipeline offsets, virtual pipeline, selective/full recompute, fp8 contexts) is
megatron's own code. Tracks megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from megatron.core.transformer.transformer_block import TransformerBlock


def pack_hash_ids(
    hash_ids: Mapping[int, torch.Tensor] | torch.Tensor, layer_ids: Sequence[int]
) -> torch.Tensor:
    """``{layer_id: [B, S, K]}`` (the data path's layout) -> ``[S, B, L, K]`` in layer_ids order.

    A tensor is taken as already packed and checked for its layer count.
    """
    if isinstance(hash_ids, torch.Tensor):
        if hash_ids.ndim != 4 or hash_ids.shape[2] != len(layer_ids):
            raise ValueError(
                f"packed engram_hash_ids must be [S, B, {len(layer_ids)}, K], got {tuple(hash_ids.shape)}"
            )
        return hash_ids
    missing = [layer for layer in layer_ids if layer not in hash_ids]
    if missing:
        raise ValueError(f"engram_hash_ids has no ids for Engram layers {missing} (has {sorted(hash_ids)})")
    return torch.stack([hash_ids[layer] for layer in layer_ids], dim=2).transpose(0, 1).contiguous()


class EngramTransformerBlock(TransformerBlock):
    """TransformerBlock that forwards the hash ids set by ``set_engram_hash_ids``.

    Like megatron's ``set_input_tensor``, the model sets the ids right before calling the
    block, so GPTModel's own forward stays untouched; they are consumed by one forward.
    """

    _pending_hash_ids: torch.Tensor | None = None

    def set_engram_hash_ids(self, packed: torch.Tensor | None) -> None:
        self._pending_hash_ids = packed

    def forward(self, *args, **kwargs):
        packed, self._pending_hash_ids = self._pending_hash_ids, None
        if packed is not None:
            if kwargs.get("context") is not None:
                raise ValueError("EngramTransformerBlock uses the context slot for hash ids; "
                                 "cross-attention context is not supported with Engram")
            kwargs["context"] = packed
        return super().forward(*args, **kwargs)
