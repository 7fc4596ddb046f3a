"""Stage 1 of a run, ``check``: everything that can go wrong before a process group exists.

The config (validated and built into megatron's model config), writable output directories,
the tokenizer and hash mapping, the LR schedule megatron would accept, and whether the
checkpoint to resume from is complete and matches this run (Engram hash identity, model shape,
LR schedule). Megatron's checkpointing and data modules are imported only after the config
validated, so that a config error shows within a second or two.
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from engram_train.checkpoint.checkpoint_errors import DamagedCheckpointError
from engram_train.checkpoint.layout import TRACKER, has_checkpoints, iteration_dir, list_checkpoints, read_tracker
from engram_train.checkpoint.selection import select_checkpoint
from engram_train.engram.compressed_tokenizer import TokenizerNotFoundError
from engram_train.engram.variant import build_hash_mapping
from engram_train.training.faults import check_writable
from engram_train.training.run_config import ConfigError, padded_vocab_size, validate_run_config
from engram_train.training.run_identity import (
    ResumeMismatchError,
    check_run_identity,
    check_schedule,
    combine_mismatches,
    run_identity,
)

if TYPE_CHECKING:
    from engram_train.config.composed import ModelConfig

log = logging.getLogger("engram_train")


@dataclass
class Plan:
    """What `check` found, before any process group: the validated configs and the resume."""

    model_config: ModelConfig
    tokenizer: Any
    vocab_size: int
    hash_mapping: Any  # the variant's NgramHashMapping (build_hash_mapping), or None
    identity: dict  # this run's identity (training/run_identity.py)
    resume_from: str | None  # checkpoint.load when it holds a checkpoint, else None


def lr_scheduler(cfg, optimizer):
    """megatron's scheduler for ``train`` (stepped in samples), with the resume rule of
    ``checkpoint.override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``."""
    # megatron's optimizer package imports its checkpointing: after the config validated
    from engram_train.training.optimizer import build_lr_scheduler

    t, c = cfg.train, cfg.checkpoint
    decay_iters = t.lr_decay_iters or t.train_iters
    scheduler = build_lr_scheduler(
        optimizer, t.lr, t.min_lr, t.lr_warmup_iters * t.global_batch_size,
        decay_iters * t.global_batch_size, t.lr_decay_style, t.weight_decay,
    )  # fmt: skip
    scheduler.override_opt_param_scheduler = bool(c.override_opt_param_scheduler)
    scheduler.use_checkpoint_opt_param_scheduler = bool(c.use_checkpoint_opt_param_scheduler)
    return scheduler


def expected_schedule(cfg) -> dict:
    """The scheduler state this config produces (built on a stand-in optimizer)."""
    try:
        return lr_scheduler(cfg, types.SimpleNamespace(param_groups=[])).state_dict()
    except AssertionError as e:
        raise ConfigError(f"train: the LR schedule is invalid ({e})") from None


def check_resume(cfg, plan: Plan, ckpt: Path, manifest: dict | None) -> None:
    """Raise `ResumeMismatchError` when checkpoint ``ckpt`` does not match this run: every
    difference it will refuse (run identity and LR schedule) in one message, with the overrides
    that accept them, so that one relaunch settles them all."""
    from megatron.core import dist_checkpointing  # after the config validated (module docstring)

    c = cfg.checkpoint
    found: list[ResumeMismatchError] = []
    if manifest is None:
        log.warning("%s records no run identity (saved before identities existed): not checked", ckpt)
    else:
        try:
            check_run_identity(manifest.get("run"), plan.identity, load_engram=bool(c.load_engram), where=str(ckpt))
        except ResumeMismatchError as e:
            found.append(e)
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as e:
        raise DamagedCheckpointError(f"{ckpt}: cannot read its common state ({e})") from e
    try:
        check_schedule(
            (common.get("extra") or {}).get("scheduler"), expected_schedule(cfg),
            override=bool(c.override_opt_param_scheduler),
            use_checkpoint=bool(c.use_checkpoint_opt_param_scheduler),
            global_batch_size=int(cfg.train.global_batch_size),
            lr_decay_iters_set=cfg.train.lr_decay_iters is not None, where=str(ckpt),
        )  # fmt: skip
    except ResumeMismatchError as e:
        found.append(e)
    if found:
        raise combine_mismatches(found)


def refuse_overwrite(cfg) -> None:
    """A fresh start must not overwrite checkpoints in ``checkpoint.save`` unless asked."""
    save = cfg.checkpoint.save
    if not save:
        return
    existing = list_checkpoints(save)
    if not existing and read_tracker(save) is None:
        return
    if cfg.checkpoint.overwrite:
        return
    names = ", ".join(iteration_dir(save, i).name for i in existing[-3:]) or TRACKER
    raise ConfigError(
        f"checkpoint.save={save} already holds checkpoints ({names}) and this run starts from "
        f"scratch, so it would overwrite them. Resume with checkpoint.load={save}, choose another "
        "checkpoint.save, or set checkpoint.overwrite=true to delete them and start over"
    )


def check(cfg: DictConfig) -> Plan:
    """Config, output directories and the checkpoint to resume from, before any process group."""
    # Validated (run and model rules) and built, still without a process group, and before the
    # megatron modules of the tokenizer and the checkpoint are imported: a config error shows
    # at once.
    model_config = validate_run_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from engram_train.data import load_tokenizer  # megatron's tokenizer base (docstring)

    check_writable(cfg.experiment.exp_dir, "experiment.exp_dir")
    if cfg.checkpoint.save:
        check_writable(cfg.checkpoint.save, "checkpoint.save")

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, model_config.tensor_model_parallel_size)
    mapping = None
    if model_config.use_engram:
        try:
            mapping = build_hash_mapping(model_config, num_threads=cfg.data.hash_threads)
        except (ValueError, TokenizerNotFoundError) as e:  # pad id, tokenizer path: the config's
            raise ConfigError(f"model: {e}") from None
    plan = Plan(model_config, tokenizer, vocab_size, mapping,
                run_identity(model_config, vocab_size, mapping), resume_from=None)  # fmt: skip
    expected_schedule(cfg)  # a schedule megatron would refuse fails here, not after the build

    load = cfg.checkpoint.load
    if not (load and has_checkpoints(load)):
        refuse_overwrite(cfg)
        return plan
    # The checkpoint `resume` will load, by sizes only (the checksums are shared out there).
    selection = select_checkpoint(load, fallback=bool(cfg.checkpoint.load_fallback), checksums=False)
    for iteration, problems in selection.skipped:
        log.warning("passing over damaged checkpoint %s:\n  %s", iteration_dir(load, iteration),
                    "\n  ".join(problems))  # fmt: skip
    check_resume(cfg, plan, selection.path, selection.manifest)
    plan.resume_from = str(load)
    return plan
