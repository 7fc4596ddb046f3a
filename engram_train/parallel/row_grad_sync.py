"""Summing row-sparse table gradients over the replicas of a shard (the Engram data-parallel
group): only touched rows cross the wire, unless that would cost more than a dense all-reduce.

Every replica ends with the same (rows, values), bit for bit: the sparse route all-gathers
every replica's coalesced pairs and each replica coalesces the same concatenation in the same
order; the dense route all-reduces a [rows, D] buffer (and a touched-row mask), after which
all replicas read the same tensor. The choice between them is made from all-gathered counts,
so every replica takes the same route. A host-resident table (``engram/host_table.py``) always
takes the sparse route: the dense one would put a float32 buffer the size of the shard on the
compute device, which host placement exists to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engram_train.engram.row_grad import coalesce_rows

ID_BYTES = 8


@dataclass
class RowGradSyncStats:
    """What the last ``sync_row_grads`` did, per table (for benchmarks and logs)."""

    routes: list[str]
    rows_before: list[int]  # distinct rows of this replica
    rows_after: list[int]  # distinct rows of the summed gradient


def sparse_is_cheaper(total_pairs: int, num_rows: int, dim: int, group_size: int) -> bool:
    """Bytes a replica receives by all-gathering ``total_pairs`` (row id + fp32 row) vs a ring
    all-reduce of the dense fp32 shard plus a one-byte touched mask."""
    sparse = total_pairs * (ID_BYTES + 4 * dim)
    dense = 2 * (group_size - 1) / group_size * num_rows * (4 * dim + 1)
    return sparse <= dense


def _all_gather_rows(rows, values, counts, group):
    """Variable-length all-gather of (rows, values): pad to the longest, gather, unpad."""
    width = max(counts)
    padded_rows = rows.new_zeros(width)
    padded_rows[: rows.numel()] = rows
    padded_values = values.new_zeros((width, values.shape[1]))
    padded_values[: values.shape[0]] = values
    size = len(counts)
    all_rows = rows.new_empty(size * width)
    all_values = values.new_empty((size * width, values.shape[1]))
    dist.all_gather_into_tensor(all_rows, padded_rows, group=group)
    dist.all_gather_into_tensor(all_values, padded_values, group=group)
    keep = torch.cat([torch.arange(r * width, r * width + n, device=rows.device)
                      for r, n in enumerate(counts)])
    return all_rows.index_select(0, keep), all_values.index_select(0, keep)


def sync_row_grads(
    grads: list[tuple[torch.Tensor, torch.Tensor]],
    shard_rows: list[int],
    group: dist.ProcessGroup | None,
    dense_allowed: list[bool] | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], RowGradSyncStats]:
    """Sum each table's coalesced (rows, values) over ``group``; returns the summed pairs in
    the same order (sorted distinct rows) and what was done (the route per table is
    ``sparse_is_cheaper``'s choice, sparse wherever ``dense_allowed`` says False: the same on
    every replica, e.g. host-resident tables)."""
    rows_before = [r.numel() for r, _ in grads]
    if group is None or group.size() == 1 or not grads:
        return grads, RowGradSyncStats(["local"] * len(grads), rows_before, rows_before)
    size = group.size()
    device = grads[0][0].device
    local_counts = torch.tensor(rows_before, dtype=torch.int64, device=device)
    all_counts = local_counts.new_empty(size * len(grads))
    dist.all_gather_into_tensor(all_counts, local_counts, group=group)
    counts = all_counts.view(size, len(grads)).t().tolist()  # [table][replica]
    out, routes = [], []
    allowed = [True] * len(grads) if dense_allowed is None else dense_allowed
    for (rows, values), num_rows, table_counts, dense_ok in zip(grads, shard_rows, counts, allowed):
        dim = values.shape[1]
        sparse = not dense_ok or sparse_is_cheaper(sum(table_counts), num_rows, dim, size)
        if sparse:
            if max(table_counts) == 0:
                out.append((rows, values))
            else:
                out.append(coalesce_rows(*_all_gather_rows(rows, values, table_counts, group)))
            routes.append("sparse")
            continue
        dense = values.new_zeros((num_rows, dim))
        dense.index_copy_(0, rows, values)
        touched = torch.zeros(num_rows, dtype=torch.uint8, device=device)
        touched[rows] = 1
        dist.all_reduce(dense, group=group)
        dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=group)
        summed_rows = torch.nonzero(touched, as_tuple=True)[0]
        out.append((summed_rows, dense.index_select(0, summed_rows)))
        routes.append("dense")
    return out, RowGradSyncStats(routes, rows_before, [r.numel() for r, _ in out])
