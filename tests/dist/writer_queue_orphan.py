"""The forked checkpoint-queue manager ends with its parent: this process starts it, checks the
queue answers, prints its own pid and the manager's, and ends without its exit handlers (as a
test worker may end). tests/test_patches.py then waits for the manager to be gone."""

from __future__ import annotations

import multiprocessing
import os

from engram_train.runtime.cpu_compat import _forked_write_results_queue


def main() -> None:
    queue = _forked_write_results_queue()
    queue.put(os.getpid())
    assert queue.get() == os.getpid()
    managers = [child.pid for child in multiprocessing.active_children()]
    assert len(managers) == 1, managers
    print(os.getpid(), managers[0], flush=True)
    os._exit(0)  # without exit handlers


if __name__ == "__main__":
    main()
