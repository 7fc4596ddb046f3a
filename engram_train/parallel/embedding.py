"""Sharded Engram table lookups: the two embedding-parallel methods (spec section 4).

A *method* object tells a ``MultiHeadEmbedding`` which rows it holds (``row_range``), how to
look rows up (``lookup``), how its gradient is reduced (``grad_sync_group``, ``norm_group``)
and how its shard is checkpointed (``checkpoint_shard``). Words as in ``groups.py``.

``alltoall`` (default): rows are split over the Engram embedding-parallel (EmbP) group. Each
rank sends the ids it needs to their owners and gets the rows back with ``all_to_all_single``
(counts first: the splits are uneven); backward sends the row gradients to the owners the same
way and the owners ``index_add`` them into their shard's gradient. Tensor-parallel peers hold
the same micro-batch, so they split its ids (TP rank r looks up the r-th 1/TP of the
micro-batch's (position, head) ids) and all-gather the rows over TP; the backward of that
gather keeps this rank's slice, because the Engram branch downstream is computed identically on
every TP rank (its memory gradient is the same on all of them). Every id of the job is thus
looked up once, and every row gradient reaches its owner once.

``allreduce`` (baseline): rows are split over the tensor-parallel group as a vocab-parallel
embedding: masked local lookup of every id, all-reduce over TP; backward needs no collective
(each rank's masked lookup gives exactly its shard's gradient).

Nothing here scales gradients: the table optimizer (``training/engram_optimizer.py``) sums
them over ``grad_sync_group`` and applies megatron DDP's averaging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def row_range(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [start, end) of shard ``rank`` of ``size``: contiguous, sizes differ by at most one."""
    return rank * num_rows // size, (rank + 1) * num_rows // size


def row_boundaries(num_rows: int, size: int, device=None) -> torch.Tensor:
    """First row of every shard (int64 [size]); ``searchsorted(..., right=True) - 1`` = owner."""
    return torch.tensor([row_range(num_rows, r, size)[0] for r in range(size)],
                        dtype=torch.int64, device=device)


@dataclass
class CommStats:
    """Payload bytes this rank handed to collectives (for benchmarks; off by default)."""

    alltoall_sent: int = 0  # bytes sent to other ranks by all-to-all (ids, counts, rows, grads)
    allreduce_payload: int = 0  # bytes of tensors all-reduced (the wire bytes are algorithmic)
    allgather_payload: int = 0  # bytes this rank contributed to all-gathers
    calls: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str, nbytes: int) -> None:
        setattr(self, kind, getattr(self, kind) + int(nbytes))
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        self.alltoall_sent = self.allreduce_payload = self.allgather_payload = 0
        self.calls.clear()


def _sent_bytes(splits: list[int], me: int, row_bytes: int) -> int:
    return (sum(splits) - splits[me]) * row_bytes


class _RoutedLookup(torch.autograd.Function):
    """ids (global rows, any owner) -> their rows, through the owners; see the module doc."""

    @staticmethod
    def forward(ctx, weight, ids, row_start, boundaries, group, stats):
        size = group.size() if group is not None else 1
        ctx.weight_shape, ctx.group, ctx.stats = weight.shape, group, stats
        if size == 1:
            local = ids - row_start
            ctx.save_for_backward(local)
            ctx.routed = False
            return nn.functional.embedding(local, weight)
        me = group.rank()
        owner = torch.searchsorted(boundaries, ids, right=True) - 1
        order = torch.argsort(owner, stable=True)
        send_ids = ids[order]
        send_counts = torch.bincount(owner, minlength=size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_ids = send_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_ids, send_ids, recv_splits, send_splits, group=group)
        local = recv_ids - row_start
        rows = nn.functional.embedding(local, weight)
        sorted_out = rows.new_empty((ids.numel(), weight.shape[1]))
        dist.all_to_all_single(sorted_out, rows, send_splits, recv_splits, group=group)
        out = torch.empty_like(sorted_out)
        out[order] = sorted_out
        if stats is not None:
            stats.count("alltoall_sent", send_counts.element_size() * (size - 1))
            stats.count("alltoall_sent", _sent_bytes(send_splits, me, send_ids.element_size()))
            row_bytes = rows.element_size() * rows.shape[1]
            stats.count("alltoall_sent", _sent_bytes(recv_splits, me, row_bytes))
        ctx.save_for_backward(local, order)
        ctx.splits = (send_splits, recv_splits)
        ctx.routed = True
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.routed:
            (local,) = ctx.saved_tensors
            grad_weight = grad_out.new_zeros(ctx.weight_shape)
            grad_weight.index_add_(0, local, grad_out)
            return grad_weight, None, None, None, None, None
        local, order = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        grad_sorted = grad_out[order].contiguous()
        recv_grad = grad_sorted.new_empty((local.numel(), grad_sorted.shape[1]))
        dist.all_to_all_single(recv_grad, grad_sorted, recv_splits, send_splits, group=ctx.group)
        if ctx.stats is not None:
            me = ctx.group.rank()
            row_bytes = grad_sorted.element_size() * grad_sorted.shape[1]
            ctx.stats.count("alltoall_sent", _sent_bytes(send_splits, me, row_bytes))
        grad_weight = grad_out.new_zeros(ctx.weight_shape)
        grad_weight.index_add_(0, local, recv_grad)
        return grad_weight, None, None, None, None, None


class _ReduceOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: megatron's reduce_from_tensor_model_parallel
    region, with byte accounting."""

    @staticmethod
    def forward(ctx, values, group, stats):
        if group is None or group.size() == 1:
            return values
        values = values.contiguous()
        dist.all_reduce(values, group=group)
        if stats is not None:
            stats.count("allreduce_payload", values.numel() * values.element_size())
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherKeepSlice(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward keeps this rank's slice (the consumer
    runs identically on every rank of the group). As megatron's
    ``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False)``."""

    @staticmethod
    def forward(ctx, values, group, stats):
        size = group.size()
        ctx.group, ctx.chunk = group, values.shape[0]
        out = values.new_empty((size * values.shape[0], *values.shape[1:]))
        dist.all_gather_into_tensor(out, values.contiguous(), group=group)
        if stats is not None:
            stats.count("allgather_payload", values.numel() * values.element_size())
        return out

    @staticmethod
    def backward(ctx, grad):
        start = ctx.group.rank() * ctx.chunk
        return grad[start : start + ctx.chunk], None, None


class _ShardedLookup:
    """What both methods share: a group whose ranks own contiguous row blocks of each table,
    the groups that reduce table gradients and their norm, and the checkpoint placement."""

    method = ""

    def __init__(
        self,
        shard_group: dist.ProcessGroup | None,
        grad_sync_group: dist.ProcessGroup | None,
        norm_group: dist.ProcessGroup | None,
        stats: CommStats | None,
    ) -> None:
        self.shard_group = shard_group
        self.grad_sync_group = grad_sync_group
        self.norm_group = norm_group
        self.stats = stats

    @property
    def num_shards(self) -> int:
        return self.shard_group.size() if self.shard_group is not None else 1

    @property
    def shard_rank(self) -> int:
        return self.shard_group.rank() if self.shard_group is not None else 0

    def row_range(self, num_rows: int) -> tuple[int, int]:
        return row_range(num_rows, self.shard_rank, self.num_shards)

    def checkpoint_shard(self) -> tuple[int, int, Any]:
        """(shard index, number of shards, replica id) of this rank's rows."""
        replica = self.grad_sync_group.rank() if self.grad_sync_group is not None else 0
        return self.shard_rank, self.num_shards, replica


class AllToAllLookup(_ShardedLookup):
    """Method ``alltoall``: rows over the EmbP group, ids routed to owners (module doc)."""

    method = "alltoall"

    def __init__(
        self,
        embedding_group: dist.ProcessGroup | None,
        tensor_group: dist.ProcessGroup | None = None,
        grad_sync_group: dist.ProcessGroup | None = None,
        norm_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__(embedding_group, grad_sync_group, norm_group, stats)
        self.embedding_group = embedding_group
        self.tensor_group = tensor_group
        self._boundaries: dict[tuple[int, torch.device], torch.Tensor] = {}

    def lookup(self, embedding, rows: torch.Tensor) -> torch.Tensor:
        """Global rows [...] -> [..., D] through the owners."""
        flat = rows.reshape(-1)
        n = flat.numel()
        tp = self.tensor_group.size() if self.tensor_group is not None else 1
        if tp > 1:
            chunk = -(-n // tp)
            if chunk * tp != n:  # pad with row 0: its rows are dropped, its grads are zeros
                flat = nn.functional.pad(flat, (0, chunk * tp - n))
            start = self.tensor_group.rank() * chunk
            flat = flat[start : start + chunk]
        key = (embedding.num_rows, flat.device)
        if key not in self._boundaries:
            self._boundaries[key] = row_boundaries(embedding.num_rows, self.num_shards, flat.device)
        values = _RoutedLookup.apply(
            embedding.weight, flat, embedding.row_start, self._boundaries[key],
            self.embedding_group, self.stats,
        )
        if tp > 1:
            values = _GatherKeepSlice.apply(values, self.tensor_group, self.stats)[:n]
        return values.view(*rows.shape, values.shape[-1])


class AllReduceLookup(_ShardedLookup):
    """Method ``allreduce``: rows over the TP group, masked local lookup + all-reduce."""

    method = "allreduce"

    def __init__(
        self,
        tensor_group: dist.ProcessGroup | None,
        grad_sync_group: dist.ProcessGroup | None = None,
        norm_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__(tensor_group, grad_sync_group, norm_group, stats)
        self.tensor_group = tensor_group

    def lookup(self, embedding, rows: torch.Tensor) -> torch.Tensor:
        if self.num_shards == 1:
            return embedding.lookup_rows(rows)
        values = embedding.lookup_rows(rows, partial=True)
        return _ReduceOverGroup.apply(values, self.tensor_group, self.stats)


def table_gradient_groups(config) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(group to sum table gradients over, group to sum their squared norm over) of the
    model's method; every rank has them, with or without tables of its own.

    ``alltoall``: the Engram data-parallel and model-parallel groups. ``allreduce``: megatron's
    data-parallel (with context) group and its model-parallel (TP x PP) group.
    """
    from megatron.core import parallel_state

    from engram_train.parallel import groups

    if config.engram_embedding_parallel_method == "allreduce":
        return (
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            parallel_state.get_model_parallel_group(),
        )
    return groups.get_engram_data_parallel_group(), groups.get_engram_model_parallel_group()


def engram_embedding_parallel(config, tp_group: dist.ProcessGroup | None = None):
    """The method object for a model built inside megatron's (and Engram's) parallel state.

    ``alltoall`` checks that the Engram groups were created with the model's
    ``engram_embedding_parallel_size``.
    """
    from megatron.core import parallel_state

    from engram_train.parallel import groups

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    method = config.engram_embedding_parallel_method
    if method == "allreduce":
        grad_sync_group, norm_group = table_gradient_groups(config)
        return AllReduceLookup(tp_group, grad_sync_group=grad_sync_group, norm_group=norm_group)
    if method != "alltoall":
        raise ValueError(f"unknown engram_embedding_parallel_method={method!r}")
    eps = config.engram_embedding_parallel_size
    if not groups.is_engram_parallel_initialized():
        raise RuntimeError(
            "Engram parallel groups are not initialized: start the job with "
            "engram_train.runtime.initialize_distributed(ParallelSizes(..., "
            f"engram_embedding={eps}))."
        )
    have = groups.get_engram_embedding_parallel_world_size()
    if have != eps:
        raise ValueError(
            f"the model has engram_embedding_parallel_size={eps} but the Engram embedding-parallel "
            f"group was created with {have} ranks: pass ParallelSizes(engram_embedding={eps}) to "
            "initialize_distributed (or set both to the same value)."
        )
    grad_sync_group, norm_group = table_gradient_groups(config)
    return AllToAllLookup(
        groups.get_engram_embedding_parallel_group(),
        tensor_group=tp_group,
        grad_sync_group=grad_sync_group,
        norm_group=norm_group,
    )
