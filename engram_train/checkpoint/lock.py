"""One writer per ``checkpoint.save`` folder: an advisory ``fcntl`` lock on a file in it, taken
by the saving rank before anything is written and held for the run's life (the kernel releases
it when the process ends, however it ends).

Two runs saving into one folder would remove each other's ``iter_N.tmp`` as leftovers of a
failed save; the second run is refused at start instead, naming the holder. The lock file
records who holds it; finding it free but naming a process that is gone (killed before its
exit) is said in a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from engram_train.checkpoint.errors import CheckpointFolderInUseError

log = logging.getLogger(__name__)

LOCK_FILE = ".engram-train.lock"
_held: dict[Path, object] = {}  # folder -> open lock file, kept for the process's life


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_save_folder(root: str | os.PathLike) -> Path:
    """Take the lock of ``root`` for this process (again: no-op); returns the lock file.
    Raises `CheckpointFolderInUseError` naming the holder's host and pid."""
    root = Path(root).resolve()
    if root in _held:
        return root / LOCK_FILE
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    f = open(path, "a+")
    f.seek(0)
    text = f.read()
    try:
        holder = json.loads(text) if text.strip() else {}
    except ValueError:
        holder = {}
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise CheckpointFolderInUseError(
            f"checkpoint.save={root} is in use by another run (host {holder.get('host', '?')}, pid "
            f"{holder.get('pid', '?')}, since {holder.get('since', '?')}); two runs saving into one "
            "folder would delete each other's checkpoints in progress. Wait for that run to end or "
            "stop it, or choose another checkpoint.save"
        ) from None
    if holder.get("pid") and (holder.get("host") != socket.gethostname() or not process_alive(int(holder["pid"]))):
        log.warning("%s: taking over the lock of run pid %s on %s, which is gone", root, holder["pid"],
                    holder.get("host"))  # fmt: skip
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")  # fmt: skip
    f.flush()
    _held[root] = f
    return path
