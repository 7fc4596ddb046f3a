"""engram-train: pretrain a DeepSeek-V3-style GPT (with or without Engram) on megatron-core.

    torchrun --nproc-per-node 2 -m engram_train.train                      # the embedded demo
    torchrun --nproc-per-node 4 -m engram_train.train system.tensor_model_parallel_size=2 \\
        system.pipeline_model_parallel_size=2 model.use_engram=true train.train_iters=20
    engram-train model=engram_27b --cfg job                                # print a preset

Configuration: conf/train.yaml (+ conf/model/*.yaml), every key documented in README.md.
`run` reads top to bottom; each stage lives in ``engram_train/training/``:

1. `check` (``plan.py``): everything that can go wrong before a process group exists - the
   config, writable output directories, and whether the checkpoint to resume from matches this
   run (Engram hash identity, model shape, LR schedule) and is complete.
   Then the memory check (``memory_plan/start_check.py``, ``system.memory_check``): the run's
   memory plan against this machine's memory, refused in one line when it does not fit.
2. `build` (``job.py``): process groups, data, model, optimizer, LR schedule; free space.
3. `resume` (``resume.py``): verify the checkpoint's files and load it, or start fresh.
4. `train` (``loop.py``): the steps, with logging, evaluation, checkpoints, and a clean exit
   on SIGTERM, on the wall-clock limit or on non-finite steps.
5. `finish` (``loop.py``): the loss plot (never fails the run) and shutdown.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time

from engram_train.logs import quiet_known_warnings

# Known third-party warnings are filtered before anything imports torch or megatron-core (the
# list, and ENGRAM_SHOW_WARNINGS=1 to keep them: engram_train/logs.py).
quiet_known_warnings()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from engram_train.config import register, typed_run_config  # noqa: E402
from engram_train.errors import ConfigError, EngramError  # noqa: E402
from engram_train.logs import console  # noqa: E402
from engram_train.memory_plan.start_check import check_memory  # noqa: E402
from engram_train.models.presets import CONF_DIR  # noqa: E402
from engram_train.training.plan import check  # noqa: E402

log = logging.getLogger("engram_train")


def run(cfg: DictConfig) -> dict:
    """Train as configured; returns the final metrics of this rank (for tests/tools)."""
    cfg = typed_run_config(cfg)  # a config composed by hand or saved by an older version
    plan = check(cfg)
    # Whether the run fits this machine, by its memory plan (the model built on the meta
    # device), before anything large exists: `system.memory_check`.
    check_memory(cfg, plan.tokenizer.vocab_size)
    # The later stages import megatron's data, model and optimizer modules: only once the
    # config has passed `check`, so that a config error shows at once.
    from engram_train.training.job import build
    from engram_train.training.loop import finish, train
    from engram_train.training.resume import resume

    job = build(cfg, plan)
    progress = resume(job, plan)
    if progress.iteration >= cfg.train.train_iters:
        _nothing_to_train(job, progress)
        finish(job, plot=False)
        return {}
    last = train(job, progress)
    finish(job)
    return last


def _nothing_to_train(job, progress) -> None:
    """Resumed at or past ``train.train_iters``: say so (exit code 0, no step, no save)."""
    t = job.cfg.train
    job.metrics.close()
    if job.rank == 0:
        console(
            f"engram-train: nothing to train: the checkpoint is at iteration {progress.iteration} and "
            f"train.train_iters={t.train_iters}. To train further, raise train.train_iters (a longer "
            "schedule also needs checkpoint.override_opt_param_scheduler=true or "
            "checkpoint.use_checkpoint_opt_param_scheduler=true, docs/reliability.md)"
        )


def _exit_with_message(message: str) -> None:
    """Exit with code 1 after printing ``message`` once per node, without a traceback.

    A config or input error is raised identically on every rank: the node's first rank
    (LOCAL_RANK 0, or a process started without torchrun) prints it; the other ranks wait a
    moment before exiting, so that torchrun, which stops the remaining workers as soon as one
    exits, does not stop the printing rank first. (torchrun then reports the failed workers
    in its own summary.)
    """
    if os.environ.get("LOCAL_RANK", "0") == "0":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # every rank raised it; this one reports
            message += f"\n(reported by rank {os.environ.get('RANK', '0')} of {world})"
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    raise SystemExit(1)


def interrupted_message(cfg: DictConfig) -> str:
    """What Ctrl-C (SIGINT) leaves: the newest complete checkpoint. A save it cut short leaves
    only ``iter_N.tmp``, which the next save removes."""
    from engram_train.checkpoint.layout import iteration_dir, latest_iteration

    save = cfg.checkpoint.save
    if not save:
        return "interrupted; checkpoint.save is not set, so nothing was saved"
    last = latest_iteration(save)
    if last is None:
        return f"interrupted; no complete checkpoint in {save} yet"
    return (f"interrupted; last complete checkpoint {last} ({iteration_dir(save, last)}); resume "
            f"with checkpoint.load={save}")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def _main(cfg: DictConfig) -> None:
    """Errors the project raises on purpose (bad config or input, a refused checkpoint, a
    diverged run: `EngramError`) end with their message and exit code 1; anything else keeps
    its traceback."""
    _speak()
    try:
        run(cfg)
    except KeyboardInterrupt:
        _exit_with_message(f"engram-train: {interrupted_message(cfg)}")
    except EngramError as e:
        what = "invalid configuration: " if isinstance(e, ConfigError) else ""
        _exit_with_message(f"engram-train: {what}{e}")


_quiet: contextlib.redirect_stderr | None = None
"""A non-first rank's stderr, redirected while its config is composed (`main`)."""


def _speak() -> None:
    global _quiet
    if _quiet is not None:
        _quiet.__exit__(None, None, None)
        _quiet = None


def main() -> None:
    """The console script. Hydra prints a composition error (a wrong type such as
    ``train.lr=abc``, an unknown key) itself, on every rank that composes: a node's first rank
    says it; the other ranks keep quiet until their config is composed (`_speak`)."""
    global _quiet
    if os.environ.get("LOCAL_RANK", "0") != "0":
        _quiet = contextlib.redirect_stderr(io.StringIO())
        _quiet.__enter__()
    register()  # the run config's schema, named by conf/train.yaml's defaults list
    try:
        _main()
    except SystemExit:
        if _quiet is not None:  # failed while composing: rank 0 reports it
            _speak()
            time.sleep(2.0)
        raise
    finally:
        _speak()


if __name__ == "__main__":
    main()
