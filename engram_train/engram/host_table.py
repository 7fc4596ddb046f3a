"""Host-resident Engram tables (``engram_table_placement: host``).

A table's addresses are known from token ids, and a step reads a few rows of it, so the table
need not live in device memory: with ``host`` placement each rank's shard (and its optimizer
state, ``training/engram_optimizer.py``) stays in host memory, pinned when CUDA is present,
and the device holds only the rows in flight. Device memory used by Engram tables is then
independent of their size; host RAM is the limit (``host_table_bytes``, checked at start by the
trainer).

A lookup on a host table (``read_rows``):
1. the requested shard-local rows go to the host (one small id copy);
2. the rows are gathered there into a staging buffer (pinned under CUDA; ``index_select`` runs
   on torch's intra-op threads);
3. the staging buffer is copied to the compute device on a side stream, and the compute stream
   waits for that copy only (``record_stream`` keeps the buffer alive until it is consumed).
Gradient rows stay on the compute device (the row gradient sync runs there) and cross to the
host once per step, at the table optimizer's step, which runs on the host.

On a machine without CUDA the host and the compute device are the same memory: steps 1 and 3
are no-ops and the path differs from ``device`` placement only by the staging gather, so both
placements give bit-identical results (which the tests check).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

HOST_ATTR = "engram_host_resident"
PENDING_ATTR = "engram_pending_update"  # the rows an overlapped update is still changing


@dataclass
class HostTableTimes:
    """Seconds spent on host tables since the last ``reset`` (benchmarks, metrics):
    ``gather_s`` gathering rows on the host, ``copy_s`` issuing their copies to the device,
    ``update_s`` in the host optimizer step (set by the table optimizer), ``wait_s`` the part
    of it on the training thread's critical path (all of it for a synchronous update; launching
    plus waiting for rows still in flight for an overlapped one, ``training/host_update.py``)."""

    gather_s: float = 0.0
    copy_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0
    rows: int = 0

    def reset(self) -> None:
        self.gather_s = self.copy_s = self.update_s = self.wait_s = 0.0
        self.rows = 0


HOST_TABLE_TIMES = HostTableTimes()


def is_host_resident(weight: torch.Tensor) -> bool:
    return bool(getattr(weight, HOST_ATTR, False))


@torch.no_grad()
def make_host_resident(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Move a table parameter's storage to host memory (pinned when CUDA is present) in place,
    keeping the Parameter object (the model, the optimizer and checkpoints refer to it), and
    mark it so lookups read it through the staging path."""
    pin = torch.cuda.is_available()
    if param.device.type != "cpu" or (pin and not param.is_pinned()):
        host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
        host.copy_(param.data)
        param.data = host
    setattr(param, HOST_ATTR, True)
    return param


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]


def finish_pending_updates(model) -> None:
    """Wait for every overlapped host update still changing a table of ``model`` (a module or
    a list of them), before the tables are read as a whole (a checkpoint, a NaN check); raises
    the update's error if it failed (``training/host_update.py``)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for param in chunk.parameters():
            pending = getattr(param, PENDING_ATTR, None)
            if pending is not None:
                pending.finish()


def read_host_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``weight[rows]`` of a host-resident shard, delivered on ``rows``' device (see the module
    docstring). Not differentiable by itself: the callers' autograd functions route the
    gradient rows (``engram/row_grad.py``)."""
    host_rows = rows.to("cpu")  # the ids a CUDA caller routed; a no-op on CPU
    pending = getattr(weight, PENDING_ATTR, None)
    if pending is not None:  # step t's update still in flight: wait for the shared rows only
        pending.wait_for(host_rows)
    start = time.perf_counter()
    staging = torch.empty((host_rows.numel(), weight.shape[1]), dtype=weight.dtype,
                          pin_memory=rows.is_cuda)
    torch.index_select(weight.detach(), 0, host_rows, out=staging)
    gathered = time.perf_counter()
    HOST_TABLE_TIMES.gather_s += gathered - start
    HOST_TABLE_TIMES.rows += host_rows.numel()
    if not rows.is_cuda:
        return staging
    stream = _copy_stream(rows.device)
    stream.wait_stream(torch.cuda.current_stream(rows.device))
    with torch.cuda.stream(stream):
        values = staging.to(rows.device, non_blocking=True)
    torch.cuda.current_stream(rows.device).wait_stream(stream)
    values.record_stream(torch.cuda.current_stream(rows.device))
    HOST_TABLE_TIMES.copy_s += time.perf_counter() - gathered
    return values


def table_bytes_per_param(table_dtype_bytes: float, *, master: bool, optimizer: str = "sparse_adam",
                          state_dtype_bytes: int = 4, row_width: int = 1,
                          frozen: bool = False, row_moment_bytes: int = 4) -> float:
    """Bytes per table parameter of a table with its optimizer state: the value (an fp8 table's
    1 byte plus its E8M0 scale's share), a float32 master (``master``), and the Adam moments:
    none for ``frozen`` (fp8 tables without state), two float32 per element (``sparse_adam``,
    ``adam``), or a first moment of ``state_dtype_bytes`` per element plus one second moment
    of ``row_moment_bytes`` (float32; bf16 for fp8 tables) per row of ``row_width`` elements
    (``rowwise_adam``)."""
    if frozen:
        moments = 0.0
    elif optimizer == "rowwise_adam":
        moments = state_dtype_bytes + row_moment_bytes / row_width
    else:
        moments = 8
    return table_dtype_bytes + (4 if master else 0) + moments


def host_table_bytes(num_params: int, table_dtype_bytes: float, mixed_precision: bool,
                     **options) -> int:
    """Host bytes a host-resident shard of ``num_params`` needs with its optimizer state (a
    float32 master for a low-precision table when ``mixed_precision``; ``options`` as for
    ``table_bytes_per_param``)."""
    per_param = table_bytes_per_param(table_dtype_bytes, master=mixed_precision, **options)
    return int(num_params * per_param)


def available_host_bytes() -> int | None:
    """``MemAvailable`` of this host (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
