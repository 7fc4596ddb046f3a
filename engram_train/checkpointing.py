"""Checkpoints through megatron's ``dist_checkpointing``, written so that no run resumes from a
damaged, partial or non-finite checkpoint without saying so.

Layout of ``<save>/``::

  iter_0000100/                          one dist_checkpointing directory per saved iteration
      manifest.json                      size and SHA-256 of every file, and the run identity
  latest_checkpointed_iteration.txt      the newest complete iteration

Saving (`save_checkpoint`, every rank):

1. parameters holding NaN/inf are refused (`NonFiniteStateError`): nothing is written;
2. free space is checked against the size of the previous checkpoint (or an estimate);
3. rank 0 removes ``iter_*.tmp`` directories left by failed saves and creates ``iter_N.tmp``;
4. ``dist_checkpointing.save`` writes into it; a full disk is reported as such
   (`CheckpointSpaceError`) and the partial directory removed;
5. the ranks hash a share of the files each; rank 0 writes ``manifest.json`` into the
   ``.tmp`` directory, renames it into place and then replaces the tracker atomically.

So a directory named ``iter_N`` is complete once it exists, and the tracker only ever names a
complete checkpoint. Loading (`select_checkpoint`, then `load_checkpoint_dir`) starts from the
tracker (or, without one, from the newest complete ``iter_*``), checks every file's size and
checksum against the manifest and names the damaged file; with ``fallback`` it moves on to the
newest intact older checkpoint instead of failing.

Model keys are megatron's sharded keys (global layer numbers) and the optimizer state is saved
fully reshardable, so save and load layouts can differ. ``load_engram=False`` loads everything
but Engram (the continued-pretraining recipe of docs/engram-integration.md): backbone weights
and their optimizer state come from the checkpoint, Engram keeps its fresh initialisation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# "fully_reshardable": the distributed optimizer's state is saved per model parameter, so a
# checkpoint loads under another (TP, PP, EP, DP) layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Engram's parameters (and their optimizer state) are the sharded keys holding this part.
ENGRAM_KEY_PART = ".engram."

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER_DIR = re.compile(r"^iter_(\d{7,})\.(tmp|old)$")
_READ_CHUNK = 16 << 20
# Free space below this after a failed write means the disk filled up (when the size a
# checkpoint needs is not known).
_FULL_DISK_BYTES = 16 << 20
# Headroom on top of a checkpoint's size for the free-space check (metadata, rounding).
_SPACE_MARGIN = 1.05


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what to do."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files differ from what its manifest recorded (or cannot be read)."""


class CheckpointSpaceError(CheckpointError):
    """Not enough free space to save a checkpoint (checked before, or ENOSPC while writing)."""


class NonFiniteStateError(CheckpointError):
    """Parameters hold NaN or inf: such a state is never saved."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


# -- what a save directory holds ---------------------------------------------------------------


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


def remove_leftovers(root: str | os.PathLike) -> list[Path]:
    """Remove ``iter_*.tmp`` (failed or interrupted saves) and ``iter_*.old`` directories."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if _LEFTOVER_DIR.match(path.name) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


SET_ASIDE_SUFFIX = ".diverged"


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
            _write_atomic(root / TRACKER, str(latest))
    else:
        (root / TRACKER).unlink(missing_ok=True)
    _fsync_dir(root)
    return renamed, latest


# -- checksums ------------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
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
    rank, world = _rank_world()
    if world == 1:
        return results
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, results)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def _digests(directory: Path, names: list[str]) -> dict[str, tuple[int, str] | str]:
    """{name: (size, sha256)} for ``names``, each rank hashing every world-th file; a file
    that cannot be read gives the error text instead. Same result on every rank."""
    rank, world = _rank_world()
    mine: dict[str, tuple[int, str] | str] = {}
    for name in names[rank::world]:
        try:
            mine[name] = file_digest(directory / name)
        except OSError as e:
            mine[name] = f"unreadable ({e.strerror or e})"
    return _shared(mine)


def _files_of(directory: Path) -> list[str]:
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
        for name, got in sorted(_digests(ckpt, present).items()):
            if isinstance(got, str):
                problems.append(f"{ckpt / name}: {got}")
            elif got[1] != manifest["files"][name]["sha256"]:
                problems.append(f"{ckpt / name}: contents changed since the save (SHA-256 differs)")
    return problems


# -- choosing what to resume from -----------------------------------------------------------------


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


# -- state dicts ------------------------------------------------------------------------------------


def model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    """Keys as Megatron-LM writes them: ``model`` (or ``model0``, ``model1``... with VPP).

    Engram models are saved with global layer numbers in their keys (megatron's
    ``non_homogeneous_layers``): only some layers carry Engram, and the Engram tables are
    row-sharded tensors of their own (``MultiHeadEmbedding.sharded_state_dict``).
    """
    chunks = unwrap_model(model)

    def state(chunk):
        if getattr(chunk.config, "use_engram", False):
            return chunk.sharded_state_dict(metadata={"non_homogeneous_layers": True})
        return chunk.sharded_state_dict()

    if len(chunks) == 1:
        return {"model": state(chunks[0])}
    return {f"model{i}": state(chunk) for i, chunk in enumerate(chunks)}


def _full_sharded_state_dict(model, optimizer, is_loading: bool) -> dict[str, Any]:
    state = model_sharded_state_dict(model)
    if optimizer is not None:
        # The optimizer finds each parameter's sharding in the nested model dicts (all chunks).
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


def estimate_checkpoint_bytes(model: list[torch.nn.Module]) -> int:
    """Bytes a checkpoint of ``model`` takes, about: every tensor once (main replicas over all
    ranks) plus Adam's state of each parameter (two fp32 moments, and an fp32 master copy except
    for fp32 Engram tables, whose optimizer keeps none). Collective."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from engram_train.runtime.distributed import device

    total = 0
    for sh in nested_values(model_sharded_state_dict(model)):
        data = getattr(sh, "data", None)
        if not (isinstance(data, torch.Tensor) and is_main_replica(sh.replica_id)):
            continue
        state = 0
        if data.requires_grad:
            table_fp32 = sh.key.endswith("multi_head_embedding.weight") and data.element_size() == 4
            state = 8 if table_fp32 else 12
        total += data.numel() * (data.element_size() + state)
    if dist.is_initialized():
        t = torch.tensor([float(total)], dtype=torch.float64, device=device())
        dist.all_reduce(t)
        total = int(t.item())
    return total


# -- saving ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would, once created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def nonfinite_parameter(model: list[torch.nn.Module]) -> tuple[int, str] | None:
    """(rank, name) of a parameter holding NaN or inf on any rank, else None. Collective."""
    bad = None
    for chunk in unwrap_model(model):
        for name, param in chunk.named_parameters():
            if not bool(torch.isfinite(param.detach()).all()):
                bad = name
                break
        if bad:
            break
    rank, world = _rank_world()
    found = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad)
    return next(((r, name) for r, name in enumerate(found) if name), None)


def check_free_space(root: str | os.PathLike, need: int | None, what: str) -> None:
    """Raise `CheckpointSpaceError` (on every rank: rank 0 decides) unless ``root`` has room for
    a checkpoint the size of the newest one already there (else ``need`` bytes)."""
    root = Path(root)
    previous = checkpoint_bytes(root)
    need = previous or need  # a checkpoint already written is the best estimate
    message = None
    rank, world = _rank_world()
    if rank == 0 and need:
        free = _free_bytes(root)
        if free < need * _SPACE_MARGIN:
            source = "the size of the newest checkpoint" if previous else "estimated"
            message = (
                f"not enough free space to {what} in {root}: {_gib(free)} free, about "
                f"{_gib(need)} needed ({source}). Nothing was written; free space or point "
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


def _is_no_space(exc: BaseException, root: Path, tmp: Path, need: int | None) -> bool:
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
        available = _free_bytes(root) + _dir_bytes(tmp)
    except OSError:
        return False
    return available < (need * _SPACE_MARGIN if need else _FULL_DISK_BYTES)


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
    rank, _ = _rank_world()
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
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
    state = _full_sharded_state_dict(model, optimizer, is_loading=False)
    state["iteration"] = iteration
    state["extra"] = extra or {}
    try:
        dist_checkpointing.save(state, str(tmp))
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        no_space = _is_no_space(e, root, tmp, checkpoint_bytes(root) or space_estimate)
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
                f"({_gib(_free_bytes(root))} free after removing the partial "
                f"checkpoint). {kept} Free space or point checkpoint.save at a larger disk, then "
                f"resume with checkpoint.load={root}"
            ) from e
        raise CheckpointError(f"saving iteration {iteration} to {root} failed: {e}. {kept}") from e
    dist.barrier()
    holder = [_files_of(tmp) if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    digests = _digests(tmp, holder[0])  # the same on every rank
    unreadable = {n: d for n, d in digests.items() if isinstance(d, str)}
    if unreadable:
        raise CheckpointError(f"saving iteration {iteration}: cannot read back {unreadable}")
    if rank == 0:
        manifest = {
            "format": MANIFEST_FORMAT,
            "iteration": iteration,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": dist.get_world_size(),
            "files": {n: {"size": s, "sha256": h} for n, (s, h) in sorted(digests.items())},
            "run": run_identity or {},
        }
        _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():  # the same iteration saved again (e.g. after a fallback)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        _write_atomic(root / TRACKER, str(iteration))
        _fsync_dir(root)
        size = sum(s for s, _ in digests.values())
        log.info("saved %s (%s, %.1f s)", final, _gib(size), time.perf_counter() - started)
    dist.barrier()
    return final


# -- loading --------------------------------------------------------------------------------------


def _load_chunks(model, loaded: dict, strict: bool) -> tuple[list[str], list[str]]:
    chunks = unwrap_model(model)
    missing, unexpected = [], []
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
        if not strict:
            missing += result.missing_keys
            unexpected += result.unexpected_keys
    return missing, unexpected


def load_checkpoint_dir(
    ckpt: str | os.PathLike,
    model: list[torch.nn.Module],
    optimizer=None,
    *,
    strict: bool = True,
    load_engram: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Load one checkpoint directory into ``model`` (and ``optimizer``) in place.

    Returns (iteration, extra). With ``load_engram=False`` Engram parameters and their
    optimizer state are neither read nor required: they keep their current values, and a
    checkpoint saved with or without Engram loads into a model with or without it.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    try:
        if not load_engram:
            return _load_without_engram(ckpt, model, optimizer)
        state = _full_sharded_state_dict(model, optimizer, is_loading=True)
        state["iteration"] = None
        state["extra"] = None
        loaded = dist_checkpointing.load(
            state, str(ckpt), strict="raise_all" if strict else "assume_ok_unexpected",
            **_embedded_common_state_load(ckpt, state),
        )
        loaded.pop(EMBEDDED_COMMON_STATE, None)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"loading {ckpt} failed: {type(e).__name__}: {e}") from e
    _load_chunks(model, loaded, strict)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    _check_loaded(ckpt, model)
    return int(loaded["iteration"]), loaded.get("extra") or {}


def _check_loaded(ckpt: Path, model) -> None:
    bad = nonfinite_parameter(model)
    if bad:
        raise DamagedCheckpointError(
            f"checkpoint {ckpt} loaded NaN or inf into parameter {bad[1]} (rank {bad[0]}): it is "
            "damaged, and its files were not verified against a manifest (checkpoint.verify=false, "
            "or saved before manifests existed). Use another checkpoint; with verification on, "
            "checkpoint.load_fallback=true passes over damaged ones"
        )


# megatron-core 0.19 stores a checkpoint's common (non-tensor) state as one ShardedObject of this
# key inside the torch_dist files instead of ``common.pt``; 0.16 reads only ``common.pt``.
EMBEDDED_COMMON_STATE = "common_state"


def embedded_common_state_key() -> str:
    """The storage key of that object in the torch_dist files."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(EMBEDDED_COMMON_STATE, None, (1,), (0,)).unique_key


def read_embedded_common_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The common state megatron-core 0.19 embeds in a checkpoint's torch_dist files, read in
    this process alone (no process group); only torch's safe types are unpickled."""
    import io

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    key = embedded_common_state_key()
    buffers = {key: io.BytesIO()}
    dcp_load(buffers, storage_reader=FileSystemReader(str(checkpoint_dir)), no_dist=True)
    loaded = buffers[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def _embedded_common_state_load(ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Extra ``dist_checkpointing.load`` arguments that let megatron-core < 0.19 read a
    checkpoint written by 0.19 (docs/megatron-versions.md); nothing for other checkpoints.

    The common state is read from the embedded object (a common-load strategy, megatron's own
    extension point), and ``state`` requests that object too, so that a strict load does not
    count it as a checkpoint key the model lacks (its loaded copy is dropped).
    """
    from packaging.version import Version

    from engram_train.runtime import megatron_core_version

    if (ckpt / "common.pt").exists() or Version(megatron_core_version()) >= Version("0.19"):
        return {}
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class EmbeddedCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_embedded_common_state(checkpoint_dir)

    state[EMBEDDED_COMMON_STATE] = ShardedObject(
        EMBEDDED_COMMON_STATE, None, (1,), (0,), replica_id=dist.get_rank()
    )
    return {"common_strategy": EmbeddedCommonLoad()}


def load_checkpoint(
    root: str | os.PathLike,
    model: list[torch.nn.Module],
    optimizer=None,
    iteration: int | None = None,
    strict: bool = True,
    *,
    load_engram: bool = True,
    checksums: bool = True,
    fallback: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint under ``root`` (or ``iteration``); (iteration, extra).

    The files are checked against the manifest first (`select_checkpoint`)."""
    if iteration is None:
        selection = select_checkpoint(root, fallback=fallback, checksums=checksums)
        if selection is None:
            raise FileNotFoundError(
                f"no checkpoint in {root}: neither {TRACKER} nor a complete iter_* directory; "
                "set checkpoint.load to a directory written by checkpoint.save"
            )
        path = selection.path
    else:
        path = iteration_dir(root, iteration)
        problems = check_checkpoint(path, checksums=checksums)
        if problems:
            raise DamagedCheckpointError(f"checkpoint {path} is damaged:\n  " + "\n  ".join(problems))
    return load_checkpoint_dir(path, model, optimizer, strict=strict, load_engram=load_engram)


def _optimizer_parts(optimizer) -> tuple[list, list]:
    """(megatron's optimizers, Engram table optimizers) of what `build_optimizer` returned."""
    from megatron.core.optimizer import ChainedOptimizer

    from engram_train.training.engram_optimizer import EngramTableOptimizer

    chain = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    parts = [o for o in chain if not isinstance(o, EngramTableOptimizer)]
    tables = [o for o in chain if isinstance(o, EngramTableOptimizer)]
    if chain[: len(parts)] != parts:
        raise CheckpointError("the Engram table optimizer must come after megatron's in the chain")
    return parts, tables


def _load_without_engram(ckpt: Path, model, optimizer) -> tuple[int, dict[str, Any]]:
    """Everything but Engram: see `load_checkpoint_dir`.

    megatron's optimizers (not the Engram table optimizer) are requested under the key layout
    the checkpoint has: a single optimizer's keys carry no prefix, a chain's (several
    optimizers, or any Engram checkpoint) carry ``chained_<i>.``. The optimizer state of
    Engram's dense parameters (which sit in megatron's optimizer) is not read: its Adam moments
    start at zero and its fp32 master copy is the parameter as initialised.
    """
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        extract_matching_values,
        merge,
    )
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    def is_engram(x) -> bool:
        return isinstance(x, ShardedBase) and ENGRAM_KEY_PART in x.key

    state = model_sharded_state_dict(model)
    _, state = extract_matching_values(state, is_engram)
    # Engram's weights as they are now: preparing megatron's optimizer for a load runs a dummy
    # step (runtime/megatron_fixes.py) whose weight decay would otherwise reach them.
    engram_live = {
        sh.key: sh.data
        for chunk in model_sharded_state_dict(model).values()
        for sh in chunk.values()
        if isinstance(sh, ShardedTensor) and ENGRAM_KEY_PART in sh.key
    }
    initial_engram = {key: data.detach().clone() for key, data in engram_live.items()}
    parts: list = []
    fresh_optim: dict = {}
    chained = False
    if optimizer is not None:
        parts, _ = _optimizer_parts(optimizer)
        tensors = dist_checkpointing.load_tensors_metadata(str(ckpt))
        chained = any(key.startswith("chained_") for key in tensors)
        reference = model_sharded_state_dict(model)
        requests = []
        for i, part in enumerate(parts):
            sd = part.sharded_state_dict(dict(reference), is_loading=True, metadata=OPTIMIZER_METADATA)
            if chained:
                add_prefix_for_sharding(sd, f"chained_{i}.")
            requests.append(sd)
        if not chained and len(parts) != 1:
            raise CheckpointError(
                f"{ckpt} holds one optimizer's state but this run has {len(parts)} (MoE expert "
                "and dense parameters apart): load it with the layout it was saved with"
            )
        optim_request = {i: sd for i, sd in enumerate(requests)} if chained else requests[0]
        fresh_optim, optim_request = extract_matching_values(optim_request, is_engram)
        state["optimizer"] = optim_request
    state["iteration"] = None
    state["extra"] = None

    loaded, not_in_ckpt, not_requested = dist_checkpointing.load(
        state, str(ckpt), strict="return_all", **_embedded_common_state_load(ckpt, state)
    )
    loaded.pop(EMBEDDED_COMMON_STATE, None)
    not_in_ckpt = sorted(k for k in not_in_ckpt if ENGRAM_KEY_PART not in k)
    not_requested = sorted(k for k in not_requested if ENGRAM_KEY_PART not in k)
    if not_in_ckpt or not_requested:
        raise CheckpointError(
            f"{ckpt} does not match this model beyond Engram: missing {not_in_ckpt[:5]}, "
            f"unexpected {not_requested[:5]} ({len(not_in_ckpt)} and {len(not_requested)} keys)"
        )
    missing, unexpected = _load_chunks(model, loaded, strict=False)
    other = [k for k in missing + unexpected if ENGRAM_KEY_PART not in f".{k}" and "_extra_state" not in k]
    if other:
        raise CheckpointError(f"{ckpt}: model keys {other[:5]} did not load")
    if optimizer is not None:

        def initial(sh):
            if not isinstance(sh, ShardedTensor):
                raise CheckpointError(f"cannot initialise optimizer state {sh.key} afresh")
            kind, _, name = sh.key.split("optimizer.state.", 1)[1].partition(".")
            if kind == "param":  # the fp32 master copy: the parameter as initialised
                return initial_engram[name].to(sh.data.dtype).view_as(sh.data).clone()
            return torch.zeros_like(sh.data)

        dict_list_map_inplace(initial, fresh_optim)
        merge(loaded["optimizer"], fresh_optim)
        for i, part in enumerate(parts):
            part.load_state_dict(loaded["optimizer"][i] if chained else loaded["optimizer"])
    with torch.no_grad():
        for key, data in engram_live.items():
            data.copy_(initial_engram[key])
    _check_loaded(ckpt, model)
    return int(loaded["iteration"]), loaded.get("extra") or {}
