"""Quiet, useful logs: third-party warnings that say nothing actionable are filtered once at
start-up, and the console's iteration and validation lines also go to ``train.log``.

`KNOWN_WARNINGS` lists every filtered message with where it comes from and why it is not
actionable here (README, "Outputs", repeats the list). ``ENGRAM_SHOW_WARNINGS=1`` keeps them all.
This module imports nothing heavy: the trainer calls `quiet_known_warnings` before torch or
megatron-core are imported, so that warnings raised at import time are filtered too.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

SHOW_ALL = "ENGRAM_SHOW_WARNINGS"


@dataclass(frozen=True)
class KnownWarning:
    pattern: str  # regular expression matched against the start of the message
    source: str  # who emits it
    kind: str  # "warning" (Python warnings) or the logger's name (logging)
    why: str  # why it is not actionable here
    cpu_only: bool = False  # filtered only on hosts without CUDA


KNOWN_WARNINGS = (
    KnownWarning(r".*(Apex|Transformer Engine)\b.* not installed", "megatron-core", "warning",
                 "optional GPU packages absent: megatron falls back to torch modules (the local spec "
                 "the project uses on CPUs anyway)"),
    KnownWarning(r".*full scope is deprecated", "megatron-core", "warning",
                 "megatron's own default for cuda_graph_scope (no CUDA graphs are used here)"),
    KnownWarning(r".*is deprecated\. Please use `torch\.distributed", "torch (called by megatron-core)",
                 "warning", "megatron-core calls a deprecated torch.distributed function"),
    KnownWarning(r".*\.grad attribute of a Tensor that is not a leaf", "torch (megatron-core's "
                 "optimizer)", "warning", "megatron reads .grad of its non-leaf main parameters on purpose"),
    KnownWarning(r".*`load_state_dict` is deprecated and will be removed", "torch.distributed.checkpoint "
                 "(called by megatron-core)", "warning", "megatron-core's checkpoint loader uses the old name (seen on resume)"),
    KnownWarning(r".*Please use DTensor instead and we are deprecating ShardedTensor",
                 "torch.distributed.checkpoint (called by megatron-core)", "warning",
                 "megatron-core's checkpoints are ShardedTensor-based (seen on resume)"),
    KnownWarning(r"When using sequence parallelism it is recommended to set the environment "
                 r"variable CUDA_DEVICE_MAX_CONNECTIONS", "megatron-core", "warning",
                 "a CUDA setting; on a GPU it stays (set CUDA_DEVICE_MAX_CONNECTIONS=1)", cpu_only=True),
    KnownWarning(r"CPU RNG state changed within GPU RNG context", "megatron-core",
                 "megatron.core.tensor_parallel.random",
                 "on a CPU-only host the 'GPU' RNG state is the CPU generator (docs/cpu.md), so "
                 "every forward of the Python API trips this check", cpu_only=True),
)


class _DropKnown(logging.Filter):
    def __init__(self, patterns):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_installed = False


def quiet_known_warnings(cuda: bool | None = None) -> bool:
    """Filter `KNOWN_WARNINGS` (once per process); ``ENGRAM_SHOW_WARNINGS=1`` keeps every one.
    ``cuda``: whether CUDA is present (None: decided without importing torch when possible).
    Returns True when the filters are in force."""
    global _installed
    if os.environ.get(SHOW_ALL, "0") not in ("", "0"):
        return False
    if _installed:
        return True
    _installed = True
    if cuda is None:
        cuda = _cuda_present()
    by_logger: dict[str, list[str]] = {}
    for known in KNOWN_WARNINGS:
        if known.cpu_only and cuda:
            continue
        if known.kind == "warning":
            warnings.filterwarnings("ignore", message=known.pattern)
        else:
            by_logger.setdefault(known.kind, []).append(known.pattern)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropKnown(patterns))
    # megatron logs every parameter name at INFO while building the optimizer; keep its warnings.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return True


def _cuda_present() -> bool:
    """CUDA without importing torch when torch is not loaded yet: a visible NVIDIA device."""
    import sys

    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


def console(line: str) -> None:
    """Print a console line (an iteration, a validation, where an output went) and append it to
    the run's log files (Hydra's ``<exp_dir>/train.log``) exactly as printed."""
    print(line, flush=True)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            handler.acquire()
            try:
                handler.stream.write(line + "\n")
                handler.flush()
            finally:
                handler.release()
