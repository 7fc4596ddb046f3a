"""Checkpoints through megatron's ``dist_checkpointing``: resharding across (TP, PP, EP, DP).

Layout of ``<save>/``:
  ``iter_0000100/``            one dist_checkpointing directory per saved iteration
  ``latest_checkpointed_iteration.txt``   the newest complete one

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed only after every rank finished,
and the tracker file is replaced atomically, so an interrupted save never becomes "latest".
Model keys are megatron's sharded keys (global layer numbers), so layouts can differ between
save and load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.utils import unwrap_model

TRACKER = "latest_checkpointed_iteration.txt"
# "fully_reshardable": the distributed optimizer's state is saved per model parameter, so a
# checkpoint loads under another (TP, PP, EP, DP) layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


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


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    model: list[torch.nn.Module],
    optimizer=None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save model (+ optimizer, + ``extra`` common state) for ``iteration``; returns its dir."""
    rank = dist.get_rank()
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _full_sharded_state_dict(model, optimizer, is_loading=False)
    state["iteration"] = iteration
    state["extra"] = extra or {}
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = Path(root) / (TRACKER + ".tmp")
        tracker_tmp.write_text(str(iteration))
        os.replace(tracker_tmp, Path(root) / TRACKER)
    dist.barrier()
    return final


def latest_iteration(root: str | os.PathLike) -> int | None:
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    return int(tracker.read_text().strip())


def load_checkpoint(
    root: str | os.PathLike,
    model: list[torch.nn.Module],
    optimizer=None,
    iteration: int | None = None,
    strict: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Load into ``model`` (and ``optimizer``) in place; returns (iteration, extra)."""
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(
                f"no checkpoint in {root}: {TRACKER} is missing; set checkpoint.load to a directory "
                f"written by checkpoint.save"
            )
    ckpt = iteration_dir(root, iteration)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    state = _full_sharded_state_dict(model, optimizer, is_loading=True)
    state["iteration"] = None
    state["extra"] = None
    loaded = dist_checkpointing.load(
        state, str(ckpt), strict="raise_all" if strict else "assume_ok_unexpected"
    )
    chunks = unwrap_model(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"], strict=strict)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return int(loaded["iteration"]), loaded.get("extra") or {}
