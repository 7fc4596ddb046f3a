"""Which checkpoint an export reads (``--load``/``--iteration``), and whether its files are
intact: the trainer's own layout and manifest rules (``engram_train.checkpoint``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engram_train.checkpoint.checkpoint_errors import DamagedCheckpointError
from engram_train.checkpoint.layout import (
    MANIFEST,
    TRACKER,
    iteration_dir,
    iteration_of,
    latest_iteration,
    list_checkpoints,
)
from engram_train.checkpoint.manifest import check_checkpoint, read_manifest
from engram_train.export.checkpoint_reader import MEGATRON_METADATA
from engram_train.export.export_errors import ExportError


def resolve_checkpoint(load: str | os.PathLike, iteration: int | None = None
                       ) -> tuple[Path, Path, int | None]:
    """(checkpoint root, iteration directory, iteration) for ``--load`` / ``--iteration``.

    `load` is a ``checkpoint.save`` folder (``latest_checkpointed_iteration.txt`` +
    ``iter_XXXXXXX/``) or one ``iter_XXXXXXX`` folder itself."""
    root = Path(load)
    if not root.exists():
        raise ExportError(f"--load {load}: directory does not exist")
    if not root.is_dir():
        raise ExportError(f"--load {load}: not a directory (give the checkpoint.save folder)")
    if (root / MEGATRON_METADATA).is_file():  # an iteration directory
        found = iteration_of(root)
        if iteration is not None and iteration != found:
            raise ExportError(
                f"--iteration {iteration} does not match --load {load}, which is one iteration's "
                "folder: give the checkpoint.save folder with --iteration, or drop --iteration"
            )
        return root.parent, root, found
    available = list_checkpoints(root)
    if iteration is None:
        try:
            iteration = latest_iteration(root)
        except ValueError:
            raise ExportError(f"--load {load}: {TRACKER} is unreadable; pass --iteration") from None
        if iteration is None:
            if available:
                raise ExportError(
                    f"--load {load} has no {TRACKER}; pass --iteration (found iterations "
                    f"{available})"
                )
            raise ExportError(
                f"--load {load} is not a checkpoint: it has no {TRACKER} and no iter_XXXXXXX "
                "folders (give the folder checkpoint.save wrote into)"
            )
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise ExportError(
            f"--load {load} has no iteration {iteration} ({directory.name} is missing; found "
            f"iterations {available})"
        )
    return root, directory, iteration


def verify_files(directory: Path, *, checksums: bool = True,
                 log: Callable[[str], None] = lambda _: None) -> dict | None:
    """The trainer's load check: every file's size (and with `checksums` its SHA-256) against
    the checkpoint's ``manifest.json``; returns the manifest (None, with a warning, for a
    checkpoint saved before manifests existed). `ExportError` naming each damaged file."""
    try:
        manifest = read_manifest(directory)
    except DamagedCheckpointError as err:
        raise ExportError(f"checkpoint {directory} is damaged; nothing was exported:\n  {err}") from None
    if manifest is None:
        log(f"warning: {directory} has no {MANIFEST} (saved before manifests existed): its files "
            "could not be checked for damage (sizes, SHA-256), nor its run identity (Engram hash "
            "seed, tokenizer, N, H, layer ids, primes, multipliers) against the run config; only "
            "the Engram tensor shapes and head offsets are checked")
        return None
    problems = check_checkpoint(directory, checksums=checksums)
    if problems:
        raise ExportError(
            f"checkpoint {directory} is damaged; nothing was exported:\n  " + "\n  ".join(problems)
            + "\nRestore these files, or export another iteration (--iteration N)"
        )
    size = sum(int(f["size"]) for f in manifest["files"].values())
    log(f"{len(manifest['files'])} files ({size / 2**20:.1f} MiB) match {MANIFEST} "
        + ("(sizes and SHA-256)" if checksums else "(sizes only: --no-verify)"))
    return manifest
