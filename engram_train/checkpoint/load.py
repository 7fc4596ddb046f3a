"""Loading one checkpoint directory (every rank), or the newest intact one under a save root.

Model keys are megatron's sharded keys (global layer numbers) and the optimizer state is saved
fully reshardable and keyed by role in megatron's optimizer chain (dense, expert, engram), so
save and load layouts can differ, expert parallelism included; a checkpoint keyed by position
(saved before) loads when this run's chain has its shape, and is refused clearly otherwise. ``load_engram=False`` loads everything
but Engram (``partial.py``). A checkpoint megatron-core 0.19 wrote loads under 0.16 through the
``embedded_common_state`` patch (runtime/patches.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from engram_train.checkpoint.checkpoint_errors import CheckpointError, DamagedCheckpointError
from engram_train.checkpoint.layout import TRACKER, iteration_dir
from engram_train.checkpoint.manifest import check_checkpoint, read_manifest
from engram_train.checkpoint.selection import select_checkpoint
from engram_train.checkpoint.partial import load_without_engram
from engram_train.checkpoint.state import (
    as_chain,
    check_loaded,
    full_sharded_state_dict,
    load_chunks,
    saved_metadata,
)


def saved_param_groups(ckpt: str | os.PathLike) -> list[list[dict]] | None:
    """The optimizer param groups checkpoint ``ckpt`` holds, one list per optimizer of its chain
    in chain order; None when it was saved without optimizer state (an import may hold the
    model's weights only)."""
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as e:
        raise DamagedCheckpointError(f"{ckpt}: cannot read its common state ({e})") from e
    if "optimizer" not in common:
        return None
    found: list[list[dict]] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("param_groups"), list):
                found.append(node["param_groups"])
                return
            for value in node.values():
                walk(value)

    walk(common["optimizer"])
    return found


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
    if optimizer is not None and is_model_only(ckpt):
        # weights only (engram-import-hf): the optimizer starts fresh from the loaded weights
        iteration, extra = load_checkpoint_dir(ckpt, model, None, strict=strict,
                                               load_engram=load_engram)
        optimizer.reload_model_params()  # fp32 main copies made before the load
        return iteration, extra
    try:
        if not load_engram:
            return load_without_engram(ckpt, model, optimizer)
        chain = as_chain(optimizer) if optimizer is not None else None
        metadata = saved_metadata(ckpt, chain) if chain is not None else None
        state = full_sharded_state_dict(model, chain, is_loading=True, metadata=metadata)
        state["iteration"] = None
        state["extra"] = None
        loaded = dist_checkpointing.load(
            state, str(ckpt), strict="raise_all" if strict else "assume_ok_unexpected"
        )
        load_chunks(model, loaded, strict)
        if chain is not None:
            chain.load_state_dict(loaded["optimizer"])
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"loading {ckpt} failed: {type(e).__name__}: {e}") from e
    check_loaded(ckpt, model)
    return int(loaded["iteration"]), loaded.get("extra") or {}


def is_model_only(ckpt: str | os.PathLike) -> bool:
    """Whether checkpoint directory `ckpt` holds weights only (its manifest's ``contents``)."""
    manifest = read_manifest(ckpt)
    return manifest is not None and manifest.get("contents") == ["model"]


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
