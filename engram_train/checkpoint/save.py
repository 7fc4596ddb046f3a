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
from engram_train.checkpoint.errors import CheckpointError, CheckpointSpaceError, NonFiniteStateError
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
    if rank == 0:
        for path in remove_leftovers(root):
            log.warning("removed %s, left by a failed or interrupted save", path)
        tmp.mkdir(parents=True)
    dist.barrier()
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
        shutil.rmtree(tmp, ignore_errors=True)
        latest = read_tracker(root)
        kept = (
            f"The partial {tmp.name} was removed; the newest complete checkpoint is still "
            f"{iteration_dir(root, latest).name}." if latest is not None
            else f"The partial {tmp.name} was removed."
        )
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
    if rank == 0:
        _publish(root, tmp, final, iteration, file_digests, run_identity,
                 contents=["model"] if optimizer is None else ["model", "optimizer"])
        size = sum(s for s, _ in file_digests.values())
        log.info("saved %s (%s, %.1f s)", final, gib(size), time.perf_counter() - started)
    dist.barrier()
    return final


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
    os.replace(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    write_atomic(root / TRACKER, str(iteration))
    fsync_dir(root)
