"""Choosing the checkpoint a resume loads: the tracker's, else the newest complete one, and
with ``fallback`` the newest intact older one when it is damaged (one rule and one message for
the trainer's early check and its load)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from engram_train.checkpoint.checkpoint_errors import DamagedCheckpointError
from engram_train.checkpoint.layout import MANIFEST, iteration_dir, list_checkpoints, read_tracker
from engram_train.checkpoint.manifest import read_manifest, check_checkpoint

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """The checkpoint a resume loads, and the newer ones passed over (with their problems)."""

    iteration: int
    path: Path
    manifest: dict | None
    found_by: str  # "tracker" or "scan"
    skipped: list[tuple[int, list[str]]] = field(default_factory=list)


def resume_candidates(root: str | os.PathLike) -> tuple[list[int], str]:
    """Iterations to try, newest first, and how the first was found.

    The tracker names the first (users roll back by editing it, as with Megatron-LM); older
    complete checkpoints follow. Without a tracker: every complete ``iter_*``, newest first.
    """
    tracker = read_tracker(root)
    complete = list_checkpoints(root)
    if tracker is not None:
        return [tracker] + [i for i in reversed(complete) if i < tracker], "tracker"
    return list(reversed(complete)), "scan"


def select_checkpoint(
    root: str | os.PathLike, *, fallback: bool = False, checksums: bool = True
) -> Selection | None:
    """The checkpoint to resume from under ``root`` (None when it holds none).

    Each candidate is checked (`check_checkpoint`); a damaged one raises
    `DamagedCheckpointError` naming its files, or with ``fallback`` is passed over for the
    next older one. Collective when a process group exists (the checksums are shared out).
    """
    candidates, found_by = resume_candidates(root)
    if not candidates:
        return None
    skipped: list[tuple[int, list[str]]] = []
    for iteration in candidates:
        path = iteration_dir(root, iteration)
        problems = check_checkpoint(path, checksums=checksums)
        if not problems:
            manifest = read_manifest(path)
            if manifest is None:
                log.warning(
                    "%s has no %s (saved before manifests existed): its files are not verified",
                    path, MANIFEST,
                )
            return Selection(iteration, path, manifest, found_by, skipped)
        skipped.append((iteration, problems))
        if not fallback:
            older = [i for i in candidates if i < iteration]
            hint = (
                f"set checkpoint.load_fallback=true to resume from the newest intact older one "
                f"(candidates: {', '.join(iteration_dir(root, i).name for i in older[:3])})"
                if older
                else "there is no older checkpoint to fall back to"
            )
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged; nothing was loaded:\n  "
                + "\n  ".join(problems)
                + f"\nRestore these files, or {hint}."
            )
    details = "\n  ".join(f"{iteration_dir(root, i).name}: {p[0]}" for i, p in skipped)
    raise DamagedCheckpointError(f"no intact checkpoint in {root}; nothing was loaded:\n  {details}")
