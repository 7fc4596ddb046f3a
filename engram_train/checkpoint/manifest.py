"""Checksums and manifests: what a save recorded, and whether a checkpoint still matches it.

``manifest.json`` (written last into ``iter_N.tmp``, before the rename) holds every file's size
and SHA-256 and the run identity. Hashing is shared out over the ranks when a process group
exists; the verdict is the same on all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from engram_train.checkpoint.checkpoint_errors import DamagedCheckpointError
from engram_train.checkpoint.layout import MANIFEST, iteration_dir, list_checkpoints

MANIFEST_FORMAT = 1
_READ_CHUNK = 16 << 20


def read_manifest(ckpt: str | os.PathLike) -> dict | None:
    """A checkpoint's manifest, or None when it has none (saved before manifests existed)."""
    path = Path(ckpt) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise DamagedCheckpointError(f"{path}: not a checkpoint manifest")
    return manifest


def checkpoint_bytes(root: str | os.PathLike) -> int | None:
    """Size of the newest checkpoint with a manifest (what the next save will roughly need)."""
    for iteration in reversed(list_checkpoints(root)):
        try:
            manifest = read_manifest(iteration_dir(root, iteration))
        except DamagedCheckpointError:
            continue
        if manifest is not None:
            return sum(int(f["size"]) for f in manifest["files"].values())
    return None


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _shared(results: dict) -> dict:
    """Merge every rank's dict (one collective); a no-op without a process group."""
    rank, world = rank_world()
    if world == 1:
        return results
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, results)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def digests(directory: Path, names: list[str]) -> dict[str, tuple[int, str] | str]:
    """{name: (size, sha256)} for ``names``, each rank hashing every world-th file; a file
    that cannot be read gives the error text instead. Same result on every rank."""
    rank, world = rank_world()
    mine: dict[str, tuple[int, str] | str] = {}
    for name in names[rank::world]:
        try:
            mine[name] = file_digest(directory / name)
        except OSError as e:
            mine[name] = f"unreadable ({e.strerror or e})"
    return _shared(mine)


def files_of(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def check_checkpoint(ckpt: str | os.PathLike, *, checksums: bool = True) -> list[str]:
    """What is wrong with a checkpoint directory: one line per damaged file, [] when intact.

    Sizes are always compared with the manifest; ``checksums`` also reads every file (the work
    is split over the ranks when a process group exists; the result is the same on all of them).
    A checkpoint saved before manifests existed cannot be checked and gives [].
    """
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return [f"{ckpt}: directory does not exist"]
    try:
        manifest = read_manifest(ckpt)
    except DamagedCheckpointError as e:
        return [str(e)]
    if manifest is None:
        return []
    problems = []
    present = []
    for name, rec in sorted(manifest["files"].items()):
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != rec["size"]:
            problems.append(f"{path}: {size} bytes, {rec['size']} were written (truncated or overwritten)")
            continue
        present.append(name)
    if checksums:
        for name, got in sorted(digests(ckpt, present).items()):
            if isinstance(got, str):
                problems.append(f"{ckpt / name}: {got}")
            elif got[1] != manifest["files"][name]["sha256"]:
                problems.append(f"{ckpt / name}: contents changed since the save (SHA-256 differs)")
    return problems
