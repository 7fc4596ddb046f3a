"""Free space: checked before a save, and a failed save told apart as a full disk."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from engram_train.checkpoint.checkpoint_errors import CheckpointSpaceError
from engram_train.checkpoint.manifest import checkpoint_bytes, rank_world

# Free space below this after a failed write means the disk filled up (when the size a
# checkpoint needs is not known).
_FULL_DISK_BYTES = 16 << 20
# Headroom on top of a checkpoint's size for the free-space check (metadata, rounding).
_SPACE_MARGIN = 1.05


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would, once created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_free_space(root: str | os.PathLike, need: int | None, what: str) -> None:
    """Raise `CheckpointSpaceError` (on every rank: rank 0 decides) unless ``root`` has room for
    a checkpoint the size of the newest one already there (else ``need`` bytes)."""
    root = Path(root)
    previous = checkpoint_bytes(root)
    need = previous or need  # a checkpoint already written is the best estimate
    message = None
    rank, world = rank_world()
    if rank == 0 and need:
        free = free_bytes(root)
        if free < need * _SPACE_MARGIN:
            source = "the size of the newest checkpoint" if previous else "estimated"
            message = (
                f"not enough free space to {what} in {root}: {gib(free)} free, about "
                f"{gib(need)} needed ({source}). Nothing was written; free space or point "
                "checkpoint.save at a larger disk"
            )
    if world > 1:
        holder = [message]
        dist.broadcast_object_list(holder, src=0)
        message = holder[0]
    if message:
        raise CheckpointSpaceError(message)


def _dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # removed meanwhile (another rank cleaning up)
            pass
    return total


def is_no_space(exc: BaseException, root: Path, tmp: Path, need: int | None) -> bool:
    """Did a failed save run out of space? megatron's writer processes report a full disk as
    a torch serialization error ("unexpected pos ..."), without the errno, so besides the
    exception chain this asks the file system: free space plus what the partial checkpoint
    holds (a sum that its removal by another rank does not change) below what it needs."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        stack += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # torch's CheckpointException:
            stack.append(failure[0] if isinstance(failure, tuple) else failure)  # (exc, trace)
    try:
        available = free_bytes(root) + _dir_bytes(tmp)
    except OSError:
        return False
    return available < (need * _SPACE_MARGIN if need else _FULL_DISK_BYTES)
