"""One writer per ``checkpoint.save`` folder: an advisory ``fcntl`` lock on a file in it, taken
by the saving rank before anything is written and held for the run's life (the kernel releases
it when the process ends, however it ends).

Two runs saving into one folder would remove each other's ``iter_N.tmp`` as leftovers of a
failed save; the second run is refused at start instead, naming the holder. The lock file
records who holds it; finding it free but naming a process that is gone (killed before its
exit), or holding content that names no one (binary garbage, a torn write), is said in a warning
and the lock taken over. A lock path that cannot be opened (a directory in its place) is a
`CheckpointError` naming it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from engram_train.checkpoint.checkpoint_errors import CheckpointError, CheckpointFolderInUseError

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


def _read_holder(f) -> tuple[dict, bool]:
    """(the holder the lock file records, whether its content is unreadable): a file that is
    not the JSON object this module writes (binary garbage, a torn write, another program's
    file) names no holder."""
    f.seek(0)
    raw = f.read()
    if not raw.strip():
        return {}, False
    try:
        holder = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return {}, True
    if not isinstance(holder, dict):
        return {}, True
    return holder, False


def _open_lock_file(root: Path, path: Path):
    """The lock file, opened for reading and appending; a path that cannot be one (a directory,
    a file this user may not open) is a `CheckpointError` naming it and the fix."""
    try:
        return open(path, "a+b")
    except IsADirectoryError:
        raise CheckpointError(
            f"checkpoint.save={root}: the lock file {path} is a directory, so no run can take the "
            f"folder's lock. It is not part of any checkpoint: remove it (rm -r {path}) and start "
            "the run again, or choose another checkpoint.save"
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.save={root}: cannot open the lock file {path} ({e.strerror}). Make it a "
            "file this user can write (or remove it: it holds no checkpoint data), or choose "
            "another checkpoint.save"
        ) from None


def lock_save_folder(root: str | os.PathLike) -> Path:
    """Take the lock of ``root`` for this process (again: no-op); returns the lock file.
    Raises `CheckpointFolderInUseError` naming the holder's host and pid, or `CheckpointError`
    when the lock file cannot be opened (a directory in its place, no permission). A lock file
    with unreadable content held by no live process is taken over with a warning, like one
    naming a process that is gone."""
    root = Path(root).resolve()
    if root in _held:
        return root / LOCK_FILE
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    f = _open_lock_file(root, path)
    holder, garbled = _read_holder(f)
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
    if garbled:
        log.warning("%s: taking over the lock, whose file %s held unreadable content and no live "
                    "process held it", root, path)  # fmt: skip
    elif holder.get("pid") and (holder.get("host") != socket.gethostname() or not _alive(holder["pid"])):
        log.warning("%s: taking over the lock of run pid %s on %s, which is gone", root, holder["pid"],
                    holder.get("host"))  # fmt: skip
    f.seek(0)
    f.truncate()
    f.write((json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode())  # fmt: skip
    f.flush()
    _held[root] = f
    return path


def _alive(pid) -> bool:
    """`process_alive` for a recorded pid; one that is not a positive number names no process."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    return pid > 0 and process_alive(pid)
