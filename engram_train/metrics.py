"""Training metrics: Megatron-style console lines, ``metrics.jsonl`` and TensorBoard scalars.

One logging rank writes (`is_logging_rank`: the last pipeline stage, where the loss is known,
data-parallel, tensor-parallel and context-parallel rank 0). Everything here is cheap and takes
plain Python numbers (0-dim tensors are accepted and read with ``float``).

``<exp_dir>/metrics.jsonl`` holds one JSON object per logged iteration::

    {"iteration": 10, "lm_loss": 5.12, "lr": 0.0001, "grad_norm": 1.23,
     "tokens_per_s": 1234.0, "step_time_s": 0.123}
    {"iteration": 20, ..., "val_loss": 5.01}        # val_loss only on evaluation iterations

A key is left out when the value was not given; a non-finite value (a diverged loss) is written
as ``null`` so that every line stays strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_GIB = float(1 << 30)


def memory_usage() -> tuple[str, float, float]:
    """``(label, current GiB, peak GiB)`` of this process's device memory.

    On a GPU: allocated and max-allocated memory of the current CUDA device. On the CPU: the
    resident set size (psutil) and the peak RSS (``getrusage``).
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return (
            "alloc/max",
            torch.cuda.memory_allocated() / _GIB,
            torch.cuda.max_memory_allocated() / _GIB,
        )
    import resource
    import sys

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return "rss/max", rss / _GIB, max(peak, rss) / _GIB


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    step_time_s: float,
    lr: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    tokens_per_s: float | None = None,
    grad_norm: float | None = None,
    extra: Mapping[str, float] | None = None,
    memory: bool = True,
    now: float | None = None,
) -> str:
    """One Megatron-style training log line (field layout of Megatron-LM's ``training_log``).

    `losses` maps names to values, e.g. ``{"lm loss": 5.1, "engram aux": 0.2}``; `extra` adds
    more ``name: value`` fields before the memory field.
    """
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    parts = [
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {step_time_s * 1000.0:.1f}",
    ]
    if tokens_per_s is not None:
        parts.append(f" tokens/s: {float(tokens_per_s):.0f}")
    parts += [f" learning rate: {float(lr):.6E}", f" global batch size: {global_batch_size:5d}"]
    parts += [f" {name}: {float(value):.6E}" for name, value in losses.items()]
    if grad_norm is not None:
        parts.append(f" grad norm: {float(grad_norm):.3f}")
    for name, value in (extra or {}).items():
        parts.append(f" {name}: {float(value):.4g}")
    if memory:
        label, now_gib, peak_gib = memory_usage()
        parts.append(f" mem (GiB) {label}: {now_gib:.2f}/{peak_gib:.2f}")
    return " |".join(parts) + " |"


def format_eval_line(iteration: int, losses: Mapping[str, float], split: str = "validation") -> str:
    """Megatron-style evaluation line: ``validation loss at iteration 100 | lm loss value: ...``."""
    parts = [f" {split} loss at iteration {iteration}"]
    for name, value in losses.items():
        value = float(value)
        parts.append(f" {name} value: {value:.6E}")
        parts.append(f" {name} PPL: {math.exp(min(20.0, value)):.6E}")
    return " |".join(parts) + " |"


def is_logging_rank() -> bool:
    """True on the rank that owns the loss: the last pipeline stage's first data-, tensor- and
    context-parallel rank. Without megatron's model-parallel state: the last global rank (or
    True without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dist.get_rank() == dist.get_world_size() - 1
    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_data_parallel_rank() == 0
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def _clean(value) -> float | int | None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsWriter:
    """Appends per-iteration metrics to ``<exp_dir>/metrics.jsonl`` and TensorBoard scalars to
    ``<exp_dir>/tensorboard``; a no-op when not `enabled` (every rank but the logging one).

    Args:
        exp_dir: the run folder.
        enabled: write on this rank (see `is_logging_rank`).
        tensorboard: also write TensorBoard scalars.
        resume_iteration: when resuming from a checkpoint at this iteration, drop the records
            after it (they belong to the abandoned continuation) from metrics.jsonl and from
            TensorBoard, so that each iteration appears once.
    """

    # TensorBoard tag for each metrics.jsonl key; other keys go to "train/<key>".
    TAGS = {
        "lm_loss": "train/lm_loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s",
        "step_time_s": "train/step_time_s",
        "val_loss": "val/lm_loss",
    }

    def __init__(
        self,
        exp_dir: str | os.PathLike,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_iteration: int | None = None,
    ) -> None:
        self.exp_dir = Path(exp_dir)
        self.path = self.exp_dir / METRICS_FILE
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.exp_dir.mkdir(parents=True, exist_ok=True)
        if resume_iteration is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and json.loads(line).get("iteration", 0) <= resume_iteration
            ]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_iteration is None else resume_iteration + 1
            self._tb = SummaryWriter(str(self.exp_dir / TENSORBOARD_DIR), purge_step=purge)

    def log(
        self,
        iteration: int,
        *,
        lm_loss: float | None = None,
        lr: float | None = None,
        grad_norm: float | None = None,
        tokens_per_s: float | None = None,
        step_time_s: float | None = None,
        val_loss: float | None = None,
        **extra: float,
    ) -> dict | None:
        """Write one record (the given values only) and flush; returns the record."""
        if not self.enabled:
            return None
        values = dict(
            lm_loss=lm_loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
            step_time_s=step_time_s, val_loss=val_loss, **extra,
        )  # fmt: skip
        record = {"iteration": int(iteration)}
        record.update({k: _clean(v) for k, v in values.items() if v is not None})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "iteration" and value is not None and not isinstance(value, bool):
                    self._tb.add_scalar(self.TAGS.get(key, f"train/{key}"), value, iteration)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
