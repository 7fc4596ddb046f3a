"""The host table update of step t, overlapped with step t+1 (``engram_overlap_host_update``).

Why. A host-resident table's update (``engram_table_placement: host``) runs on the CPU and,
done synchronously, sits on the critical path between two steps. Step t+1 reads only the rows
its tokens hash to, and a row-sparse update changes only the rows step t touched, so step t+1
needs to wait only for the rows in both sets.

How. ``launch`` hands each table's touched rows to one host thread, which updates them in
chunks in a fixed order and publishes how many are done. A lookup of a table with an update in
flight (``engram/host_table.read_host_rows`` calls ``PendingRows.wait_for``) finds where its
rows sit in that order and waits until the chunk holding the last of them is done; a lookup that
shares no row with the update does not wait at all. When the next step's rows are known before
the update starts (``prioritize``), they go first, those of every table before the other rows of
any table, so a lookup waits for the intersection (its table's, and that of the tables before
it) only, never for rows the next step does not read.

Errors. An exception on the host thread leaves the tables of that step half updated: every later
lookup of such a table, ``finish`` and the next ``launch`` raise `HostUpdateError` (the thread's
error chained), so no step reads and no checkpoint saves those tables; the error stays raised.
Checkpoint saves finish the update first (``engram/host_table.finish_pending_updates``), and
the trainer finishes the last step's update before it leaves the loop.

Exactness. The table optimizers update each row from that row's state alone
(``RowOptimizer.update_rows``), with the step's hyper-parameters read before the thread starts,
so any order or split of the rows gives the same bits as the synchronous update. Anything that
reads tables or optimizer state as a whole (the next update, checkpoints, evaluation snapshots)
calls ``finish`` first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from engram_train.engram.host_table import HOST_TABLE_TIMES, PENDING_ATTR
from engram_train.errors import EngramError

CHUNK_ROWS = 4096
"""Rows per chunk of the host thread: the granularity at which a lookup can proceed."""


class HostUpdateError(EngramError, RuntimeError):
    """The overlapped host table update failed: the tables of that step are incomplete."""


def _update_error(error: BaseException) -> HostUpdateError:
    rank = f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    return HostUpdateError(
        f"the Engram host table update failed{rank} ({type(error).__name__}: {error}); the "
        "tables of that step are incomplete: stopped, nothing saved since the last checkpoint")


class PendingRows:
    """The rows of one table that an in-flight update is changing, in update order;
    ``finish`` waits for the whole update (``OverlappedHostUpdate.finish``)."""

    def __init__(self, rows: torch.Tensor, progress: "_Progress", table_index: int,
                 finish: Callable[[], None] | None = None) -> None:
        self.rows = rows  # host int64 [u], update order
        self.progress = progress
        self.table_index = table_index
        self.finish = finish or (lambda: None)
        # row -> position in the update order, for the intersection search
        self.sorted_rows, self.order = torch.sort(rows)

    def wait_for(self, rows: torch.Tensor) -> None:
        """Block until every row of ``rows`` (host int64) that this update changes is done;
        `HostUpdateError` once the update has failed (whichever rows it reached)."""
        self.progress.check()
        if self.progress.finished or self.rows.numel() == 0 or rows.numel() == 0:
            return
        at = torch.searchsorted(self.sorted_rows, rows.reshape(-1)).clamp_(max=self.rows.numel() - 1)
        hit = self.sorted_rows[at] == rows.reshape(-1)
        if not bool(hit.any()):
            return
        last = int(self.order[at[hit]].max())
        self.progress.wait(self.table_index, last)


class _Progress:
    """Rows done per table, with a condition to wait on."""

    def __init__(self, num_tables: int) -> None:
        self.cond = threading.Condition()
        self.done = [0] * num_tables
        self.finished = False
        self.error: BaseException | None = None

    def advance(self, table: int, done: int) -> None:
        with self.cond:
            self.done[table] = done
            self.cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.finished, self.error = True, error
            self.cond.notify_all()

    def check(self) -> None:
        """Raise `HostUpdateError` if the update has failed."""
        if self.error is not None:
            raise _update_error(self.error) from self.error

    def wait(self, table: int, position: int) -> None:
        start = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: self.finished or self.done[table] > position)
        HOST_TABLE_TIMES.wait_s += time.perf_counter() - start
        self.check()


class OverlappedHostUpdate:
    """Runs one step's row updates on a host thread; see the module docstring."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._progress: _Progress | None = None
        self._tables: list[torch.Tensor] = []
        self._priority: list[torch.Tensor | None] | None = None
        self._error: BaseException | None = None  # a failed update: raised from then on

    def prioritize(self, rows_per_table: list[torch.Tensor | None]) -> None:
        """Shard-local rows the next step will read, per table (None: unknown); they are
        updated first by the next ``launch``."""
        self._priority = rows_per_table

    def launch(self, tables: list[torch.Tensor], rows: list[torch.Tensor],
               update: Callable[[int, torch.Tensor], None]) -> None:
        """Start updating ``rows[i]`` (host int64, distinct) of ``tables[i]`` (the
        host-resident parameters lookups read) with ``update(i, rows_part)``."""
        self.finish()
        priority, self._priority = self._priority, None
        parts = [self._order(r, priority[i] if priority else None) for i, r in enumerate(rows)]
        ordered = [torch.cat(p) for p in parts]
        progress = _Progress(len(tables))
        for i, table in enumerate(tables):
            setattr(table, PENDING_ATTR, PendingRows(ordered[i], progress, i, self.finish))
        # the prioritized rows of every table, then the other rows of every table
        spans = [(i, 0, p[0].numel()) for i, p in enumerate(parts)]
        spans += [(i, p[0].numel(), ordered[i].numel()) for i, p in enumerate(parts)]

        def work() -> None:
            start = time.perf_counter()
            try:
                for i, first, end in spans:
                    for lo in range(first, end, CHUNK_ROWS):
                        hi = min(lo + CHUNK_ROWS, end)
                        update(i, ordered[i][lo:hi])
                        progress.advance(i, hi)
                progress.finish()
            except BaseException as e:  # surfaced on the training thread by finish/wait_for
                progress.finish(e)
            HOST_TABLE_TIMES.update_s += time.perf_counter() - start

        self._progress, self._tables = progress, list(tables)
        self._thread = threading.Thread(target=work, name="engram-host-update", daemon=True)
        self._thread.start()

    @staticmethod
    def _order(rows: torch.Tensor, first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of ``rows`` in ``first``, the others), each in ``rows``' order."""
        if first is None or rows.numel() == 0:
            return rows[:0], rows
        hot = torch.isin(rows, first.to(rows.device))
        return rows[hot], rows[~hot]

    def finish(self) -> None:
        """Wait for the update in flight (if any) and clear the pending marks; after a failed
        update, raise `HostUpdateError` (now and at every later call: the marks stay, so
        lookups of those tables raise too)."""
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            HOST_TABLE_TIMES.wait_s += time.perf_counter() - start
            self._error = self._progress.error
            if self._error is None:
                for table in self._tables:
                    if hasattr(table, PENDING_ATTR):
                        delattr(table, PENDING_ATTR)
                self._tables = []
            self._thread, self._progress = None, None
        if self._error is not None:
            raise _update_error(self._error) from self._error

    def check(self) -> None:
        """Raise `HostUpdateError` if the update has failed, without waiting for it."""
        if self._error is not None or (self._progress is not None and self._progress.error):
            self.finish()


@torch.no_grad()
def next_step_rows(model_chunks, microbatches) -> dict[int, torch.Tensor]:
    """{id(table weight): distinct shard-local rows this rank's micro-batches read from it}
    for the tables this rank holds, from the micro-batches' hash-id blocks (``[L, B, S, K]``,
    one slice per Engram layer in increasing layer order). Rows other ranks will request from
    a shard are not known here; their lookups still wait correctly, only later."""
    blocks = [b.get("engram_hash_ids") for b in microbatches]
    if not blocks or not all(isinstance(b, torch.Tensor) for b in blocks):
        return {}
    rows: dict[int, torch.Tensor] = {}
    for chunk in model_chunks:
        layer_ids = sorted(chunk.config.engram_layer_ids)
        for module in chunk.modules():
            if type(module).__name__ != "MultiHeadEmbedding":
                continue
            index = layer_ids.index(module.layer_id)
            ids = torch.cat([module.table_rows(b[index].to(module.offsets.device)).reshape(-1)
                             for b in blocks]).unique() - module.row_start
            rows[id(module.weight)] = ids[(ids >= 0) & (ids < module.weight.shape[0])].cpu()
    return rows


def overlapping_parts(optimizer) -> list:
    """The parts of ``optimizer`` (a chain or itself) that overlap a host table update."""
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(part, "overlap", False)]


def prioritize_next_step(model_chunks, optimizer, microbatches) -> None:
    """Tell the Engram table optimizer in ``optimizer`` (a chain or itself) which rows the next
    step reads, so an overlapped host update changes them first."""
    for part in overlapping_parts(optimizer):
        rows = next_step_rows(model_chunks, microbatches)
        part.prioritize_rows([rows.get(id(p)) for p in part.model_params])


def finish_overlapped_updates(optimizer) -> None:
    """Finish the host table update in flight in ``optimizer`` (a chain or itself), if any;
    raises `HostUpdateError` if it failed."""
    for part in overlapping_parts(optimizer):
        part.finish_update()
