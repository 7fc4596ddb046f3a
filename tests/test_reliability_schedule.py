"""The LR schedule a resumed run follows, read from the LR it logs (metrics.jsonl), for every
combination of Megatron-LM's two switches and for checkpoints that carry no schedule (an
import: with a fresh optimizer, or the model's weights only).

One base run (1 process, lr 3e-3, 2 iterations) is resumed with lr 1e-4 / min_lr 1e-5 to 4
iterations. The expected values are megatron's warm-up + cosine in samples, written out here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register

from launch import REPO, free_port, torchrun, run_process

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
GBS = 8
SHORT = ["train.eval_interval=null", "train.log_interval=1", "train.lr_warmup_iters=1"]
NEW_LR = ["train.lr=1e-4", "train.min_lr=1e-5"]


def run_trainer(*overrides: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
           "-m", "engram_train.train", *overrides]  # fmt: skip
    proc = run_process(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def logged_lr(exp: Path) -> dict[int, float]:
    lines = (exp / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["lr"] for r in map(json.loads, filter(None, lines))}


def cosine(lr: float, min_lr: float, warmup: int, decay: int, samples: int) -> float:
    """megatron's OptimizerParamScheduler.get_lr (init_lr 0, cosine), in samples."""
    if warmup and samples <= warmup:
        return lr * samples / warmup
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1)


def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    ckpt = root / "ckpt"
    run_trainer(f"experiment.exp_dir={root / 'base'}", f"checkpoint.save={ckpt}", "train.train_iters=2", *SHORT)
    assert logged_lr(root / "base")[2] == pytest.approx(3e-4)  # its own cosine ended at its min_lr
    return root, ckpt


@pytest.mark.parametrize("switch", ["override", "use_checkpoint"])
def test_resume_follows_the_chosen_schedule(base, switch):
    """override: this run's lr/min_lr, counted from the checkpoint's 16 samples; use_checkpoint:
    the checkpoint's (its decay ended at iteration 2, so its min_lr 3e-4)."""
    root, ckpt = base
    exp = root / switch
    out = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.load={ckpt}", "train.train_iters=4", *SHORT,
                      *NEW_LR, f"checkpoint.{switch}_opt_param_scheduler=true")  # fmt: skip
    lrs = logged_lr(exp)
    assert sorted(lrs) == [3, 4], lrs
    for it, lr in lrs.items():
        if switch == "override":
            want = cosine(1e-4, 1e-5, 1 * GBS, 4 * GBS, it * GBS)
        else:
            want = 3e-4
        assert lr == pytest.approx(want, rel=1e-6), (it, lrs)
    which = "this run's (lr 0.0001" if switch == "override" else "the checkpoint's (lr 0.003"
    assert f"LR schedule: {which}" in out and "at sample 16" in out, out[-3000:]


def test_resume_without_a_switch_refuses_a_different_schedule(base):
    from engram_train.training.plan import check
    from engram_train.training.run_identity import ResumeMismatchError

    root, ckpt = base
    with pytest.raises(ResumeMismatchError) as e:
        check(_cfg(f"experiment.exp_dir={root / 'neither'}", f"checkpoint.load={ckpt}", "train.train_iters=2",
                   *SHORT, *NEW_LR))  # fmt: skip
    message = str(e.value)
    assert "train.lr: 0.003 in the checkpoint, 0.0001 here" in message, message
    assert "train.min_lr: 0.0003 in the checkpoint, 1e-05 here" in message, message
    assert "checkpoint.override_opt_param_scheduler=true" in message
    assert "checkpoint.use_checkpoint_opt_param_scheduler=true" in message


@pytest.fixture(scope="module")
def schedule_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule_free")
    (result,) = torchrun("schedule_free_checkpoints.py", 1, out)
    assert set(result["max_lr"]) == {3e-3}  # the optimizer was built for another lr
    return out


@pytest.mark.parametrize("kind", ["with_optimizer", "model_only"])
def test_checkpoint_without_a_schedule_takes_this_runs_from_iteration_0(schedule_free, kind):
    """The continued-pretraining command: lr 3e-4, min_lr 3e-5, warm-up 2 iterations over 4;
    with_optimizer resumes the same model, model_only adds Engram (checkpoint.load_engram=false)."""
    exp = schedule_free / f"run_{kind}"
    engram = ["model.use_engram=false"] if kind == "with_optimizer" else ["checkpoint.load_engram=false"]
    out = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.load={schedule_free / kind}", "train.train_iters=4",
                      "train.eval_interval=null", "train.log_interval=1", "train.lr=3e-4", "train.min_lr=3e-5",
                      "train.lr_warmup_iters=2", *engram)  # fmt: skip
    lrs = logged_lr(exp)
    assert sorted(lrs) == [1, 2, 3, 4], lrs
    for it, lr in lrs.items():
        assert lr == pytest.approx(cosine(3e-4, 3e-5, 2 * GBS, 4 * GBS, it * GBS), rel=1e-6), (it, lrs)
    assert "at sample 0 (the checkpoint carries no schedule)" in out, out[-3000:]
    assert ("holds no optimizer state" in out) == (kind == "model_only"), out[-3000:]
