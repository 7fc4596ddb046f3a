"""Stage 3 of a run, ``resume``: verify the chosen checkpoint's files and load it, or start
fresh without overwriting one (an earlier run's metrics move aside)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from engram_train.checkpoint.layout import TRACKER, iteration_dir, list_checkpoints
from engram_train.checkpoint.load import load_checkpoint_dir, saved_param_groups
from engram_train.checkpoint.selection import select_checkpoint
from engram_train.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsWriter
from engram_train.training.job import Job
from engram_train.training.optimizer import align_groups_to_checkpoint, group_schedule, resume_schedule
from engram_train.training.plan import Plan, check_resume

log = logging.getLogger("engram_train")


@dataclass
class Progress:
    """Where the run stands: iteration, samples consumed, and the checkpoints it saved."""

    iteration: int = 0
    consumed: int = 0
    last_saved: int | None = None
    nonfinite_steps: int = 0
    saved: list = dataclasses.field(default_factory=list)  # iterations this run saved


def rotate_outputs(exp_dir: Path) -> None:
    """A fresh start keeps an earlier run's metrics: they move to ``previous/<time>/``."""
    old = [p for p in (exp_dir / METRICS_FILE, exp_dir / TENSORBOARD_DIR, exp_dir / "loss.png") if p.exists()]
    if not old:
        return
    target = exp_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    for p in old:
        shutil.move(str(p), str(target / p.name))
    log.warning("this run starts from scratch: the earlier run's outputs in %s moved to %s", exp_dir, target)


def resume(job: Job, plan: Plan) -> Progress:
    """Load the checkpoint `check` chose (after verifying its files), or start fresh."""
    cfg, c = job.cfg, job.cfg.checkpoint
    progress = Progress()
    if plan.resume_from is not None:
        selection = select_checkpoint(plan.resume_from, fallback=bool(c.load_fallback), checksums=bool(c.verify))
        for iteration, problems in selection.skipped:
            if job.rank == 0:
                log.warning("passing over damaged checkpoint %s:\n  %s",
                            iteration_dir(plan.resume_from, iteration), "\n  ".join(problems))  # fmt: skip
        if selection.skipped:  # `check` looked at a newer one
            check_resume(cfg, plan, selection.path, selection.manifest)
        run_groups = group_schedule(job.optimizer)  # this run's LR values, before the load
        saved_groups = saved_param_groups(selection.path)
        with_optimizer = saved_groups is not None
        if with_optimizer:
            align_groups_to_checkpoint(job.optimizer, saved_groups)
        iteration, extra = load_checkpoint_dir(
            selection.path, job.model, job.optimizer if with_optimizer else None,
            load_engram=bool(c.load_engram),
        )  # fmt: skip
        progress = Progress(
            iteration=iteration,
            consumed=int(extra.get("consumed_samples", iteration * cfg.train.global_batch_size)),
            last_saved=iteration,
        )
        saved = extra.get("scheduler")
        which = resume_schedule(job.scheduler, job.optimizer, run_groups, saved, progress.consumed)
        if job.rank == 0:
            if not with_optimizer:
                log.info("%s holds no optimizer state (model weights only): the optimizer starts afresh",
                         selection.path)  # fmt: skip
            log.info("LR schedule: %s (lr %g, min_lr %g, warm-up %d samples, decay %d samples), at sample %d%s",
                     which, job.scheduler.max_lr, job.scheduler.min_lr, job.scheduler.lr_warmup_steps,
                     job.scheduler.lr_decay_steps, job.scheduler.num_steps,
                     "" if saved else " (the checkpoint carries no schedule)")  # fmt: skip
        if job.rank == 0:
            how = "" if selection.found_by == "tracker" else " (no tracker file: the newest complete one)"
            log.info("resumed from %s%s at iteration %d (%d samples consumed)%s", selection.path, how,
                     iteration, progress.consumed,
                     "" if c.load_engram else "; Engram not loaded" + (
                         ": initialised afresh" if plan.model_config.use_engram else ""))  # fmt: skip
    elif job.rank == 0:
        if c.load:
            log.warning("checkpoint.load=%s holds no checkpoint yet: training from scratch", c.load)
        if c.save and c.overwrite:
            for i in list_checkpoints(c.save):
                shutil.rmtree(iteration_dir(c.save, i), ignore_errors=True)
            (Path(c.save) / TRACKER).unlink(missing_ok=True)
    if job.rank == 0:
        job.exp_dir.mkdir(parents=True, exist_ok=True)
        if progress.iteration == 0:
            rotate_outputs(job.exp_dir)
        (job.exp_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    dist.barrier()
    # On resume, records after the checkpoint (an abandoned continuation) are dropped.
    job.metrics = MetricsWriter(job.exp_dir, enabled=job.is_logger, resume_iteration=progress.iteration or None)
    return progress
