"""Saving (every rank), so that no run resumes from a damaged, partial or non-finite checkpoint:

1. parameters holding NaN/inf are refused (`NonFiniteStateError`): nothing is written;
2. free space is checked against the size of the previous checkpoint (or an estimate);
3. rank 0 removes ``iter_*.tmp`` directories left by failed saves and creates ``iter_N.tmp``;
4. ``dist_checkpointing.save`` writes into it; a full disk is reported as such
   (`CheckpointSpaceError`) and the partial directory removed;
5. the ranks hash a share of the files each; rank 0 writes ``manifest.json`` into the
   ``.tmp`` directory, renames it into place and then replaces the tracker atomically.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from engram_train.checkpoint.disk import check_free_space, free_bytes, gib, is_no_space
from engram_train.checkpoint.checkpoint_errors import CheckpointError, CheckpointSpaceError, NonFiniteStateError
from engram_train.checkpoint.layout import (
    MANIFEST,
    TRACKER,
    fsync_dir,
    iteration_dir,
    read_tracker,
    remove_leftovers,
    write_atomic,
)
from engram_train.checkpoint.manifest import (
    MANIFEST_FORMAT,
    checkpoint_bytes,
    digests,
    files_of,
    rank_world,
)
from engram_train.engram.host_table import finish_pending_updates
from engram_train.checkpoint.state import (
    as_chain,
    full_sharded_state_dict,
    nonfinite_parameter,
    save_metadata,
)

log = logging.getLogger(__name__)


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    model: list[torch.nn.Module],
    optimizer=None,
    extra: dict[str, Any] | None = None,
    *,
    run_identity: dict | None = None,
    check_space: bool = True,
    space_estimate: int | None = None,
) -> Path:
    """Save model (+ optimizer, + ``extra`` common state) for ``iteration``; returns its dir.

    ``run_identity`` goes into the manifest (what a resume must agree with, see
    `engram_train.training.run_identity`). Raises `NonFiniteStateError` (nothing written),
    `CheckpointSpaceError` (disk full: before writing when ``check_space``, else while
    writing; the partial directory is removed) or `CheckpointError`.
    """
    root = Path(root)
    rank, _ = rank_world()
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    finish_pending_updates(model)  # an overlapped host table update completes (or raises) first
    bad = nonfinite_parameter(model)
    if bad:
        raise NonFiniteStateError(
            f"refusing to save iteration {iteration}: parameter {bad[1]} (rank {bad[0]}) holds NaN "
            "or inf; such a state is never saved, and nothing was written"
        )
    if check_space:
        check_free_space(root, space_estimate, f"save iteration {iteration}")

    def start() -> None:
        for path in remove_leftovers(root):
            log.warning("removed %s, left by a failed or interrupted save", path)
        tmp.mkdir(parents=True)

    _on_rank0(start, root, tmp, iteration)
    started = time.perf_counter()
    metadata = save_metadata()
    state = full_sharded_state_dict(model, optimizer and as_chain(optimizer), is_loading=False,
                                    metadata=metadata)
    state["iteration"] = iteration
    state["extra"] = extra or {}
    try:
        dist_checkpointing.save(state, str(tmp), content_metadata=metadata)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        no_space = is_no_space(e, root, tmp, checkpoint_bytes(root) or space_estimate)
        kept = _what_is_kept(root, tmp, created=True)
        if no_space:
            raise CheckpointSpaceError(
                f"saving iteration {iteration} to {root} failed: no space left on device "
                f"({gib(free_bytes(root))} free after removing the partial "
                f"checkpoint). {kept} Free space or point checkpoint.save at a larger disk, then "
                f"resume with checkpoint.load={root}"
            ) from e
        raise CheckpointError(f"saving iteration {iteration} to {root} failed: {e}. {kept}") from e
    dist.barrier()
    holder = [files_of(tmp) if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    file_digests = digests(tmp, holder[0])  # the same on every rank
    unreadable = {n: d for n, d in file_digests.items() if isinstance(d, str)}
    if unreadable:
        raise CheckpointError(f"saving iteration {iteration}: cannot read back {unreadable}")
    contents = ["model"] if optimizer is None else ["model", "optimizer"]
    _on_rank0(lambda: _publish(root, tmp, final, iteration, file_digests, run_identity, contents),
              root, tmp, iteration)  # fmt: skip
    if rank == 0:
        size = sum(s for s, _ in file_digests.values())
        log.info("saved %s (%s, %.1f s)", final, gib(size), time.perf_counter() - started)
    return final


def _what_is_kept(root: Path, tmp: Path, created: bool = False) -> str:
    """After a failed save: what became of its partial directory (removed here; ``created``:
    the save had made it, and another rank or the free-space probe may have removed it first),
    and the newest complete checkpoint (untouched)."""
    partial = None
    existed = tmp.is_dir()  # not a file in the way: that is no save's
    if existed:
        shutil.rmtree(tmp, ignore_errors=True)
    if tmp.is_dir():
        partial = f"The partial {tmp.name} could not be removed (the next save removes it)"
    elif (existed or created) and not tmp.exists():
        partial = f"The partial {tmp.name} was removed"
    latest = read_tracker(root)
    newest = None if latest is None else f"the newest complete checkpoint is still {iteration_dir(root, latest).name}"
    said = "; ".join(part for part in (partial, newest) if part)
    return f"{said[0].upper()}{said[1:]}." if said else ""


def _on_rank0(step, root: Path, tmp: Path, iteration: int) -> None:
    """Run rank 0's part of a save (``step``: its directory operations), then the same outcome
    on every rank: an `OSError` there (the folder turned read-only, a file in the way) is a
    `CheckpointError` on all of them, naming the path and the fix, and nothing older is touched.
    Also the barrier that lets the other ranks go on once rank 0 is done."""
    failure = None
    if rank_world()[0] == 0:
        try:
            step()
        except OSError as e:
            where = e.filename or root
            if isinstance(e, PermissionError) or e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                fix = f"Make {root} writable for this user (or point checkpoint.save at a writable folder)"
            elif isinstance(e, FileExistsError):
                fix = f"Move {where} out of the way (a save writes a directory of that name)"
            else:
                fix = f"Fix {where} (or point checkpoint.save at another folder)"
            kept = _what_is_kept(root, tmp)
            failure = (f"saving iteration {iteration} to {root} failed: {e.strerror or e}: {where}. "
                       f"{kept + ' ' if kept else ''}{fix}, then resume with checkpoint.load={root}")  # fmt: skip
    holder = [failure]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    if holder[0] is not None:
        raise CheckpointError(holder[0])


def _publish(root: Path, tmp: Path, final: Path, iteration: int, file_digests: dict,
             run_identity: dict | None, contents: list[str]) -> None:
    """Rank 0: the manifest into ``iter_N.tmp``, the rename to ``iter_N``, then the tracker;
    each step durable before the next, so a crash leaves the old or the new state, never a mix."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "iteration": iteration,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": dist.get_world_size(),
        "files": {n: {"size": s, "sha256": h} for n, (s, h) in sorted(file_digests.items())},
        "run": run_identity or {},
        "contents": contents,  # ["model"]: weights only (an import); a resume starts the optimizer
    }
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    fsync_dir(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same iteration saved again (e.g. after a fallback)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old.exists() and not final.exists():  # the earlier save of this iteration stays
            os.replace(old, final)
        raise
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    write_atomic(root / TRACKER, str(iteration))
    fsync_dir(root)
