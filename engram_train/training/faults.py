"""Faults a long run meets, turned into early, clear outcomes.

- `check_writable`: ``exp_dir`` and ``checkpoint.save`` are probed before any training (a
  read-only mount is found at start-up, not at the first save).
- `SkipNonFiniteUpdate`: megatron's optimizer step, except that a non-finite global gradient
  norm leaves parameters and optimizer state untouched; the loop counts such steps against
  ``train.nonfinite_skip_budget`` and stops without saving once it is spent.
- `ExitSignalHandler` + `StopCheck`: Megatron-LM's exit-signal pattern (its
  ``DistributedSignalHandler`` lives in ``megatron.training``, which megatron-core does not
  ship): a signal handler only records SIGTERM; at the end of every iteration all ranks agree
  (one small all-reduce, which also carries the wall-clock limit and the non-finite flag), save a
  checkpoint and leave the loop together.
- `children_die_with_parent`, `reap_process_group_on_exit`: processes forked by a rank
  (megatron's checkpoint writer processes) are killed when the rank dies, and so is what it
  spawned (under torchrun), so a ``kill -9`` leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from engram_train.errors import EngramError

log = logging.getLogger(__name__)


# -- paths --------------------------------------------------------------------------------------


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Create ``path`` if needed and write a probe file into it; `ConfigError` naming ``key``."""
    from engram_train.training.run_config import ConfigError

    from engram_train.output_paths import probe_write

    try:
        probe_write(path)
    except OSError as e:
        raise ConfigError(
            f"{key}={path} is not writable ({e.strerror or e}): choose a directory this job can "
            "write to"
        ) from None


# -- non-finite steps --------------------------------------------------------------------------


def _finite(value) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


class SkipNonFiniteUpdate:
    """A megatron optimizer whose ``step()`` skips the update when the gradient norm is not finite.

    ``step()`` is megatron's own (prepare grads, global grad norm, clip, and whatever else the
    installed megatron-core version does there), with the final ``step_with_ready_grads`` held
    back until the returned grad norm is known: a NaN/inf norm returns ``(False, norm, ...)``
    with parameters and optimizer state untouched. The norm is the same on every rank, so all
    ranks skip together. Everything else is the wrapped optimizer's (pass this to
    ``train_step``; checkpoints and the LR scheduler keep using the optimizer itself).
    """

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.skipped_nonfinite = False

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    @torch.no_grad()
    def step(self):
        opt = self.optimizer
        self.skipped_nonfinite = False
        held = []
        # An instance attribute shadows the method for this call only: megatron's step ends by
        # calling self.step_with_ready_grads() (unless it skips the step itself, as on an fp16
        # loss-scale overflow); here that call only records that it was due.
        opt.step_with_ready_grads = lambda: held.append(True) or True
        try:
            success, grad_norm, num_zeros = opt.step()
        finally:
            del opt.step_with_ready_grads
        if not held:
            return success, grad_norm, num_zeros
        if grad_norm is None or not opt.config.clip_grad > 0.0:  # megatron did not compute it
            grad_norm = opt.get_grad_norm()
        if not _finite(grad_norm):
            self.skipped_nonfinite = True
            return False, grad_norm, num_zeros
        return opt.step_with_ready_grads(), grad_norm, num_zeros


class NonFiniteTrainingError(EngramError, RuntimeError):
    """Non-finite steps exceeded ``train.nonfinite_skip_budget``; nothing was saved."""


# -- stopping on a signal or a time limit -------------------------------------------------------


class ExitSignalHandler:
    """Records the first of ``signals`` instead of dying (install in the main thread)."""

    def __init__(self, signals=(signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def install(self) -> ExitSignalHandler:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


@dataclass
class StopDecision:
    signal: bool = False
    time_limit: bool = False
    nonfinite: bool = False
    loss: float | None = None  # the step's LM loss, on every rank (NaN when it was not finite)

    @property
    def exit(self) -> bool:
        return self.signal or self.time_limit


class StopCheck:
    """One all-reduce (MAX) per iteration: did any rank get a signal, pass the wall-clock
    limit, or see a non-finite loss / grad norm? It also carries the step's LM loss from the
    last pipeline stage to every rank (for the divergence guard). Every rank gets the same
    answer."""

    def __init__(self, handler: ExitSignalHandler | None, exit_duration_mins: float | None,
                 start_time: float | None = None) -> None:
        self.handler = handler
        self.limit_s = None if exit_duration_mins is None else float(exit_duration_mins) * 60.0
        self.start = time.time() if start_time is None else start_time

    def __call__(self, nonfinite: bool, loss: float | None = None) -> StopDecision:
        import torch.distributed as dist

        from engram_train.runtime.distributed import device

        # A rank without the loss (not the last pipeline stage) sends -inf; a non-finite loss
        # travels as +inf (NaN has no order) and comes back as NaN.
        shared = -math.inf if loss is None else (float(loss) if math.isfinite(loss) else math.inf)
        flags = torch.tensor(
            [
                float(bool(self.handler and self.handler.received)),
                float(self.limit_s is not None and time.time() - self.start > self.limit_s),
                float(bool(nonfinite)),
                shared,
            ],
            device=device(), dtype=torch.float64,
        )  # fmt: skip
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signal_, time_limit, bad, shared = flags.tolist()
        agreed = None if shared == -math.inf else (math.nan if shared == math.inf else shared)
        return StopDecision(bool(signal_), bool(time_limit), bool(bad), agreed)


# -- child processes ----------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_at_fork_registered = False
_fork_parent = [0]


def _before_fork() -> None:
    _fork_parent[0] = os.getpid()


def _after_fork_in_child() -> None:
    # A forked child inherits the parent's Python SIGTERM handler (`ExitSignalHandler`), which
    # only records the signal: give it back the default, so that torchrun can stop it.
    if isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), ExitSignalHandler):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _fork_parent[0]:  # the parent died before the request took effect
        os._exit(1)


_GUARD = """
import ctypes, os, signal, sys
def reap(*_):
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the rank's process group, this process included
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)  # stay until the rank itself is gone
signal.signal(signal.SIGHUP, reap)
ctypes.CDLL(None).prctl(1, int(signal.SIGHUP), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    reap()
while True:
    signal.pause()
"""
_guard: list = []


def reap_process_group_on_exit() -> bool:
    """When this process leads its own session (as torchrun starts each rank), start a small
    guard process that kills the session's process group once this process is gone, however it
    ended. That takes along what megatron's checkpointing spawned (its result-queue manager and
    multiprocessing's resource tracker are started with exec, so `children_die_with_parent`
    cannot reach them). Returns whether a guard runs. Linux only."""
    import subprocess

    if _guard or sys.platform != "linux" or os.getsid(0) != os.getpid():
        return bool(_guard)
    _guard.append(subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid())], close_fds=True,
                                   stdin=subprocess.DEVNULL))  # fmt: skip
    return True


def children_die_with_parent() -> None:
    """Make every process this one forks from now on die (SIGKILL) when it dies. Linux only.

    megatron's checkpoint writer forks worker processes that write the shard files; if the rank
    is killed mid-save they would otherwise live on, holding files open. (A child forked from
    a thread that ends is killed at that point too: the kernel ties the signal to the thread.)
    """
    global _at_fork_registered
    if _at_fork_registered or sys.platform != "linux":
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _at_fork_registered = True
