"""Sharded Engram table lookups: the two embedding-parallel methods (spec section 4).

A *method* object tells a ``MultiHeadEmbedding`` which rows it holds (``row_range``), how to
look rows up (``lookup``), how its gradient is reduced (``grad_sync_group``, ``norm_group``)
and how its shard is checkpointed (``checkpoint_shard``). Words as in ``groups.py``.

``alltoall`` (default): rows are split over the Engram embedding-parallel group. A
micro-batch's ids are deduplicated first (``torch.unique``: each distinct row is requested once),
then each rank sends the distinct ids it needs to their owners and gets the rows back with
``all_to_all_single`` (counts first: the splits are uneven; when a chunk starts all its
lookups at once, their count, id and row exchanges are interleaved, ``_StagedRoute``).
Backward: the gradients of a distinct row's positions are summed locally (the backward of the
expansion), one row per distinct id goes back to its owner, and the owner's table receives
(rows, gradient rows) pairs, never a dense table gradient (``engram/row_grad.py``).
Tensor-parallel peers hold the same micro-batch, so they split its distinct ids (TP rank r
fetches the r-th block) and all-gather the rows over TP; the backward of that gather keeps this
rank's block, because the Engram branch downstream is computed identically on every TP rank.
Every distinct id of a micro-batch is thus fetched once, and every row gradient reaches its
owner once.

``allreduce`` (baseline): rows are split over the tensor-parallel group as a vocab-parallel
embedding: masked local lookup of the micro-batch's distinct ids, all-reduce of [distinct, D]
over TP; backward needs no collective (each rank's masked lookup gives exactly its shard's
gradient rows).

Nothing here scales gradients: the table optimizer (``training/engram_optimizer.py``) sums
them over ``grad_sync_group`` and applies megatron DDP's averaging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engram_train.engram.row_grad import ROW_GRAD_ATTR, deliver_row_grad, gather_rows, read_rows


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


class _StagedRoute:
    """Send sorted distinct global rows to their owners and serve them back, in three steps,
    each starting an exchange that the next step waits for: counts (``__init__``), ids
    (``send_ids``), rows (``serve``, ``_ServeRows``). Sorted ids are already grouped by owner
    (owners hold contiguous row blocks), so no permutation is needed.
    A chunk that starts several lookups advances them together, so their round trips overlap
    instead of adding up (the prefetch path); a lone lookup runs the steps back to back."""

    def __init__(self, ids, boundaries, group, stats) -> None:
        self.ids, self.group, self.stats = ids, group, stats
        size = group.size()
        owner = torch.searchsorted(boundaries, ids, right=True) - 1
        self.send_counts = torch.bincount(owner, minlength=size)
        self.recv_counts = torch.empty_like(self.send_counts)
        self._work = dist.all_to_all_single(self.recv_counts, self.send_counts, group=group,
                                            async_op=True)
        if stats is not None:
            stats.count("alltoall_sent", self.send_counts.element_size() * (size - 1))
        self.recv_ids = None

    def send_ids(self) -> None:
        self._work.wait()
        self.send_splits = self.send_counts.tolist()
        self.recv_splits = self.recv_counts.tolist()
        self.recv_ids = self.ids.new_empty(sum(self.recv_splits))
        self._work = dist.all_to_all_single(self.recv_ids, self.ids, self.recv_splits,
                                            self.send_splits, group=self.group, async_op=True)
        if self.stats is not None:
            self.stats.count("alltoall_sent", _sent_bytes(self.send_splits, self.group.rank(),
                                                          self.ids.element_size()))

    def serve(self, weight, row_start, handles) -> torch.Tensor:
        self._work.wait()
        return _ServeRows.apply(weight, self.recv_ids - row_start, self.recv_splits,
                                self.send_splits, self.group, self.stats, handles)


class _ServeRows(torch.autograd.Function):
    """Owner side of a routed lookup: gather the requested rows of this shard and all-to-all
    them back to the requesters (uneven splits). With ``handles`` (a list) the exchange is
    asynchronous: its work handle is appended there and the output is valid once it is waited.

    Backward: the requesters' gradient rows come back by the reverse all-to-all and reach the
    table row-sparse (``engram/row_grad.py``); for an armed table the exchange is not waited
    here but by the accumulator, when the step needs the gradient."""

    @staticmethod
    def forward(ctx, weight, local_rows, send_splits, recv_splits, group, stats, handles):
        ctx.weight, ctx.group, ctx.stats = weight, group, stats
        ctx.splits = (send_splits, recv_splits)
        ctx.save_for_backward(local_rows)
        served = read_rows(weight, local_rows)
        out = served.new_empty((sum(recv_splits), served.shape[1]))
        work = dist.all_to_all_single(out, served, recv_splits, send_splits, group=group,
                                      async_op=handles is not None)
        if handles is not None:
            handles.append(work)
        if stats is not None:
            row_bytes = served.element_size() * served.shape[1]
            stats.count("alltoall_sent", _sent_bytes(send_splits, group.rank(), row_bytes))
        return out

    @staticmethod
    def backward(ctx, grad):
        (local_rows,) = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(send_splits), grad.shape[1]))
        accumulator = getattr(ctx.weight, ROW_GRAD_ATTR, None)
        work = dist.all_to_all_single(out, grad, send_splits, recv_splits, group=ctx.group,
                                      async_op=accumulator is not None)
        if ctx.stats is not None:
            row_bytes = grad.element_size() * grad.shape[1]
            ctx.stats.count("alltoall_sent", _sent_bytes(recv_splits, ctx.group.rank(), row_bytes))
        if accumulator is not None:  # waited when the optimizer coalesces the gradient
            accumulator.add(local_rows, out, work=work)
            return (None,) * 7
        return (deliver_row_grad(ctx.weight, local_rows, out),) + (None,) * 6


def routed_lookup(weight, ids, row_start, boundaries, group, stats, handles=None):
    """Sorted distinct global rows (any owner) -> their values [n, D], through the owners.

    Forward: ids to owners (counts, then ids: small and blocking), owners gather, rows back
    (asynchronous when ``handles`` is given). Backward: one gradient row per distinct id back to
    its owner, whose table receives it row-sparse (``engram/row_grad.py``)."""
    if group is None or group.size() == 1:
        return gather_rows(weight, ids - row_start)
    route = _StagedRoute(ids, boundaries, group, stats)
    route.send_ids()
    return route.serve(weight, row_start, handles)


class _ReduceOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: megatron's reduce_from_tensor_model_parallel
    region, with byte accounting; asynchronous when ``handles`` (a list) is given."""

    @staticmethod
    def forward(ctx, values, group, stats, handles=None):
        if group is None or group.size() == 1:
            return values
        values = values.contiguous()
        work = dist.all_reduce(values, group=group, async_op=handles is not None)
        if handles is not None:
            handles.append(work)
        if stats is not None:
            stats.count("allreduce_payload", values.numel() * values.element_size())
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherKeepSlice(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` of blocks of the given ``sizes`` (one per rank);
    backward keeps this rank's block (the consumer runs identically on every rank of the
    group). As megatron's ``gather_from_sequence_parallel_region(...,
    tensor_parallel_output_grad=False)``, with uneven blocks."""

    @staticmethod
    def forward(ctx, values, group, sizes, stats):
        width = max(sizes)
        ctx.start = sum(sizes[: group.rank()])
        ctx.chunk = values.shape[0]
        padded = values.new_zeros((width, *values.shape[1:]))
        padded[: values.shape[0]] = values
        out = values.new_empty((len(sizes) * width, *values.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        if stats is not None:
            stats.count("allgather_payload", padded.numel() * padded.element_size())
        return torch.cat([out[r * width : r * width + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.chunk], None, None, None


@dataclass
class LookupTimes:
    """Seconds this process spent in Engram lookups since the last ``reset``: ``issue_s`` in
    starting them (hashing ids to owners, gathers; the blocking part), ``wait_s`` waiting for
    rows still in flight when a layer needed them. Without prefetch a lookup's whole exchange
    is waited at once, so ``wait_s`` is the exchange time; with prefetch it is what was not
    hidden behind the layers before."""

    issue_s: float = 0.0
    wait_s: float = 0.0
    lookups: int = 0

    def reset(self) -> None:
        self.issue_s = self.wait_s = 0.0
        self.lookups = 0


LOOKUP_TIMES = LookupTimes()


class PendingLookup:
    """A lookup whose rows may still be in flight: ``wait()`` returns them ([..., D]).

    ``stages`` (callables) are the steps still to run before the rows are on their way (the
    routed lookup's id exchange, ``_StagedRoute``); the last one returns the values.
    ``advance()`` runs the next step: a caller holding several lookups advances them in turns
    so that their exchanges overlap; ``wait()`` runs whatever is left."""

    def __init__(self, values, handles: list, finish, stages: list | None = None) -> None:
        self._values, self._handles, self._finish = values, handles, finish
        self._stages = list(stages or [])
        self._result: torch.Tensor | None = None

    def advance(self) -> bool:
        """Run the next step, if any (timed as starting the lookup); True if one ran."""
        if not self._stages:
            return False
        start = time.perf_counter()
        out = self._stages.pop(0)()
        if not self._stages:
            self._values = out
        LOOKUP_TIMES.issue_s += time.perf_counter() - start
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while self.advance():
                pass
            start = time.perf_counter()
            for work in self._handles:
                work.wait()
            LOOKUP_TIMES.wait_s += time.perf_counter() - start
            self._result = self._finish(self._values)
            self._values = self._handles = self._finish = None
        return self._result


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
        self.ids_requested = 0  # (position, head) ids looked up, before deduplication
        self.ids_distinct = 0  # distinct rows actually fetched (per micro-batch)

    def _distinct(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted distinct rows of a micro-batch and the inverse map back to its positions."""
        unique, inverse = torch.unique(rows.reshape(-1), sorted=True, return_inverse=True)
        self.ids_requested += rows.numel()
        self.ids_distinct += unique.numel()
        return unique, inverse

    @property
    def dedup_ratio(self) -> float:
        """ids requested / distinct rows fetched, since the last ``reset_counts``."""
        return self.ids_requested / self.ids_distinct if self.ids_distinct else 1.0

    def reset_counts(self) -> None:
        self.ids_requested = self.ids_distinct = 0

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
    """Method ``alltoall``: rows over the embedding-parallel group, ids routed to owners."""

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
        """Global rows [...] -> [..., D] through the owners, each distinct row fetched once."""
        return self.issue(embedding, rows, prefetch=False).wait()

    def issue(self, embedding, rows: torch.Tensor, prefetch: bool = True) -> PendingLookup:
        """Start the lookup of ``lookup``; with ``prefetch`` the rows travel back
        asynchronously while the caller computes, and ``wait()`` collects them."""
        start = time.perf_counter()
        unique, inverse = self._distinct(rows)
        tp = self.tensor_group.size() if self.tensor_group is not None else 1
        sizes = None
        if tp > 1:  # TP peers hold the same micro-batch: each fetches a block of its rows
            sizes = [hi - lo for lo, hi in (row_range(unique.numel(), r, tp) for r in range(tp))]
            lo, hi = row_range(unique.numel(), self.tensor_group.rank(), tp)
            unique = unique[lo:hi]
        key = (embedding.num_rows, unique.device)
        if key not in self._boundaries:
            self._boundaries[key] = row_boundaries(embedding.num_rows, self.num_shards,
                                                   unique.device)
        handles: list = []
        group = self.embedding_group
        values, stages = None, []
        if prefetch and group is not None and group.size() > 1:
            route = _StagedRoute(unique, self._boundaries[key], group, self.stats)
            stages = [route.send_ids,
                      lambda: route.serve(embedding.weight, embedding.row_start, handles)]
        else:  # blocking, or a group of one (a local gather: nothing in flight)
            values = routed_lookup(
                embedding.weight, unique, embedding.row_start, self._boundaries[key],
                group, self.stats,
            )

        def finish(values: torch.Tensor) -> torch.Tensor:
            if sizes is not None:
                values = _GatherKeepSlice.apply(values, self.tensor_group, sizes, self.stats)
            return values.index_select(0, inverse).view(*rows.shape, values.shape[-1])

        LOOKUP_TIMES.issue_s += time.perf_counter() - start
        LOOKUP_TIMES.lookups += 1
        return PendingLookup(values, handles, finish, stages)


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
        """Masked lookup of each distinct row on every shard, summed over TP ([distinct, D]
        all-reduced, not [positions, D]), then expanded to the positions."""
        return self.issue(embedding, rows, prefetch=False).wait()

    def issue(self, embedding, rows: torch.Tensor, prefetch: bool = True) -> PendingLookup:
        """As ``lookup``; with ``prefetch`` the all-reduce runs asynchronously until
        ``wait()``."""
        start = time.perf_counter()
        unique, inverse = self._distinct(rows)
        local = unique - embedding.row_start
        handles: list = []
        if self.num_shards == 1:
            values = gather_rows(embedding.weight, local)
        else:
            owned = (local >= 0) & (local < embedding.weight.shape[0])
            values = gather_rows(embedding.weight, torch.where(owned, local, 0), owned)
            values = _ReduceOverGroup.apply(values, self.tensor_group, self.stats,
                                            handles if prefetch else None)

        def finish(values: torch.Tensor) -> torch.Tensor:
            return values.index_select(0, inverse).view(*rows.shape, values.shape[-1])

        LOOKUP_TIMES.issue_s += time.perf_counter() - start
        LOOKUP_TIMES.lookups += 1
        return PendingLookup(values, handles, finish)


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
