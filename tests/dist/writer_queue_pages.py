"""The CPU layer's checkpoint-queue manager, started early, shares no pages of a model built
after it and outlives a SIGTERM to the rank's process group (torchrun's way of stopping a
rank, whose SIGTERM save still needs the manager). Prints one JSON line.

For comparison it also forks a second manager the way the first save used to (after the
tensor exists): the pages the process writes afterwards are copied into that one, which is
what the measurement is there to see.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from multiprocessing.managers import SyncManager

import psutil
import torch

from engram_train.runtime import install_cpu_compat
from engram_train.runtime.cpu_compat import _forked_write_results_queue, _manager_started, start_writer_queue_early
from engram_train.training.faults import ExitSignalHandler, children_die_with_parent

MIB = 2**20


def private_mib(pid: int) -> float:
    return psutil.Process(pid).memory_full_info().uss / MIB


def main() -> None:
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # a group of its own, as torchrun starts each rank
    signals = ExitSignalHandler().install()  # the trainer's: record SIGTERM, save, then exit
    children_die_with_parent()  # the trainer's: forked children get the default SIGTERM back
    install_cpu_compat()
    early = start_writer_queue_early()
    managers = multiprocessing.active_children()
    table = torch.empty(256 * MIB // 4)
    table.fill_(1.0)  # a host table, resident
    late = SyncManager(ctx=multiprocessing.get_context("fork"))
    late.start(_manager_started, (os.getpid(),))  # forked as at a first save
    table.fill_(2.0)  # every page written after the save: a resume's load, or many updates
    os.killpg(os.getpgid(0), signal.SIGTERM)  # torchrun stopping the rank
    queue = _forked_write_results_queue()
    queue.put("after SIGTERM")
    print(json.dumps(dict(
        started_early=early, early_managers=len(managers),
        early_private_mib=private_mib(managers[0].pid) if managers else None,
        late_private_mib=private_mib(late._process.pid),
        table_mib=table.numel() * 4 / MIB, queue_answers=queue.get(timeout=30) == "after SIGTERM",
        signal_recorded=signals.received,
    )), flush=True)
    late.shutdown()


if __name__ == "__main__":
    main()
