"""Row-sparse gradients of Engram tables: what a step's tokens touched, never the table size.

A lookup reads a few rows of a huge table, so its gradient is a few rows too. Autograd would
hand a table parameter a dense ``[rows, D]`` gradient (one shard-sized tensor per micro-batch
and its accumulation); instead, a table *armed* with a ``RowGradAccumulator`` receives from the
lookups' backward the (local row ids, gradient rows) pairs they produced, and the table
optimizer coalesces them once per step (``coalesce``): distinct sorted rows, one summed
float32 gradient row each. Unarmed tables (a plain ``torch.optim`` user of the Engram module)
keep autograd's dense ``.grad``: arming is what ``EngramTableOptimizer`` does.
"""

from __future__ import annotations

import torch

from engram_train.engram.fp8_table import (
    dequantize_rows,
    is_fp8_table,
    read_fp8_rows,
    table_scale,
)
from engram_train.engram.host_table import is_host_resident, read_host_rows

ROW_GRAD_ATTR = "engram_row_grad"


def coalesce_rows(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [n], values [n, D]) with repeats -> (sorted distinct rows [u], summed values [u, D]).

    Deterministic for a given input order (the sums run in input order per row), which is what
    keeps replicas that coalesce the same gathered input bitwise equal.
    """
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    if unique.numel() == rows.numel():  # already distinct: only reorder
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(rows.numel(), device=rows.device)
        return unique, values.index_select(0, order)
    if values.is_cuda:  # index_add_ uses atomics on CUDA: sum in a fixed order instead
        order = torch.argsort(inverse, stable=True)
        counts = torch.bincount(inverse, minlength=unique.numel())
        return unique, torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts)
    summed = values.new_zeros((unique.numel(), values.shape[1]))
    summed.index_add_(0, inverse, values)
    return unique, summed


class RowGradAccumulator:
    """Gradient of one table shard as row pairs, appended by lookups and coalesced per step.

    ``rows`` are shard-local (0-based within this rank's rows); values are kept in float32
    whatever the table's dtype (the float32 main-gradient rule of megatron's mixed precision).
    """

    def __init__(self, num_rows: int, dim: int) -> None:
        self.num_rows, self.dim = int(num_rows), int(dim)
        self._rows: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._works: list = []  # collectives still filling some of the values

    def add(self, rows: torch.Tensor, values: torch.Tensor, work=None) -> None:
        """Append row pairs; with ``work`` (an async collective still writing ``values``),
        the pair is read only after ``work.wait()`` (at ``coalesce``)."""
        if rows.numel():
            self._rows.append(rows.reshape(-1))
            self._values.append(values.reshape(-1, self.dim))
            if work is not None:
                self._works.append(work)

    def wait(self) -> None:
        """Wait for the gradient exchanges still in flight."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    @property
    def pending(self) -> int:
        """Row pairs received since the last ``coalesce``/``clear`` (before deduplication)."""
        return sum(r.numel() for r in self._rows)

    def coalesce(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct rows and their summed float32 gradients; clears the accumulator."""
        self.wait()
        if not self._rows:
            rows = torch.empty(0, dtype=torch.int64, device=device)
            return rows, torch.empty((0, self.dim), dtype=torch.float32, device=device)
        rows = torch.cat(self._rows) if len(self._rows) > 1 else self._rows[0]
        values = [v.float() for v in self._values]
        values = torch.cat(values) if len(values) > 1 else values[0]
        self.clear()
        return coalesce_rows(rows, values)

    def clear(self) -> None:
        self.wait()
        self._rows.clear()
        self._values.clear()


def arm_row_sparse_grad(param: torch.nn.Parameter) -> RowGradAccumulator:
    """Route ``param``'s lookup gradients to a ``RowGradAccumulator`` (idempotent)."""
    accumulator = getattr(param, ROW_GRAD_ATTR, None)
    if accumulator is None:
        accumulator = RowGradAccumulator(param.shape[0], param.shape[1])
        setattr(param, ROW_GRAD_ATTR, accumulator)
    return accumulator


def deliver_row_grad(
    weight: torch.nn.Parameter, rows: torch.Tensor, grad_rows: torch.Tensor
) -> torch.Tensor | None:
    """Backward of a table gather: row pairs to the accumulator of an armed table (returns
    None: no dense gradient), else autograd's dense gradient of the shard (None for a frozen
    table: ``requires_grad`` off)."""
    if not weight.requires_grad:
        return None
    accumulator = getattr(weight, ROW_GRAD_ATTR, None)
    if accumulator is not None:
        accumulator.add(rows, grad_rows)
        return None
    dense = torch.zeros(weight.shape, dtype=grad_rows.dtype, device=weight.device)
    dense.index_add_(0, rows.to(weight.device), grad_rows.to(weight.device, dense.dtype))
    return dense


def read_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``weight[rows]`` on ``rows``' device, through the host staging path for a host-resident
    table (``engram/host_table.py``); an fp8 table's rows dequantized to bfloat16
    (``engram/fp8_table.py``). No autograd: callers route the gradient rows."""
    if is_fp8_table(weight):
        if not is_host_resident(weight):
            return read_fp8_rows(weight, rows)
        values = read_host_rows(weight, rows)  # waits for rows an overlapped update changes
        scale = table_scale(weight).index_select(0, rows.to("cpu")).to(values.device)
        return dequantize_rows(values, scale)
    if is_host_resident(weight):
        return read_host_rows(weight, rows)
    return torch.nn.functional.embedding(rows, weight.detach())


class _GatherTableRows(torch.autograd.Function):
    """``weight[rows]`` (shard-local rows; with ``owned``, zeros where False); its backward hands
    row gradients to ``deliver_row_grad`` instead of building a dense table gradient."""

    @staticmethod
    def forward(ctx, weight, rows, owned):
        ctx.weight = weight  # the accumulator hangs on the parameter itself
        if owned is None:
            ctx.save_for_backward(rows)
            return read_rows(weight, rows)
        kept = rows[owned]
        ctx.save_for_backward(kept, owned)
        values = read_rows(weight, torch.where(owned, rows, 0))
        return values * owned.unsqueeze(-1).to(values.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # read once: torch's non-reentrant checkpoint unpacks once
        if len(saved) == 1:
            (rows,) = saved
            grad_rows = grad
        else:
            rows, owned = saved
            grad_rows = grad[owned]
        return deliver_row_grad(ctx.weight, rows, grad_rows.contiguous()), None, None


def gather_rows(
    weight: torch.nn.Parameter, rows: torch.Tensor, owned: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [n] of a table shard -> [n, D], row-sparse in backward (see module docstring).

    ``owned`` (bool [n]) masks rows held elsewhere: they read as zeros and get no gradient
    (the vocab-parallel partial lookup)."""
    return _GatherTableRows.apply(weight, rows, owned)
