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
Without sequence parallelism, tensor-parallel peers hold the same micro-batch, so they split
its distinct ids (TP rank r fetches the r-th block) and all-gather the rows over TP; the
backward of that gather keeps this rank's block, because the Engram branch downstream is
computed identically on every TP rank. With sequence parallelism each TP rank runs the branch
on its own slice of the sequence and looks up that slice's ids only (no split, no gather).
Every distinct id of a micro-batch is thus fetched once per slice holding it, and every row
gradient reaches its owner once per position.

``allreduce`` (baseline): rows are split over the tensor-parallel group as a vocab-parallel
embedding: masked local lookup of the micro-batch's distinct ids, all-reduce of [distinct, D]
over TP; backward needs no collective (each rank's masked lookup gives exactly its shard's
gradient rows). With sequence parallelism the TP peers' distinct ids are all-gathered first,
each rank keeps its own block of the reduced rows, and the backward all-reduces the rows'
gradients so that every shard sees every slice's.

Nothing here scales gradients: the table optimizer (``training/engram_optimizer.py``) sums
them over ``grad_sync_group`` and applies megatron DDP's averaging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engram_train.engram.row_grad import ROW_GRAD_ATTR, deliver_row_grad, gather_rows, read_rows
from engram_train.parallel import groups
from engram_train.parallel.groups import table_gradient_groups
from engram_train.errors import ConfigError


def row_range(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [start, end) of shard ``rank`` of ``size``: contiguous, sizes differ by at most one."""
    return rank * num_rows // size, (rank + 1) * num_rows // size


def row_boundaries(num_rows: int, size: int, device=None) -> torch.Tensor:
    """First row of every shard (int64 [size]); ``searchsorted(..., right=True) - 1`` = owner."""
    return torch.tensor([row_range(num_rows, r, size)[0] for r in range(size)],
                        dtype=torch.int64, device=device)


class _StagedRoute:
    """Send sorted distinct global rows to their owners and serve them back, in three steps,
    each starting an exchange that the next step waits for: counts (``__init__``), ids
    (``send_ids``), rows (``serve``, ``_ServeRows``). Sorted ids are already grouped by owner
    (owners hold contiguous row blocks), so no permutation is needed.
    A chunk that starts several lookups advances them together, so their round trips overlap
    instead of adding up (the prefetch path); a lone lookup runs the steps back to back."""

    def __init__(self, ids, boundaries, group) -> None:
        self.ids, self.group = ids, group
        size = group.size()
        owner = torch.searchsorted(boundaries, ids, right=True) - 1
        self.send_counts = torch.bincount(owner, minlength=size)
        self.recv_counts = torch.empty_like(self.send_counts)
        self._work = dist.all_to_all_single(self.recv_counts, self.send_counts, group=group,
                                            async_op=True)
        self.recv_ids = None

    def send_ids(self) -> None:
        self._work.wait()
        self.send_splits = self.send_counts.tolist()
        self.recv_splits = self.recv_counts.tolist()
        self.recv_ids = self.ids.new_empty(sum(self.recv_splits))
        self._work = dist.all_to_all_single(self.recv_ids, self.ids, self.recv_splits,
                                            self.send_splits, group=self.group, async_op=True)

    def serve(self, weight, row_start, handles) -> torch.Tensor:
        self._work.wait()
        return _ServeRows.apply(weight, self.recv_ids - row_start, self.recv_splits,
                                self.send_splits, self.group, handles)


class _ServeRows(torch.autograd.Function):
    """Owner side of a routed lookup: gather the requested rows of this shard and all-to-all
    them back to the requesters (uneven splits). With ``handles`` (a list) the exchange is
    asynchronous: its work handle is appended there and the output is valid once it is waited.

    Backward: the requesters' gradient rows come back by the reverse all-to-all and reach the
    table row-sparse (``engram/row_grad.py``); for an armed table the exchange is not waited
    here but by the accumulator, when the step needs the gradient."""

    @staticmethod
    def forward(ctx, weight, local_rows, send_splits, recv_splits, group, handles):
        ctx.weight, ctx.group = weight, group
        ctx.splits = (send_splits, recv_splits)
        ctx.save_for_backward(local_rows)
        served = read_rows(weight, local_rows)
        out = served.new_empty((sum(recv_splits), served.shape[1]))
        work = dist.all_to_all_single(out, served, recv_splits, send_splits, group=group,
                                      async_op=handles is not None)
        if handles is not None:
            handles.append(work)
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
        if accumulator is not None:  # waited when the optimizer coalesces the gradient
            accumulator.add(local_rows, out, work=work)
            return (None,) * 6
        return (deliver_row_grad(ctx.weight, local_rows, out),) + (None,) * 5


def routed_lookup(weight, ids, row_start, boundaries, group, handles=None):
    """Sorted distinct global rows (any owner) -> their values [n, D], through the owners.

    Forward: ids to owners (counts, then ids: small and blocking), owners gather, rows back
    (asynchronous when ``handles`` is given). Backward: one gradient row per distinct id back to
    its owner, whose table receives it row-sparse (``engram/row_grad.py``)."""
    if group is None or group.size() == 1:
        return gather_rows(weight, ids - row_start)
    route = _StagedRoute(ids, boundaries, group)
    route.send_ids()
    return route.serve(weight, row_start, handles)


class _ReduceOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: megatron's reduce_from_tensor_model_parallel
    region; asynchronous when ``handles`` (a list) is given."""

    @staticmethod
    def forward(ctx, values, group, handles=None):
        if group is None or group.size() == 1:
            return values
        values = values.contiguous()
        work = dist.all_reduce(values, group=group, async_op=handles is not None)
        if handles is not None:
            handles.append(work)
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherKeepSlice(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` of blocks of the given ``sizes`` (one per rank);
    backward keeps this rank's block (the consumer runs identically on every rank of the
    group). As megatron's ``gather_from_sequence_parallel_region(...,
    tensor_parallel_output_grad=False)``, with uneven blocks."""

    @staticmethod
    def forward(ctx, values, group, sizes):
        width = max(sizes)
        ctx.start = sum(sizes[: group.rank()])
        ctx.chunk = values.shape[0]
        padded = values.new_zeros((width, *values.shape[1:]))
        padded[: values.shape[0]] = values
        out = values.new_empty((len(sizes) * width, *values.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[r * width : r * width + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.chunk], None, None


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
    the groups that reduce table gradients and their norm, the checkpoint placement, and the
    lookup's frame (distinct rows in, expansion to the positions out, timing); a method
    supplies ``_fetch``, the exchange of the distinct rows."""

    method = ""

    def __init__(
        self,
        shard_group: dist.ProcessGroup | None,
        grad_sync_group: dist.ProcessGroup | None,
        norm_group: dist.ProcessGroup | None,
    ) -> None:
        self.shard_group = shard_group
        self.grad_sync_group = grad_sync_group
        self.norm_group = norm_group

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

    def lookup(self, embedding, rows: torch.Tensor) -> torch.Tensor:
        """Global rows [...] -> [..., D], each distinct row fetched once."""
        return self.issue(embedding, rows, prefetch=False).wait()

    def issue(self, embedding, rows: torch.Tensor, prefetch: bool = True) -> PendingLookup:
        """Start the lookup of ``lookup``; with ``prefetch`` the rows travel back
        asynchronously while the caller computes, and ``wait()`` collects them."""
        start = time.perf_counter()
        unique, inverse = torch.unique(rows.reshape(-1), sorted=True, return_inverse=True)
        values, handles, stages, post = self._fetch(embedding, unique, prefetch)

        def finish(values: torch.Tensor) -> torch.Tensor:
            if post is not None:
                values = post(values)
            return values.index_select(0, inverse).view(*rows.shape, values.shape[-1])

        LOOKUP_TIMES.issue_s += time.perf_counter() - start
        LOOKUP_TIMES.lookups += 1
        return PendingLookup(values, handles, finish, stages)

    def _fetch(self, embedding, unique: torch.Tensor, prefetch: bool):
        """(values or None, work handles, remaining stages, post-processing or None) for the
        sorted distinct rows ``unique``."""
        raise NotImplementedError


class AllToAllLookup(_ShardedLookup):
    """Method ``alltoall``: rows over the embedding-parallel group, ids routed to owners."""

    method = "alltoall"

    def __init__(
        self,
        embedding_group: dist.ProcessGroup | None,
        tensor_group: dist.ProcessGroup | None = None,
        grad_sync_group: dist.ProcessGroup | None = None,
        norm_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(embedding_group, grad_sync_group, norm_group)
        self.embedding_group = embedding_group
        self.tensor_group = tensor_group
        self._boundaries: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _fetch(self, embedding, unique: torch.Tensor, prefetch: bool):
        tp = self.tensor_group.size() if self.tensor_group is not None else 1
        post = None
        if tp > 1:  # TP peers hold the same micro-batch: each fetches a block of its rows
            sizes = [hi - lo for lo, hi in (row_range(unique.numel(), r, tp) for r in range(tp))]
            lo, hi = row_range(unique.numel(), self.tensor_group.rank(), tp)
            unique = unique[lo:hi]
            post = lambda values: _GatherKeepSlice.apply(values, self.tensor_group, sizes)  # noqa: E731
        key = (embedding.num_rows, unique.device)
        if key not in self._boundaries:
            self._boundaries[key] = row_boundaries(embedding.num_rows, self.num_shards,
                                                   unique.device)
        handles: list = []
        group = self.embedding_group
        if prefetch and group is not None and group.size() > 1:
            route = _StagedRoute(unique, self._boundaries[key], group)
            stages = [route.send_ids,
                      lambda: route.serve(embedding.weight, embedding.row_start, handles)]
            return None, handles, stages, post
        # blocking, or a group of one (a local gather: nothing in flight)
        values = routed_lookup(embedding.weight, unique, embedding.row_start,
                               self._boundaries[key], group)
        return values, handles, [], post


class AllReduceLookup(_ShardedLookup):
    """Method ``allreduce``: rows over the TP group, masked local lookup of each distinct row
    on every shard, summed over TP ([distinct, D] all-reduced, not [positions, D])."""

    method = "allreduce"

    def __init__(
        self,
        tensor_group: dist.ProcessGroup | None,
        grad_sync_group: dist.ProcessGroup | None = None,
        norm_group: dist.ProcessGroup | None = None,
        sequence_split: bool = False,
    ) -> None:
        super().__init__(tensor_group, grad_sync_group, norm_group)
        self.tensor_group = tensor_group
        self.sequence_split = sequence_split

    def _fetch(self, embedding, unique: torch.Tensor, prefetch: bool):
        local = unique - embedding.row_start
        handles: list = []
        if self.num_shards == 1:
            return gather_rows(embedding.weight, local), handles, [], None
        post = None
        if self.sequence_split:  # TP peers hold different slices: serve the union of their rows
            unique, (lo, hi) = _gather_ids(unique, self.tensor_group)
            local = unique - embedding.row_start
            post = lambda values: _AllReduceBackward.apply(values, self.tensor_group)[lo:hi]  # noqa: E731
        owned = (local >= 0) & (local < embedding.weight.shape[0])
        values = gather_rows(embedding.weight, torch.where(owned, local, 0), owned)
        values = _ReduceOverGroup.apply(values, self.tensor_group,
                                        handles if prefetch else None)
        return values, handles, [], post


def _gather_ids(ids: torch.Tensor, group) -> tuple[torch.Tensor, tuple[int, int]]:
    """Every rank's ids concatenated in rank order, and where this rank's are in it."""
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
    counts = count.new_empty(group.size())
    dist.all_gather_into_tensor(counts, count, group=group)
    sizes = counts.tolist()
    padded = ids.new_zeros(max(sizes))
    padded[: ids.numel()] = ids
    out = ids.new_empty(group.size() * max(sizes))
    dist.all_gather_into_tensor(out, padded, group=group)
    start = sum(sizes[: group.rank()])
    gathered = torch.cat([out[r * max(sizes) : r * max(sizes) + n] for r, n in enumerate(sizes)])
    return gathered, (start, start + ids.numel())


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward, all-reduce (sum) backward: megatron's copy_to_tensor_model_parallel_
    region. Each TP rank keeps only its slice of the reduced rows, so the gradient of every
    rank's slice must reach every shard's masked lookup."""

    @staticmethod
    def forward(ctx, values, group):
        ctx.group = group
        return values

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def engram_embedding_parallel(config, tp_group: dist.ProcessGroup | None = None,
                              sequence_parallel: bool = False):
    """The method object for a model built inside megatron's (and Engram's) parallel state.

    ``alltoall`` checks that the Engram groups were created with the model's
    ``engram_embedding_parallel_size``.
    """
    from megatron.core import parallel_state

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    method = config.engram_embedding_parallel_method
    # Sequence parallelism: TP peers hold different slices of the sequence, and the Engram
    # layer looks up only its own slice's ids (models/engram_layer.py).
    sequence_split = sequence_parallel and tp_group.size() > 1
    if method == "allreduce":
        grad_sync_group, norm_group = table_gradient_groups(config)
        return AllReduceLookup(tp_group, grad_sync_group=grad_sync_group, norm_group=norm_group,
                               sequence_split=sequence_split)
    if method != "alltoall":
        raise ConfigError(f"unknown engram_embedding_parallel_method={method!r}")
    eps = config.engram_embedding_parallel_size
    if not groups.is_engram_parallel_initialized():
        raise RuntimeError(
            "Engram parallel groups are not initialized: start the job with "
            "engram_train.runtime.initialize_distributed(ParallelSizes(..., "
            f"engram_embedding={eps}))."
        )
    have = groups.get_engram_embedding_parallel_world_size()
    if have != eps:
        raise ConfigError(
            f"the model has engram_embedding_parallel_size={eps} but the Engram embedding-parallel "
            f"group was created with {have} ranks: pass ParallelSizes(engram_embedding={eps}) to "
            "initialize_distributed (or set both to the same value)."
        )
    grad_sync_group, norm_group = table_gradient_groups(config)
    return AllToAllLookup(
        groups.get_engram_embedding_parallel_group(),
        tensor_group=None if sequence_split else tp_group,
        grad_sync_group=grad_sync_group,
        norm_group=norm_group,
    )
