"""What a save directory holds, and changing it safely.

Layout of ``<save>/``::

  iter_0000100/                          one dist_checkpointing directory per saved iteration
      manifest.json                      size and SHA-256 of every file, and the run identity
  latest_checkpointed_iteration.txt      the newest complete iteration
  iter_0000100.tmp/  iter_0000100.old/   left by a failed or interrupted save (removed)
  iter_0000100.diverged/                 set aside after a divergence (never loaded)

A directory named ``iter_N`` is complete once it exists (saves write ``iter_N.tmp`` and rename
it), and the tracker only ever names a complete checkpoint. Plain files and ``os`` only: no
megatron, so the trainer's checks run before any process group or heavy import.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
SET_ASIDE_SUFFIX = ".diverged"

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER_DIR = re.compile(r"^iter_(\d{7,})\.(tmp|old)$")


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def iteration_of(path: str | os.PathLike) -> int | None:
    """The iteration an ``iter_N`` directory name stands for, else None."""
    match = _ITER_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file, never part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tracker(root: str | os.PathLike) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``; None without a usable one."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        log.warning("%s holds %r, not an iteration: ignored", tracker, text[:40])
        return None


def _is_complete(path: Path) -> bool:
    # Ours have a manifest (written before the rename); megatron's metadata.json marks a
    # dist_checkpointing directory written before manifests existed.
    return (path / MANIFEST).is_file() or (path / "metadata.json").is_file()


def list_checkpoints(root: str | os.PathLike) -> list[int]:
    """Iterations of the complete ``iter_*`` directories under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _ITER_DIR.match(path.name)
        if m and path.is_dir() and _is_complete(path):
            found.append(int(m.group(1)))
    return sorted(found)


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration a resume starts from: the tracker's, else the newest complete ``iter_*``."""
    tracker = read_tracker(root)
    if tracker is not None:
        return tracker
    found = list_checkpoints(root)
    return found[-1] if found else None


def has_checkpoints(root: str | os.PathLike) -> bool:
    return read_tracker(root) is not None or bool(list_checkpoints(root))


def remove_leftovers(root: str | os.PathLike) -> list[Path]:
    """Remove ``iter_*.tmp`` (failed or interrupted saves) and ``iter_*.old`` directories."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if _LEFTOVER_DIR.match(path.name) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():  # a read-only folder keeps it
                    removed.append(path)
    return removed


def retract_checkpoints(root: str | os.PathLike, set_aside: list[int], below: int) -> tuple[list[str], int | None]:
    """Take checkpoints out of service after a divergence (rank 0 only).

    Each ``iter_N`` of ``set_aside`` is renamed ``iter_N.diverged`` (kept for inspection; no
    loader, scan or cleanup picks it up), and the tracker is pointed at the newest complete
    checkpoint below iteration ``below``, or removed when there is none. Returns the new names
    and the iteration the tracker now names.
    """
    root = Path(root)
    renamed = []
    for iteration in sorted(set_aside):
        path = iteration_dir(root, iteration)
        if not path.is_dir():
            continue
        target, n = path.with_name(path.name + SET_ASIDE_SUFFIX), 1
        while target.exists():  # set aside before, by an earlier run
            target, n = path.with_name(f"{path.name}{SET_ASIDE_SUFFIX}.{n}"), n + 1
        os.replace(path, target)
        renamed.append(target.name)
    good = [i for i in list_checkpoints(root) if i < below]
    latest = good[-1] if good else None
    if latest is not None:
        if read_tracker(root) != latest:
            write_atomic(root / TRACKER, str(latest))
    else:
        (root / TRACKER).unlink(missing_ok=True)
    fsync_dir(root)
    return renamed, latest
