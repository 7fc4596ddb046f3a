"""Read a megatron dist checkpoint one stored shard at a time, on one process.

megatron's ``torch_dist`` backend is PyTorch Distributed Checkpoint (DCP): ``.metadata`` lists
every tensor by its global key and global shape, with the chunks (shards) that ranks wrote,
so any layout (TP, PP, EP, eps, DP) is readable without building a model or starting a
process group. `copy_chunks` hands each stored chunk of a tensor to a destination block (here:
a map of that block of the export file), loading one chunk at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from engram_train.errors import EngramError

MEGATRON_METADATA = "metadata.json"
COMMON_STATE = "common.pt"
DCP_METADATA = ".metadata"
# Optimizer state is saved next to the model under "optimizer.state.<kind>.<model key>",
# prefixed with "chained_<i>." by megatron's chained optimizer.
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


class CheckpointFormatError(EngramError, ValueError):
    """A directory that is not a readable megatron torch_dist checkpoint."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the checkpoint: global key, shape and dtype, and the chunks ranks wrote."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class _IntoBlock(LoadPlanner):
    """Hands DCP's reader the destination block of a one-item plan (no staging copy)."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise TypeError(f"{read_item.dest_index.fqn} is stored as bytes, not as a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.block

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DistCheckpointReader:
    """The tensors of one megatron ``torch_dist`` checkpoint directory (``iter_XXXXXXX``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta_file = self.path / MEGATRON_METADATA
        if not meta_file.is_file():
            raise CheckpointFormatError(
                f"{self.path} is not a megatron dist checkpoint: it has no {MEGATRON_METADATA}"
            )
        backend = json.loads(meta_file.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointFormatError(
                f"{self.path} was saved with the {backend!r} backend; only megatron's "
                "'torch_dist' (the default) is supported: convert it with megatron's "
                "dist_checkpointing (load and save with the torch_dist strategy)"
            )
        if not (self.path / DCP_METADATA).is_file():
            raise CheckpointFormatError(
                f"{self.path} has no {DCP_METADATA}: the checkpoint is incomplete"
            )
        self._reader = FileSystemReader(str(self.path))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)
        self.tensors: dict[str, StoredTensor] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue  # bytes objects (e.g. transformer-engine extra state)
            chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            self.tensors[key] = StoredTensor(key, tuple(md.size), md.properties.dtype, chunks)

    def model_keys(self) -> list[str]:
        """Keys of model tensors (optimizer state left out), in checkpoint order."""
        return [k for k in self.tensors if not OPTIMIZER_KEY.match(k)]

    def common_state(self) -> dict[str, Any] | None:
        """The non-sharded state (``iteration``, ``extra``...): ``common.pt`` (megatron-core
        0.16) or the object embedded in the torch_dist files (0.19); None if there is none or
        it cannot be read without unpickling arbitrary objects."""
        from engram_train.runtime.megatron_fixes import (
            embedded_common_state_key,
            read_embedded_common_state,
        )

        path = self.path / COMMON_STATE
        try:
            if path.is_file():
                return torch.load(path, map_location="cpu", weights_only=True)
            if embedded_common_state_key() in self.metadata.state_dict_metadata:
                return read_embedded_common_state(self.path)
        except Exception:  # noqa: BLE001 - pickled objects outside torch's safe list
            return None
        return None

    def read_items(self, key: str) -> list[ReadItem]:
        """One DCP read per stored chunk of `key`, with its block in global coordinates."""
        stored = self.tensors[key]
        whole = ChunkStorageMetadata(offsets=torch.Size([0] * len(stored.shape)),
                                     sizes=torch.Size(stored.shape))
        items = create_read_items_for_chunk_list(
            key, self.metadata.state_dict_metadata[key], [whole])
        covered = sum(_numel(item.lengths) for item in items)
        if covered != _numel(stored.shape):  # stored chunks never overlap
            raise CheckpointFormatError(
                f"{key}: the stored chunks cover {covered} of {_numel(stored.shape)} elements; "
                "the checkpoint is incomplete"
            )
        return items

    def copy_chunks(
        self,
        key: str,
        block: Callable[[Sequence[int], Sequence[int]], ContextManager[torch.Tensor]],
    ) -> None:
        """Copy tensor `key` chunk by chunk: `block(offsets, lengths)` gives the destination
        of each stored chunk (any dtype: the copy casts). One chunk is in memory at a time."""
        for item in self.read_items(key):
            with block(tuple(item.dest_offsets), tuple(item.lengths)) as target:
                if tuple(target.shape) != tuple(item.lengths):
                    raise CheckpointFormatError(f"{key}: destination block {tuple(target.shape)} for a "
                                     f"stored chunk of {tuple(item.lengths)}")
                self._reader.read_data(LoadPlan([item]), _IntoBlock(target)).wait()
                del target

    def read_into(self, key: str, target: torch.Tensor) -> None:
        """Copy tensor `key` into `target` (its global shape), one stored chunk at a time."""
        if tuple(target.shape) != self.tensors[key].shape:
            raise CheckpointFormatError(f"{key}: target of shape {tuple(target.shape)}, stored global shape "
                             f"{self.tensors[key].shape}")

        def block(offsets, lengths):
            view = target
            for dim, (start, length) in enumerate(zip(offsets, lengths)):
                view = view.narrow(dim, start, length)
            return contextlib.nullcontext(view)

        self.copy_chunks(key, block)

    def read_region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The block ``[offsets, offsets + sizes)`` of tensor `key` in its stored dtype, read
        from the stored chunks it overlaps (one at a time)."""
        stored = self.tensors[key]
        out = torch.empty(tuple(sizes), dtype=stored.dtype)
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [box])
        if sum(_numel(item.lengths) for item in items) != out.numel():
            raise CheckpointFormatError(f"{key}: the stored chunks do not cover the block at "
                                        f"{tuple(offsets)} of {tuple(sizes)}")
        for item in items:
            view = out
            for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
                view = view.narrow(dim, start, length)
            self._reader.read_data(LoadPlan([item]), _IntoBlock(view)).wait()
            del view
        return out

    def read(self, key: str) -> torch.Tensor:
        """A whole tensor in memory (for small ones)."""
        stored = self.tensors[key]
        out = torch.empty(stored.shape, dtype=stored.dtype)
        self.read_into(key, out)
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
